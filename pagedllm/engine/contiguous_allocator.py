"""The pre-PagedAttention baseline: one contiguous run of slots per request.

Same KV tensor, same block size, same attention path (a run of blocks
``[s, s+1, ..., s+k-1]`` is just a block table whose ids happen to be
consecutive); only the policy differs from ``BlockManager``:

- on admission a sequence reserves its *maximum* length up front
  (``seq.reserve_len``: prompt + max_tokens, or max_model_len when the
  output length is taken as unknown), as one run of consecutive blocks,
  found by a first-fit scan from block 0 (O(num_blocks), not O(1));
- the run is released whole when the sequence ends; nothing is shared and
  nothing is cached.

::

    blocks: [AAAA....][BB......][    free    ][CCCCCC..]     A, B, C written: '=' ,
             ^ reserved for A's max length     reserved-but-empty: '.'

When no run is long enough the request waits. A wait while the free blocks
would suffice in total is *external fragmentation*, counted in
``num_fragmentation_waits``.
"""

from __future__ import annotations

from pagedllm.engine.sequence import Sequence


class ContiguousAllocator:
    """First-fit contiguous reservation over the block pool.

    Offers the methods the scheduler calls on ``BlockManager``.

    Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
    """

    enable_prefix_caching = False
    num_groups = 1  # one block table per sequence (no KV cache groups)

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")  # computed by the runner
        # block_size is EngineConfig's, checked there
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.is_free: list[bool] = [True] * num_blocks
        self._num_free = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks
        self.num_fragmentation_waits = 0
        self.num_capacity_waits = 0
        # kept for the engine's statistics; always 0 here
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        self.num_cow_copies = 0

    # --- pool state ----------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def reserved_blocks(self, seq: Sequence) -> int:
        """Blocks a sequence reserves: its maximum length, rounded up."""
        return max(seq.num_blocks, (seq.reserve_len + self.block_size - 1) // self.block_size)

    def find_run(self, num: int) -> int | None:
        """Start of the first run of ``num`` free blocks, scanning from block 0."""
        run = 0
        for block, free in enumerate(self.is_free):
            run = run + 1 if free else 0
            if run == num:
                return block - num + 1
        return None

    # --- the allocator API ---------------------------------------------------
    def can_allocate(self, seq: Sequence, max_num_new_tokens: int | None = None) -> bool:
        return self.find_run(self.reserved_blocks(seq)) is not None

    def allocate(self, seq: Sequence, max_num_new_tokens: int | None = None) -> bool:
        """Reserve one run for the sequence's maximum length; False (and a counted wait) if none fits.

        The run covers every token from the start, so ``max_num_new_tokens``
        (what the first chunk of a prompt needs) is always within it.
        """
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        if max_num_new_tokens is not None and max_num_new_tokens < 1:
            raise ValueError(f"max_num_new_tokens must be >= 1, got {max_num_new_tokens}")
        num = self.reserved_blocks(seq)
        start = self.find_run(num)
        if start is None:
            if num <= self._num_free:
                self.num_fragmentation_waits += 1
            else:
                self.num_capacity_waits += 1
            return False
        for block in range(start, start + num):
            self.is_free[block] = False
            self.ref_counts[block] = 1
        self._num_free -= num
        seq.block_table = list(range(start, start + num))
        seq.num_cached_tokens = 0
        seq.num_computed_tokens = 0
        return True

    def can_append_slot(self, seq: Sequence, num_new_tokens: int | None = None) -> bool:
        return seq.num_blocks <= len(seq.block_table)

    def num_appendable_tokens(self, seq: Sequence) -> int:
        """Tokens past ``num_computed_tokens`` that the reserved run still has slots for."""
        return max(0, len(seq.block_table) * self.block_size - seq.num_computed_tokens)

    def num_missing_blocks(self, seq: Sequence) -> int:
        """Blocks ``seq`` lacks for slots up to ``len(seq)`` (0 while its reservation covers it)."""
        return max(0, seq.num_blocks - len(seq.block_table))

    def append_slot(self, seq: Sequence, num_new_tokens: int | None = None) -> bool:
        """The reservation already covers the maximum length (every chunk); a longer sequence cannot grow."""
        return seq.num_blocks <= len(seq.block_table)

    def free(self, seq: Sequence) -> None:
        """Release the whole run."""
        for block in seq.block_table:
            self.is_free[block] = True
            self.ref_counts[block] = 0
        self._num_free += len(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def fork(self, parent: Sequence, child: Sequence, state_after_step: bool = False) -> None:
        raise ValueError("the contiguous allocator shares no blocks (n > 1, best_of and beam search need 'paged')")

    # --- no prefix cache, no copy-on-write -----------------------------------
    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        return 0

    def record_prefix_lookup(self, seq: Sequence) -> None:
        pass

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        pass

    def take_releasable(self) -> list[tuple[int, int]]:
        """No pages given back: this baseline reserves whole runs ahead, as the systems the seed compares with."""
        return []

    def take_copies(self) -> list[tuple[int, int]]:
        return []

    def next_snapshot_point(self, seq: Sequence) -> int | None:
        """No state snapshots here: no chunk ends for one."""
        return None

    def snapshot_state(self, seq: Sequence, num_tokens: int) -> None:
        """No state snapshots here."""

    def can_checkpoint_state(self) -> bool:
        """No state slots here: a verify step needs no checkpoint."""
        return True

    def checkpoint_state(self, seq: Sequence) -> None:
        """No state slots here: nothing to checkpoint."""

    def take_state_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """No state slots here (the engine refuses a hybrid model with this allocator): no copies."""
        return [], []

    def take_loads(self) -> list[tuple[int, bytes]]:
        """Blocks read back from a disk cache: never any (no prefix cache here)."""
        return []

    def take_state_loads(self) -> list[tuple[int, bytes]]:
        """States read back from a disk cache: never any (no state slots here)."""
        return []

    def confirm_published(self) -> None:
        pass

    def unpublish_unconfirmed(self) -> None:
        pass

    def reset_prefix_cache(self) -> None:
        pass
