"""The KV block pool: free list, reference counts and the prefix cache.

The model runner pre-allocates one cache tensor cut into ``num_blocks`` blocks
of ``block_size`` token slots. This class decides which sequence owns which
block; it never touches the tensor and never imports torch.

Free blocks sit in one of two places::

    empty (a heap: lowest id first)             cached (LRU order, oldest first)
    [ 0, 3, 7, ... ]                            [ 9, 2, 14, ... ]   hash -> block: {h(A): 9, h(A,B): 2}
      ^ popped first when a block is needed       ^ evicted when no empty block is left

A block whose reference count falls to 0 and holds no cached hash goes back
to *empty*; handing out the lowest id first keeps the blocks in use packed at
the start of the pool, so the cache tensor's pages the OS has backed stay few
and the pages of a drained pool's tail can be given back (``take_releasable``,
``runner/kv_cache.py``). A freed block that keeps its hash goes to the *tail*
of *cached*, so a later prompt with the same prefix can take it back (a cache
hit) until no empty block is left and it is popped for someone else (an
eviction). Blocks of a freed sequence are pushed tail-first, so a prompt's
first blocks, the most shareable ones, are evicted last. An ``OrderedDict``
makes take-back and eviction O(1), the heap makes a pop O(log n).

A block's hash chains the hash of the block before it with the block's token
ids, so a hit on block ``i`` means the whole prefix up to it matches; a hit
still compares the stored token ids to rule out hash collisions. The first
block's parent is ``_NO_PARENT``, but for a longrope model's sequences whose
prompt is longer than its original length (``longrope_switch_len``): their
keys are rotated with the long factors at every position
(``layers/rotary.py``), so their chain starts from ``_LONG_ROPE_PARENT`` and
never meets a shorter prompt's blocks of the same tokens.

The prefix cache on disk (``kv_disk/store.py``, optional). Past the last
block RAM holds, ``allocate`` asks the store for the next blocks of the
chain; those it reads back (checked) take fresh blocks, are published like
computed ones and count as cached tokens, and their bytes wait in
``take_loads`` for the runner to copy into the pool before the step runs.
Blocks a step computed and published go the other way once it ran
(``take_saves``: the runner copies them out and the store writes them).

Copy-on-write. ``fork`` makes a second block table point at the same blocks
(ref counts go up). Before a sequence writes a token into a block whose ref
count is above 1, ``append_slot`` gives it a private copy::

    A, B, C after fork:   [47, 12]  [47, 12]  [47, 12]   refs 47:3, 12:3
    A writes into 12:     [47, 91]                        copy 12 -> 91, 12:2
    B writes into 12:               [47, 34]              copy 12 -> 34, 12:1
    C writes into 12:                         [47, 12]    ref 1: in place

The copies are recorded as (source, destination) pairs; the model runner
copies the K/V data inside the cache tensor before the step runs. Full blocks
are never written again, so they are never copied.

KV cache groups (``kv_groups.py``). A model with sliding-window layers
splits its layers into groups, and a sequence holds one block table per group
(``seq.block_table`` is group 0's, ``seq.group_tables`` the others'). Every
group takes its blocks from the one free list above, so the ref counts, the
prefix cache, copy-on-write and the disk store work on block ids as before;
a group's block hash is the chain hash salted with the group (``_key``). The
tables of one sequence always have the same length (logical block ``i`` in
every group). A window group of ``W`` tokens gives back, before each step, the
blocks that lie wholly before ``num_computed_tokens - W + 1``: no query still
to be computed reads them. Their entries become ``HOLE``, which the runner
maps to block 0 and the attention masks (it is never read for a result)::

    window 8, block_size 4, 14 tokens computed: keys 7.. are still read
    full group    [ 3,  5,  8, 11]
    window group  [ H,  6,  9, 12]       block 4 (tokens 0-3) went back to the pool

A released block goes back only when its ref count falls to 0 (a fork or a
prefix-cache hit still holding it keeps it), and a published one stays in the
prefix cache. A prefix hit at block ``k`` needs every full group's blocks
``0..k-1`` and each window group's blocks from the one holding key
``k * block_size - W + 1`` on. A model without windows has one group: its
block ids are exactly those of the single-table manager.

State slots (a hybrid model's, ``num_state_slots`` > 0: ``engine/state_slots.py``,
docs/hybrid-models.md). Each running sequence holds one slot besides its
blocks: ``allocate`` takes it (and one for each sample waiting to fork from
the prompt, so its forks never find the pool empty), ``can_allocate`` says
False when none is free, ``free`` gives it back (a preemption too). A fork's
child gets its own slot and a (source, destination) state copy: before the
step for a running parent (beam search), after it for a prompt that completes
in the step its samples fork in (their state is the one this step computes)
(``take_state_copies``). A slot holds the state after the sequence's computed
tokens only, so a prefix hit needs the state at the hit point: with prefix
caching, snapshots of it are kept at block boundaries (``num_snapshot_slots``,
``engine/state_snapshots.py``) and a hit is cut to the longest cached prefix
that has one. A prompt's points (``state_snapshot_points``, past its hit):

- its last full block: the next turn of a conversation extends the whole prompt;
- where its cached blocks end without a snapshot there: the end of a prefix
  another prompt shares with it (a system prompt), which the third prompt hits;
- periodic points, every ``state_snapshot_interval`` tokens from token 0 (a
  multiple of the block size, so prompts sharing a prefix have the same
  points in it), of which it keeps the last ``MAX_PERIODIC_SNAPSHOTS`` (at
  most a quarter of the pool): the second prompt sharing a system prompt
  hits its last periodic point inside it, before the end of it is known::

    block 16, interval 1024, system prompt S of 3000 tokens (its full blocks end at 2992)
    A = S + 200 tokens: no hit, points 1024, 2048, 3072 (periodic), 3184 (its last full block)
    B = S + 300 others: hits 2048, points 2992 (its cached blocks end), 3072, 3296
    C = S + 100 others: hits 2992

The scheduler ends a chunk at each point, the state is copied after that
step. Each point costs a chunk end (one more step for the prompt: the weights
read once more and the step's fixed cost, small beside a chunk of 1024
tokens, and nothing where chunks are shorter anyway) and a snapshot slot
(the pool is fixed: as many as the running slots, so the points decide only
what it keeps); the cap bounds both per prompt: at most 4 + 2 points, so a
pool of ``max_num_seqs`` = 128 keeps the snapshots of 21 long prompts at
least, and a small pool gives one prompt a quarter of it. The interval, 1024
by default: the second prompt recomputes at most one interval of the shared
part; 512 would halve that but double the chunk ends, and reach half as far
back from a prompt's end under the same cap. Why the last periodic points:
a hit saves the tokens before it, so the points late in a long shared part
save the most (a long system prompt of tools), and a shared part that ends
before them is still hit by the third prompt at its end.

With the prefix cache on disk (``state_disk``, a store of its own
beside the K/V one), each snapshot is also written to a state file under its
block's hash once its step has run (``take_state_saves``: the runner copies
the snapshot slot out); a lookup past RAM counts disk blocks too and is cut
to the longest prefix whose last block has a state, a snapshot in RAM or a
state file. A state file is read (and checked) at admission, as the K/V
files are, and its bytes wait in ``take_state_loads`` for the runner to write
into the sequence's slot before its first step; a bad one shortens the hit
to the next state further back (or none: the prompt is computed from zero).
"""

from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from collections.abc import Sequence as Sequence_

import xxhash

from pagedllm.engine.sequence import Sequence
from pagedllm.engine.state_slots import StateSlots
from pagedllm.engine.state_snapshots import StateSnapshots
from pagedllm.kv_disk.store import DiskBlockStore

_NO_PARENT = 0
HOLE = -1  # a window group's table entry for a block given back (out of the window): never read
_LONG_ROPE_PARENT = 1  # the chain of a longrope model's long-prompt sequences (see the module docstring)
# the most periodic state snapshot points a prompt keeps (its last ones; see the module docstring)
MAX_PERIODIC_SNAPSHOTS = 4


def _check_max_new(max_num_new_tokens: int | None) -> None:
    if max_num_new_tokens is not None and max_num_new_tokens < 1:
        raise ValueError(f"max_num_new_tokens must be >= 1, got {max_num_new_tokens}")


def _num_holes(table: list[int]) -> int:
    """How many ``HOLE`` entries start ``table`` (they are always a prefix): a binary search."""
    lo, hi = 0, len(table)
    while lo < hi:
        mid = (lo + hi) // 2
        if table[mid] == HOLE:
            lo = mid + 1
        else:
            hi = mid
    return lo


def hash_block(parent_hash: int, token_ids: list[int]) -> int:
    """Chained hash of one full block: (parent hash, token ids) -> 64-bit int."""
    h = xxhash.xxh3_64()
    h.update(parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


def extend_block_hashes(hashes: list[int], blocks: Iterable[Sequence_[int]], root: int = _NO_PARENT) -> list[int]:
    """Extend the hash chain ``hashes`` (in place) by one hash per full block of token ids; returns it.

    The prefix cache's chain: the first block's parent is ``root`` (``_NO_PARENT``, or ``_LONG_ROPE_PARENT``).
    The data-parallel router calls it on prompts in the server process.
    """
    for tokens in blocks:
        hashes.append(hash_block(hashes[-1] if hashes else root, list(tokens)))
    return hashes


class BlockManager:
    """Hands out KV cache blocks to sequences.

    Args:
        num_blocks: blocks in the pool (the cache tensor's first dimension).
        block_size: token slots per block.
        enable_prefix_caching: reuse full blocks whose chained hash matches.
        longrope_switch_len: the model's longrope original length (``ModelArchConfig.longrope_switch_len``):
            sequences with longer prompts hash from their own root; None: every sequence from one.
        disk: the prefix cache on disk, or None (with prefix caching only).
        group_windows: each KV cache group's sliding window in tokens, None for full attention
            (``KVCacheLayout.windows``); the default is one full-attention group.
        num_state_slots: a hybrid model's state slots (one per running sequence); 0: the model has no state layers.
        num_snapshot_slots: slots for state snapshots of cached prefixes (ids after the running ones; with prefix
            caching and state slots only).
        state_snapshot_interval: tokens between a prompt's periodic state snapshot points, a multiple of
            ``block_size`` (``ResolvedConfig.state_snapshot_interval``); 0: none (with snapshot slots only).
        num_checkpoint_slots: slots for speculative decoding's state checkpoints (ids after the snapshots').
        state_disk: a hybrid model's state snapshots on disk, keyed by block hash like ``disk``'s blocks (with
            ``disk`` and snapshots only; None: the disk's K/V blocks are not used for such a model).
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
        longrope_switch_len: int | None = None, disk: DiskBlockStore | None = None,
        group_windows: Sequence_[int | None] = (None,), num_state_slots: int = 0, num_snapshot_slots: int = 0,
        num_checkpoint_slots: int = 0, state_snapshot_interval: int = 0,
        state_disk: DiskBlockStore | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")  # computed by the runner
        if not group_windows:
            raise ValueError("a block manager needs at least one KV cache group")
        bad = [w for w in group_windows if w is not None and w < 1]
        if bad:
            raise ValueError(f"a sliding window must be >= 1 token, got {bad[0]}")
        self.group_windows: tuple[int | None, ...] = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        # the group each block was last handed out to (for the per-group counts of /kv and bench memory)
        self.block_group: list[int] = [0] * num_blocks
        # blocks window groups gave back because they left every window still to be read
        self.num_window_released = 0
        self.window_released_per_group: list[int] = [0] * self.num_groups  # the same, per group
        # block_size is EngineConfig's, checked there
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.longrope_switch_len = longrope_switch_len
        # Free blocks (ref count 0): those holding nothing, lowest id first (already a heap),
        # and those holding a cached hash, least recently freed first.
        self._empty: list[int] = list(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        # blocks handed out since their pages were last given back (runner/kv_cache.py)
        self._touched: set[int] = set()
        self.ref_counts: list[int] = [0] * num_blocks
        # Prefix cache: each registered block remembers its hash and tokens.
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_token_ids: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Prefix-cache statistics, in tokens (for metrics and benchmarks).
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        # blocks published since the last step ran: their K/V is written only when it does
        self._unconfirmed: list[int] = []
        # copy-on-write copies decided since the last take_copies()
        self._pending_copies: list[tuple[int, int]] = []
        self.num_cow_copies = 0
        self.disk = disk if enable_prefix_caching else None
        # blocks read back from disk this step: (block id, K/V bytes) for the runner, before the step runs
        self._pending_loads: list[tuple[int, bytes]] = []
        # blocks loaded from disk among the unconfirmed ones: not written back
        self._loaded: set[int] = set()
        # blocks a step computed and published, for the disk: (block id, hash, token ids)
        self._pending_saves: list[tuple[int, int, tuple[int, ...]]] = []
        if num_state_slots < 0:
            raise ValueError(f"num_state_slots must be >= 0, got {num_state_slots}")
        if num_state_slots and self.num_groups > 1:
            raise ValueError("state slots beside sliding-window KV cache groups are not supported yet")
        self.state_slots = StateSlots(num_state_slots) if num_state_slots else None
        self.snapshots = (StateSnapshots(num_state_slots, num_snapshot_slots)
                          if num_state_slots and num_snapshot_slots and enable_prefix_caching else None)
        if state_snapshot_interval < 0 or state_snapshot_interval % block_size:
            raise ValueError(f"state_snapshot_interval must be a multiple of block_size={block_size} (0: none), "
                             f"got {state_snapshot_interval}")
        self.state_snapshot_interval = state_snapshot_interval
        if num_checkpoint_slots < 0:
            raise ValueError(f"num_checkpoint_slots must be >= 0, got {num_checkpoint_slots}")
        # speculative decoding's checkpoints (the state before a verify step's drafts), after the snapshots
        self.checkpoints = (StateSlots(num_checkpoint_slots, num_state_slots + num_snapshot_slots)
                            if num_state_slots and num_checkpoint_slots else None)
        # forks' (source, destination) state slot copies: before the next step, and after it
        self._state_copies_before: list[tuple[int, int]] = []
        self._state_copies_after: list[tuple[int, int]] = []
        # a hybrid model's states on disk: without it no disk hit can start from a state
        self.state_disk = state_disk if self.snapshots is not None and self.disk is not None else None
        # states read back from disk: (state slot, bytes) for the runner, before the step runs
        self._pending_state_loads: list[tuple[int, bytes]] = []
        # snapshots a step computed, for the disk: (snapshot slot, block hash, the block's token ids)
        self._pending_state_saves: list[tuple[int, int, tuple[int, ...]]] = []

    # --- pool state ----------------------------------------------------------
    @property
    def free_blocks(self) -> list[int]:
        """The free blocks in the order they would be handed out: empty ones lowest id first, then cached ones."""
        return sorted(self._empty) + list(self._cached_free)

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any sequence (cached-but-unreferenced count as free)."""
        return len(self._empty) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_touched_blocks(self) -> int:
        """Blocks written since their pages were last given back: an upper bound on the pool's resident blocks."""
        return len(self._touched)

    def num_used_blocks_per_group(self) -> list[int]:
        """Blocks held by at least one sequence, per KV cache group."""
        counts = [0] * self.num_groups
        for block, refs in enumerate(self.ref_counts):
            if refs:
                counts[self.block_group[block]] += 1
        return counts

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences, 0..1."""
        return self.num_used_blocks / self.num_blocks

    # --- hashing -------------------------------------------------------------
    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        """Chained hashes of the first ``num_full_blocks`` blocks (memoised on seq)."""
        hashes = seq.block_hashes
        switch = self.longrope_switch_len
        root = _LONG_ROPE_PARENT if switch is not None and seq.num_prompt_tokens > switch else _NO_PARENT
        extend_block_hashes(hashes, (seq.block_tokens(i) for i in range(len(hashes), num_full_blocks)), root)
        return hashes[:num_full_blocks]

    def _key(self, block_hash: int, group: int) -> int:
        """The prefix-cache key of a block of ``group``: group 0's is the chain hash itself (one-group models
        keep their keys and disk files), the others' salt it with the group."""
        return block_hash if group == 0 else hash_block(block_hash, [-1 - group])

    def _first_needed(self, group: int, num_computed: int) -> int:
        """The first logical block of ``group`` that a query at ``num_computed`` or later still reads."""
        window = self.group_windows[group]
        return 0 if window is None else max(0, num_computed - window + 1) // self.block_size

    def _tables(self, seq: Sequence) -> list[list[int]]:
        """``seq``'s block table of each group (the lists themselves)."""
        return [seq.block_table, *seq.group_tables] if self.num_groups > 1 else [seq.block_table]

    def _set_tables(self, seq: Sequence, tables: list[list[int]]) -> None:
        seq.block_table = tables[0]
        seq.group_tables = tables[1:]

    def _cached_block(self, seq: Sequence, hashes: list[int], i: int, group: int) -> int | None:
        """The cached block of ``group`` holding block ``i`` of ``seq`` (tokens compared), or None."""
        block = self.hash_to_block.get(self._key(hashes[i], group))
        if block is None or self.block_token_ids[block] != tuple(seq.block_tokens(i)):
            return None
        return block

    def _prefix_hits(self, seq: Sequence) -> tuple[list[list[int]], int]:
        """Each group's RAM blocks of the longest usable cached prefix of ``seq`` (window groups: ``HOLE`` before
        their window), and how many blocks right after them the disk holds files of.

        Only blocks inside the first ``len(seq) - 1`` tokens count: the last
        token is always computed, because its logits are needed to sample.
        A hybrid model's hit needs the state at its end: it is cut to the
        longest prefix whose last block has one (a snapshot in RAM, or a
        state file on disk).
        """
        tables = self._lookup_blocks(seq)
        num_ram = len(tables[0])
        num_disk = self._num_disk_hits(seq, num_ram)
        if self.state_slots is None or not num_ram + num_disk:
            return tables, num_disk
        # (a model with state slots has one KV cache group: __init__ refuses windows beside state layers)
        num = num_ram + num_disk
        hashes = self._block_hashes(seq, num)
        while num and not self._has_state(hashes[num - 1]):
            num -= 1
        return [tables[0][: min(num, num_ram)]], max(0, num - num_ram)

    def _has_state(self, block_hash: int) -> bool:
        """Whether the state after the block ``block_hash`` is kept: a snapshot in RAM, or a file on disk
        (its contents are checked only when read)."""
        if self.snapshots is not None and self.snapshots.has(block_hash):
            return True
        return self.state_disk is not None and self.state_disk.contains(block_hash)

    def _lookup_blocks(self, seq: Sequence) -> list[list[int]]:
        """Each group's blocks of the longest cached prefix of ``seq`` (K/V only; see ``_prefix_hits``)."""
        if not self.enable_prefix_caching or not seq.allow_prefix_hits:
            return [[] for _ in range(self.num_groups)]
        hashes = self._block_hashes(seq, (len(seq) - 1) // self.block_size)
        num_hits = len(hashes)
        runs: dict[int, list[int]] = {}
        for g in (g for g, w in enumerate(self.group_windows) if w is None):
            run: list[int] = []
            for i in range(num_hits):
                block = self._cached_block(seq, hashes, i, g)
                if block is None:
                    break
                run.append(block)
            runs[g] = run
            num_hits = len(run)
        found = {g: [self._cached_block(seq, hashes, i, g) for i in range(num_hits)]
                 for g, w in enumerate(self.group_windows) if w is not None}
        while num_hits and not all(
            None not in blocks[self._first_needed(g, num_hits * self.block_size) : num_hits]
            for g, blocks in found.items()
        ):
            num_hits -= 1  # a window group misses a block the queries after the hit still read
        tables: list[list[int]] = []
        for g in range(self.num_groups):
            if g in runs:
                tables.append(runs[g][:num_hits])
            else:
                first = self._first_needed(g, num_hits * self.block_size)
                tables.append([HOLE] * first + [b for b in found[g][first:num_hits] if b is not None])
        return tables

    def _num_disk_hits(self, seq: Sequence, num_ram_hits: int) -> int:
        """Blocks after the first ``num_ram_hits`` that the disk holds files of, in a row (contents unchecked)."""
        if self.disk is None or not seq.allow_prefix_hits or (self.state_slots is not None and self.state_disk is None):
            return 0
        num_lookup = (len(seq) - 1) // self.block_size
        hashes = self._block_hashes(seq, num_lookup)
        num = 0
        for h in hashes[num_ram_hits:]:
            # RAM holds it (another prompt's block, after a gap) or the disk lacks a group's block
            if h in self.hash_to_block or not all(self.disk.contains(self._key(h, g)) for g in range(self.num_groups)):
                break
            num += 1
        return num

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq`` that ``allocate(seq)`` would find cached right now (in RAM or on disk)."""
        tables, num_disk = self._prefix_hits(seq)
        return (len(tables[0]) + num_disk) * self.block_size

    # --- free list -----------------------------------------------------------
    def _pop_free_block(self, group: int = 0) -> int:
        """Take the lowest empty block for ``group``, else evict the least recently freed cached one."""
        if self._empty:
            block = heapq.heappop(self._empty)
        else:
            block, _ = self._cached_free.popitem(last=False)
            self._uncache(block)
        self.ref_counts[block] = 1
        self.block_group[block] = group
        self._touched.add(block)
        return block

    def _uncache(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            if self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
                if self.snapshots is not None:  # a snapshot goes with its block
                    self.snapshots.drop(h)
            self.block_hash[block] = None
            self.block_token_ids[block] = None
            if block in self._cached_free:  # free and now holding nothing: empty
                del self._cached_free[block]
                heapq.heappush(self._empty, block)

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.block_hash[block] is not None:
                self._cached_free[block] = None  # to the tail: evicted last
            else:
                heapq.heappush(self._empty, block)
            if self._pending_loads:
                self._pending_loads = [p for p in self._pending_loads if p[0] != block]
            if self._pending_copies:
                # a copy into a block freed before the step runs is moot, and
                # the block may be handed out again (even as another copy's
                # destination) within the same step
                self._pending_copies = [c for c in self._pending_copies if c[1] != block]

    # --- the allocator API ---------------------------------------------------
    def can_allocate(self, seq: Sequence, max_num_new_tokens: int | None = None) -> bool:
        """Whether ``allocate(seq, max_num_new_tokens)`` would succeed now."""
        _check_max_new(max_num_new_tokens)
        if not self._has_state_slots_for(seq):
            return False
        hits, num_disk = self._prefix_hits(seq)
        return self._num_blocks_short(seq, hits, max_num_new_tokens, num_disk) <= 0

    def _has_state_slots_for(self, seq: Sequence) -> bool:
        """Whether a slot is free for ``seq`` and each sample waiting to fork from it (always, without slots)."""
        return self.state_slots is None or self.state_slots.num_free >= 1 + len(seq.fork_children)

    def _num_blocks_needed(self, seq: Sequence, num_hits: int, max_num_new_tokens: int | None) -> int:
        """Blocks (per group) covering the cached prefix (``num_hits`` blocks) plus the first chunk of new tokens."""
        num_tokens = len(seq)
        if max_num_new_tokens is not None:
            num_tokens = min(num_tokens, num_hits * self.block_size + max_num_new_tokens)
        return -(-num_tokens // self.block_size)

    def _num_blocks_short(
        self, seq: Sequence, hits: list[list[int]], max_num_new_tokens: int | None, num_disk: int = 0
    ) -> int:
        # hits that sit in the free list leave it when taken, so they count
        # against the free blocks as well; a disk hit takes a fresh block like a new one
        num_hits = len(hits[0])
        num_new = (self._num_blocks_needed(seq, num_hits + num_disk, max_num_new_tokens) - num_hits) * self.num_groups
        num_free_hits = sum(1 for table in hits for b in table if b != HOLE and self.ref_counts[b] == 0)
        return num_new + num_free_hits - self.num_free_blocks

    def allocate(self, seq: Sequence, max_num_new_tokens: int | None = None) -> bool:
        """Give a waiting sequence blocks for its cached prefix and its first chunk.

        Reuses cached prefix blocks where possible and sets
        ``seq.num_computed_tokens`` to the number of tokens whose K/V is
        already there. The new tokens after them get blocks up to
        ``max_num_new_tokens`` (None: all of them) in every group; a prompt
        computed in chunks takes the blocks of later chunks as it reaches
        them (``append_slot``). Returns False, taking nothing, when the pool
        is short.
        """
        if seq.block_table or seq.group_tables:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        _check_max_new(max_num_new_tokens)
        if not self._has_state_slots_for(seq):
            return False
        tables, num_disk = self._prefix_hits(seq)
        num_ram = len(tables[0])
        if self._num_blocks_short(seq, tables, max_num_new_tokens, num_disk) > 0:
            return False
        # read (and checked) before anything is taken: a bad file shortens the prefix, and fewer disk
        # hits never need more blocks than the check above counted
        state: bytes | None = None
        if self.state_slots is None:
            payloads = self._read_disk_blocks(seq, num_ram, num_disk)
            num_hits = num_ram + min((len(p) for p in payloads), default=0)
        else:
            num_hits, payloads, state = self._read_hybrid_hit(seq, num_ram, num_disk)
            if num_hits < num_ram:
                tables, num_ram = [tables[0][:num_hits]], num_hits
                if self._num_blocks_short(seq, tables, max_num_new_tokens) > 0:
                    return False  # RAM hits another sequence holds are computed afresh now: the pool is short
        firsts = [self._first_needed(g, num_hits * self.block_size) for g in range(self.num_groups)]
        for first, table in zip(firsts, tables):
            # blocks the disk hits moved out of a window group's window are not taken (their entries hold none)
            table[: min(first, num_ram)] = [HOLE] * min(first, num_ram)
            for block in table:
                if block == HOLE:
                    continue
                if self.ref_counts[block] == 0:
                    del self._cached_free[block]  # a hit holds a hash: it was free among the cached
                self.ref_counts[block] += 1
        num_needed = self._num_blocks_needed(seq, num_hits, max_num_new_tokens)
        for g, (first, table) in enumerate(zip(firsts, tables)):
            for i in range(num_ram, num_hits):
                table.append(HOLE if i < first else self._load_block(seq, i, payloads[g][i - num_ram], g))
            for _ in range(num_needed - num_hits):
                table.append(self._pop_free_block(g))
        self._set_tables(seq, tables)
        seq.num_cached_tokens = num_hits * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        if self.state_slots is not None:
            for s in (seq, *seq.fork_children):
                if s.state_slot is None:
                    s.state_slot = self.state_slots.take()
            self._plan_snapshots(seq, num_hits, state)
        return True

    def _read_hybrid_hit(
        self, seq: Sequence, num_ram: int, num_disk: int
    ) -> tuple[int, list[list[bytes]], bytes | None]:
        """A hybrid model's hit of at most ``num_ram + num_disk`` blocks, read and checked: the state at its end
        first (a bad state file: the next state further back), then the disk blocks up to it (a bad one: the hit
        ends at a state before it). Returns the hit's length in blocks, the disk blocks' bytes (group 0's list,
        as ``_read_disk_blocks``) and the state's bytes (None: a snapshot in RAM holds it, or there is no hit)."""
        num = num_ram + num_disk
        while True:
            num, state = self._find_state(seq, num)
            if num <= num_ram:
                return num, [], state
            payloads = self._read_disk_blocks(seq, num_ram, num - num_ram)
            got = num_ram + min((len(p) for p in payloads), default=0)
            if got == num:
                return num, payloads, state
            num = got  # a K/V file before the state was bad: the state further back, if any

    def _find_state(self, seq: Sequence, num_hits: int) -> tuple[int, bytes | None]:
        """The longest hit of at most ``num_hits`` blocks of ``seq`` whose state is kept, and the state's bytes
        where a file on disk holds it (None: a snapshot in RAM does). 0 blocks: no state, no hit."""
        hashes = self._block_hashes(seq, num_hits)
        for num in range(num_hits, 0, -1):
            h = hashes[num - 1]
            if self.snapshots is not None and self.snapshots.has(h):
                return num, None
            if self.state_disk is not None and self.state_disk.contains(h):
                found = self.state_disk.read_chain([h], [tuple(seq.block_tokens(num - 1))])
                if found:
                    return num, found[0]
        return 0, None

    def _plan_snapshots(self, seq: Sequence, num_hits: int, state: bytes | None = None) -> None:
        """A hybrid model's admitted sequence: its hit's state copied in (from a snapshot slot, or ``state``'s
        bytes read from disk), and where its state is snapshotted."""
        seq.state_snapshot_points = []
        if self.snapshots is None:
            return
        bs = self.block_size
        if num_hits and state is not None:
            self._pending_state_loads.append((seq.state_slot, state))
        elif num_hits:
            slot = self.snapshots.find(self._block_hashes(seq, num_hits)[num_hits - 1])
            if slot is None:  # _find_state cut the hit to a snapshot
                raise RuntimeError("a hybrid model's prefix hit has no state snapshot")
            self._state_copies_before.append((slot, seq.state_slot))
        shared = len(self._lookup_blocks(seq)[0]) * bs  # where the blocks another prompt cached end
        last = (len(seq) - 1) // bs * bs  # the last full block a later lookup can reach
        points = {p for p in (shared, last) if p > num_hits * bs}
        seq.state_snapshot_points = sorted(points.union(self._periodic_points(num_hits * bs, last)))

    def _periodic_points(self, start: int, end: int) -> range:
        """The periodic snapshot points strictly between ``start`` and ``end`` tokens that a prompt keeps: the
        multiples of the interval there, the last ``MAX_PERIODIC_SNAPSHOTS`` of them (a quarter of the pool)."""
        interval = self.state_snapshot_interval
        keep = min(MAX_PERIODIC_SNAPSHOTS, self.snapshots.num_slots // 4) if self.snapshots is not None else 0
        if not interval or not keep:
            return range(0)
        return range(start // interval * interval + interval, end, interval)[-keep:]

    def next_snapshot_point(self, seq: Sequence) -> int | None:
        """The first token count past ``seq``'s computed ones whose state is snapshotted (a chunk ends there)."""
        return next((p for p in seq.state_snapshot_points if p > seq.num_computed_tokens), None)

    def snapshot_state(self, seq: Sequence, num_tokens: int) -> None:
        """Keep a snapshot of ``seq``'s state after ``num_tokens`` tokens, computed in the step being planned,
        where that is one of its points and the block it ends with is cached (a copy after the step)."""
        if self.snapshots is None or num_tokens not in seq.state_snapshot_points or seq.state_slot is None:
            return
        h = self._block_hashes(seq, num_tokens // self.block_size)[-1]
        if h not in self.hash_to_block:
            return  # another block of the same content holds the hash, or none: nothing to key it by
        slot = self.snapshots.take(h)
        if slot is not None:
            self._state_copies_after.append((seq.state_slot, slot))

    def _read_disk_blocks(self, seq: Sequence, first: int, num: int) -> list[list[bytes]]:
        """Per group, the K/V bytes of blocks ``first .. first + num - 1`` of ``seq`` from disk, up to the first
        bad one (the caller uses as many blocks as every group read)."""
        if not num or self.disk is None:
            return []
        hashes = self._block_hashes(seq, first + num)[first:]
        tokens = [tuple(seq.block_tokens(i)) for i in range(first, first + num)]
        payloads: list[list[bytes]] = []
        for g in range(self.num_groups):
            payloads.append(self.disk.read_chain([self._key(h, g) for h in hashes], tokens))
            if not payloads[-1]:
                break  # no use reading the other groups
        return payloads

    def _load_block(self, seq: Sequence, index: int, payload: bytes, group: int = 0) -> int:
        """A fresh block of ``group`` for block ``index`` of ``seq`` that the runner fills with ``payload``,
        published now (an identical prompt admitted in this same step hits it, as a computed block)."""
        block = self._pop_free_block(group)
        h = self._key(self._block_hashes(seq, index + 1)[index], group)
        self.block_hash[block] = h
        self.block_token_ids[block] = tuple(seq.block_tokens(index))
        self.hash_to_block[h] = block
        self._unconfirmed.append(block)
        self._loaded.add(block)
        self._pending_loads.append((block, payload))
        return block

    def take_loads(self) -> list[tuple[int, bytes]]:
        """The (block id, K/V bytes) pairs read from disk since the last call: the runner writes them first."""
        loads, self._pending_loads = self._pending_loads, []
        return loads

    def take_state_loads(self) -> list[tuple[int, bytes]]:
        """A hybrid model's (state slot, state bytes) pairs read from disk since the last call: the runner
        writes them into the slots before the step runs."""
        loads, self._pending_state_loads = self._pending_state_loads, []
        return loads

    def take_state_saves(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """(snapshot slot, block hash, the block's token ids) of the state snapshots the steps confirmed since
        the last call took, not yet on disk: the runner copies their slots out for the state store to write."""
        saves, self._pending_state_saves = self._pending_state_saves, []
        return saves

    def take_saves(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """(block id, hash, token ids) of the blocks computed and published by the steps confirmed since the
        last call, not yet on disk: the runner copies their K/V out for the store to write."""
        saves, self._pending_saves = self._pending_saves, []
        return saves

    def record_prefix_lookup(self, seq: Sequence) -> None:
        """Count an admitted sequence's tokens as prefix-cache queries and hits."""
        if self.enable_prefix_caching:
            self.num_prefix_queries += len(seq)
            self.num_prefix_hits += seq.num_cached_tokens

    def _shared_write_blocks(self, seq: Sequence) -> list[tuple[int, int]]:
        """(group, logical index) of the shared blocks that the next step writes into."""
        first = seq.num_computed_tokens // self.block_size
        return [(g, i) for g, table in enumerate(self._tables(seq)) for i in range(first, len(table))
                if table[i] != HOLE and self.ref_counts[table[i]] > 1]

    def _num_blocks_missing(self, seq: Sequence, num_new_tokens: int | None) -> int:
        """Blocks each group's table lacks for the next ``num_new_tokens`` (None: up to ``len(seq)``)."""
        if num_new_tokens is not None and not 1 <= num_new_tokens <= len(seq) - seq.num_computed_tokens:
            raise ValueError(
                f"num_new_tokens must be 1..{len(seq) - seq.num_computed_tokens} (the uncomputed tokens), "
                f"got {num_new_tokens}"
            )
        end = len(seq) if num_new_tokens is None else seq.num_computed_tokens + num_new_tokens
        return max(0, -(-end // self.block_size) - len(seq.block_table))

    def num_missing_blocks(self, seq: Sequence) -> int:
        """Fresh blocks (all groups together) that ``seq`` lacks for slots up to ``len(seq)``."""
        return max(0, -(-len(seq) // self.block_size) - len(seq.block_table)) * self.num_groups

    def _trim_windows(self, seq: Sequence) -> None:
        """Give back each window group's blocks that no query from ``num_computed_tokens`` on reads.

        Always safe: the computed length only moves back by ``rollback``,
        which refuses to go below what these blocks held.
        """
        if self.num_groups == 1 and self.group_windows[0] is None:
            return
        for g, table in enumerate(self._tables(seq)):
            if self.group_windows[g] is None:
                continue
            first = min(self._first_needed(g, seq.num_computed_tokens), len(table))
            for i in range(first - 1, _num_holes(table) - 1, -1):
                self._release(table[i])
                table[i] = HOLE
                self.num_window_released += 1
                self.window_released_per_group[g] += 1

    def can_append_slot(self, seq: Sequence, num_new_tokens: int | None = None) -> bool:
        """Whether ``append_slot(seq, num_new_tokens)`` would succeed now (window blocks left behind go back)."""
        self._trim_windows(seq)
        missing = self._num_blocks_missing(seq, num_new_tokens) * self.num_groups
        return missing + len(self._shared_write_blocks(seq)) <= self.num_free_blocks

    def num_appendable_tokens(self, seq: Sequence) -> int:
        """Tokens past ``num_computed_tokens`` that ``append_slot`` could give slots to now.

        What the blocks already held and the free blocks cover (a new
        logical block takes one block per group), less one free block for
        each shared block in the write range (its copy). Window blocks left
        behind go back to the pool first.
        """
        self._trim_windows(seq)
        shared = len(self._shared_write_blocks(seq))
        num_new = max(0, self.num_free_blocks - shared) // self.num_groups
        capacity = (len(seq.block_table) + num_new) * self.block_size
        return max(0, capacity - seq.num_computed_tokens)

    def append_slot(self, seq: Sequence, num_new_tokens: int | None = None) -> bool:
        """Make every token that the next step writes land in a private block.

        Called before a step that computes ``num_new_tokens`` tokens of
        ``seq`` from ``num_computed_tokens`` on (None: up to ``len(seq)``;
        a decode's one token, or the next chunk of a prompt). Window groups
        first give back the blocks no query from here on reads. New blocks
        are taken past the last one in every group; a shared block in that
        range is first copied (copy-on-write). Returns False, taking
        nothing more, when the pool is short.
        """
        self._trim_windows(seq)
        shared = self._shared_write_blocks(seq)
        missing = self._num_blocks_missing(seq, num_new_tokens)
        if missing * self.num_groups + len(shared) > self.num_free_blocks:
            return False
        tables = self._tables(seq)
        for g, i in shared:
            old = tables[g][i]
            new = self._pop_free_block(g)
            self.ref_counts[old] -= 1  # still > 0: others hold it
            tables[g][i] = new
            self._pending_copies.append((old, new))
            self.num_cow_copies += 1
        for g, table in enumerate(tables):
            for _ in range(missing):
                table.append(self._pop_free_block(g))
        return True

    def can_checkpoint_state(self) -> bool:
        """Whether a verify step may be planned now: a model without state layers needs no checkpoint, a
        hybrid one needs a free checkpoint slot (without them, its decodes stay plain)."""
        if self.state_slots is None:
            return True
        return self.checkpoints is not None and self.checkpoints.num_free > 0

    def checkpoint_state(self, seq: Sequence) -> None:
        """A hybrid model's ``seq`` is planned as a verify step: its state after its computed tokens is copied
        into a checkpoint slot before the step runs, so ``rollback`` can restore it. No-op without state slots.
        """
        if self.state_slots is None:
            return
        if seq.state_slot is None or seq.state_checkpoint is not None:
            raise ValueError(f"sequence {seq.seq_id} holds no state slot, or a checkpoint already")
        if self.checkpoints is None or not self.checkpoints.num_free:
            raise ValueError("no state checkpoint slot is free (can_checkpoint_state says so first)")
        slot = self.checkpoints.take()
        seq.state_checkpoint = (slot, seq.num_computed_tokens)
        self._state_copies_before.append((seq.state_slot, slot))

    def _give_back_checkpoint(self, seq: Sequence) -> None:
        """Return ``seq``'s checkpoint slot; a copy into it not yet made is moot."""
        if seq.state_checkpoint is None or self.checkpoints is None:
            return
        slot = seq.state_checkpoint[0]
        self.checkpoints.give_back(slot)
        seq.state_checkpoint = None
        self._state_copies_before = [c for c in self._state_copies_before if c[1] != slot]

    def _restore_checkpoint(self, seq: Sequence, num_computed_tokens: int) -> int:
        """A hybrid model's rollback: the computed length it can go back to, its checkpoint's (the state
        after exactly those tokens, copied back into its slot before the next step), or ``num_computed_tokens``
        itself where it keeps every computed token. The checkpoint slot goes back either way."""
        checkpoint = seq.state_checkpoint
        if num_computed_tokens != seq.num_computed_tokens:
            if checkpoint is None or checkpoint[1] > num_computed_tokens or seq.state_slot is None:
                raise ValueError(f"a hybrid model's state can be rolled back only to a checkpoint at or before "
                                 f"{num_computed_tokens} tokens (docs/hybrid-models.md)")
            # the copy is listed before any later checkpoint into the same slot: the runner copies in order
            self._state_copies_before.append((checkpoint[0], seq.state_slot))
            num_computed_tokens = checkpoint[1]
        self._give_back_checkpoint(seq)
        return num_computed_tokens

    def rollback(self, seq: Sequence, num_computed_tokens: int) -> list[int]:
        """Move ``seq``'s computed length back to ``num_computed_tokens`` (rejected drafts); returns the freed blocks.

        After a verify step the slots past the new length hold K/V of
        rejected drafts: they are overwritten by the next tokens written
        there, and blocks past ``ceil(num_computed_tokens / block_size)``
        held nothing else, so they go back to the free list (no hash: they
        were never published, ``cache_full_blocks`` stops at the verified
        token), in every group. The sequence then holds exactly the blocks a
        plain decode would hold. A window group's blocks already given back
        cannot come back: a length whose window reads one is refused.

        A hybrid model's state cannot be taken back token by token: it goes
        back to the sequence's checkpoint (``checkpoint_state``, taken before
        the verify step), which is further back than asked when some drafts
        were accepted; the next step computes the accepted tokens again, as a
        chunk, from the restored state. Keeping every computed token gives the
        checkpoint back unused.
        """
        if not 0 <= num_computed_tokens <= seq.num_computed_tokens:
            raise ValueError(
                f"rollback to {num_computed_tokens} tokens: must be 0..{seq.num_computed_tokens} (the computed ones)"
            )
        tables = self._tables(seq)
        for g, table in enumerate(tables):
            if _num_holes(table) > self._first_needed(g, num_computed_tokens):
                raise ValueError(f"rollback to {num_computed_tokens} tokens: group {g}'s window blocks before "
                                 f"block {_num_holes(table)} were given back")
        if self.state_slots is not None:
            num_computed_tokens = self._restore_checkpoint(seq, num_computed_tokens)
        keep = -(-num_computed_tokens // self.block_size)
        freed: list[int] = []
        for table in tables:
            freed.extend(table[keep:])
            del table[keep:]
        for block in reversed(freed):
            self._release(block)
        seq.num_computed_tokens = num_computed_tokens
        # hashes of blocks no longer full of the sequence's own tokens would be stale
        del seq.block_hashes[len(seq) // self.block_size :]
        return freed

    def fork(self, parent: Sequence, child: Sequence, state_after_step: bool = False) -> None:
        """Let ``child`` share every block of ``parent`` in every group (ref counts go up).

        With state slots the child gets its own (the one ``allocate`` reserved for a waiting sample, else a
        free one) and a copy of the parent's: made before the next step runs, or after it with
        ``state_after_step`` (the parent's prompt completes in the step being planned).
        """
        if child.block_table or child.group_tables:
            raise ValueError(f"sequence {child.seq_id} already holds blocks")
        if self.state_slots is not None:
            if parent.state_slot is None:
                raise ValueError(f"sequence {parent.seq_id} holds no state slot to fork from")
            if child.state_slot is None:
                if not self.state_slots.num_free:
                    # max_num_seqs bounds the running sequences and the pool holds that many (model_runner)
                    raise RuntimeError("no state slot is free for a fork: the pool holds fewer than max_num_seqs")
                child.state_slot = self.state_slots.take()
            pending = self._state_copies_after if state_after_step else self._state_copies_before
            pending.append((parent.state_slot, child.state_slot))
        tables = [list(table) for table in self._tables(parent)]
        self._set_tables(child, tables)
        for table in tables:
            for block in table:
                if block != HOLE:
                    self.ref_counts[block] += 1

    def take_state_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The forks' (source, destination) state slot copies decided since the last call: (those the runner
        makes before the step runs, those it makes after)."""
        copies = (self._state_copies_before, self._state_copies_after)
        self._state_copies_before, self._state_copies_after = [], []
        return copies

    def _give_back_state_slot(self, seq: Sequence) -> None:
        """Return ``seq``'s slot to the pool; a copy into it not yet made is moot (its holder is gone)."""
        slot = seq.state_slot
        if slot is None or self.state_slots is None:
            return
        self.state_slots.give_back(slot)
        seq.state_slot = None
        self._state_copies_before = [c for c in self._state_copies_before if c[1] != slot]
        self._state_copies_after = [c for c in self._state_copies_after if c[1] != slot]
        self._pending_state_loads = [c for c in self._pending_state_loads if c[0] != slot]

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies decided since the last call."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Publish the full blocks among the first ``num_tokens`` tokens.

        Called when those tokens are scheduled: their K/V is written in this
        step, before any later reader runs attention over them.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(num_tokens, len(seq)) // self.block_size
        hashes = self._block_hashes(seq, num_full)
        for g, table in enumerate(self._tables(seq)):
            for i in range(num_full - 1, -1, -1):
                block = table[i]
                if block == HOLE or self.block_hash[block] is not None:
                    break  # blocks before it were published earlier (or given back)
                h = self._key(hashes[i], g)
                if h in self.hash_to_block:
                    continue  # same content already cached in another block
                self.block_hash[block] = h
                self.block_token_ids[block] = tuple(seq.block_tokens(i))
                self.hash_to_block[h] = block
                self._unconfirmed.append(block)

    def confirm_published(self) -> None:
        """The step planned with the blocks published since the last call has run: they hold their K/V."""
        if self.snapshots is not None:
            for h, slot in self.snapshots.confirm():
                block = self.hash_to_block.get(h)
                if self.state_disk is not None and block is not None and not self.state_disk.contains(h):
                    self._pending_state_saves.append((slot, h, self.block_token_ids[block]))
        if self.disk is not None:
            for block in self._unconfirmed:
                h = self.block_hash[block]
                if block not in self._loaded and h is not None:
                    self._pending_saves.append((block, h, self.block_token_ids[block]))
            self._loaded.clear()
        self._unconfirmed.clear()

    def unpublish_unconfirmed(self) -> None:
        """Take the blocks published since the last ``confirm_published`` out of the prefix cache.

        For a step that failed: it never wrote them, so no later prompt may
        hit them. Blocks stay allocated; what earlier steps cached stays cached.
        """
        for block in self._unconfirmed:
            self._uncache(block)
        self._unconfirmed.clear()
        if self.snapshots is not None:
            self.snapshots.drop_unconfirmed()
        self._loaded.clear()
        self._pending_loads.clear()
        self._pending_state_loads.clear()

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references in every group; blocks at ref count 0 become free. Its state slot goes
        back, and those reserved for its samples still waiting to fork."""
        for table in self._tables(seq):
            for block in reversed(table):
                if block != HOLE:
                    self._release(block)
        seq.block_table = []
        seq.group_tables = []
        seq.num_computed_tokens = 0
        self._give_back_checkpoint(seq)
        for s in (seq, *seq.fork_children):
            self._give_back_state_slot(s)

    def take_releasable(self) -> list[tuple[int, int]]:
        """Ranges ``[start, stop)`` of blocks written since last asked that are now free and hold nothing.

        Their K/V will never be read again, so the runner may give their pages
        back to the OS (``runner/kv_cache.py``); they leave the touched set.
        Cached free blocks are kept: a later prompt may still hit them.
        """
        free = sorted(b for b in self._touched if self.ref_counts[b] == 0 and self.block_hash[b] is None)
        self._touched.difference_update(free)
        ranges: list[tuple[int, int]] = []
        for block in free:
            if ranges and ranges[-1][1] == block:
                ranges[-1] = (ranges[-1][0], block + 1)
            else:
                ranges.append((block, block + 1))
        return ranges

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use stay allocated)."""
        for block in range(self.num_blocks):
            self._uncache(block)
        if self.snapshots is not None:
            self.snapshots.clear()
