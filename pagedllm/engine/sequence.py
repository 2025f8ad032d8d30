"""One generated sequence: its tokens, its block table and its progress.

Plain Python on purpose: the block manager and the scheduler work on these
objects with integer lists only, so they are testable without torch.

Token accounting (``num_computed_tokens`` is how many tokens have their K/V
in the cache)::

    token_ids:  p0 p1 p2 p3 p4 | o0 o1 o2
                <-- prompt ---> <- output ->
    computed:   [=========================]   <- K/V written for these
                                           ^ the newest sampled token, whose
                                             K/V the next decode step writes
"""

from __future__ import annotations

import enum
import itertools
import random

_seq_counter = itertools.count()


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # its sampling settings left no token to sample (allowed_token_ids, bad_words, min_tokens, a grammar)
    FINISHED_NO_VALID_TOKEN = "no_valid_token"

    @property
    def is_finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)


class Sequence:
    """A token sequence with a block table.

    Args:
        token_ids: the prompt's token ids.
        block_size: tokens per KV block (needed to count blocks).
        request_id: the request this sequence belongs to (default: its own).
        index: which of the request's ``n`` outputs this is.
        rng: the random stream its sampler draws from; it lives here, not in
            the runner, so that a preempted and recomputed sequence keeps
            drawing the same numbers.
        arrival: ordering key for FCFS and for choosing a preemption victim.
    """

    def __init__(
        self,
        token_ids: list[int],
        block_size: int,
        request_id: str | None = None,
        index: int = 0,
        rng: random.Random | None = None,
        arrival: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.seq_id: int = next(_seq_counter)
        # samples of one request share the id (preemption takes them together)
        self.request_id = request_id if request_id is not None else f"seq-{self.seq_id}"
        self.index = index
        self.token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens: int = len(token_ids)
        self.block_size = block_size
        # logical block i -> physical block id (KV cache group 0's)
        self.block_table: list[int] = []
        # the other KV cache groups' tables, as long as block_table (kv_groups.py); empty with one group
        self.group_tables: list[list[int]] = []
        # a hybrid model's state slot (engine/state_slots.py), held while the sequence runs; None otherwise
        self.state_slot: int | None = None
        # a hybrid model's: the token counts whose state the block manager snapshots (a chunk ends there)
        self.state_snapshot_points: list[int] = []
        # a hybrid model's verify step (speculative decoding): (checkpoint slot, tokens computed) holding the
        # state before the drafts, until the step's rejected drafts are rolled back; None otherwise
        self.state_checkpoint: tuple[int, int] | None = None
        # chained hashes of the full blocks, filled lazily by the block manager
        self.block_hashes: list[int] = []
        self.num_computed_tokens: int = 0
        # prompt tokens found in the prefix cache at the last admission
        self.num_cached_tokens: int = 0
        self.status = SequenceStatus.WAITING
        self.rng = rng if rng is not None else random.Random(0)
        self.arrival: int = self.seq_id if arrival is None else arrival
        self.num_preemptions: int = 0
        # longest this sequence may grow (prompt + max_tokens, or the context):
        # what a contiguous allocator reserves up front
        self.reserve_len: int = len(token_ids)
        # samples that share this sequence's prefill (n > 1, best_of): forked
        # from it, blocks and all, when the scheduler admits it
        self.fork_children: list[Sequence] = []
        # sequences this one's request may run at once, counted against
        # max_num_seqs from admission on: a beam search forks up to its beam
        # width while it runs, so it holds that many places from the start
        self.num_reserved_seqs: int = 1
        # a request that wants prompt logprobs needs every prompt position
        # computed, so it takes no prefix-cache hits
        self.allow_prefix_hits: bool = True
        # a request that wants prompt logprobs scores every prompt token: its
        # prompt is computed in chunks of at most MAX_SCORED_PROMPT_TOKENS a step
        # (engine/step_budget.py), so that its logits stay small and a request
        # arriving meanwhile waits one such chunk, not the whole prompt
        self.scores_prompt: bool = False
        self.cumulative_logprob: float = 0.0
        # per output token: {token_id: (logprob, rank)}, when logprobs are asked for
        self.logprobs: list[dict[int, tuple[float, int]]] | None = None
        # detokenizer state
        self.output_text: str = ""
        self.prefix_offset: int = 0
        self.read_offset: int = 0
        # the detokenizer's stream (engine/detokenizer.py), opaque here; never copied by fork
        self.detok_state: object | None = None
        self.stop_reason: int | str | None = None
        # speculative decoding: the last ``num_draft_tokens`` of ``token_ids`` are drafts that the
        # planned step verifies, not yet part of the output (docs/speculative-decoding.md)
        self.num_draft_tokens: int = 0

    # --- lengths -----------------------------------------------------------
    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_blocks(self) -> int:
        """Blocks needed to hold K/V for every token (ceil division)."""
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    @property
    def num_full_blocks(self) -> int:
        return len(self.token_ids) // self.block_size

    def block_tokens(self, i: int) -> list[int]:
        """Token ids of logical block ``i``."""
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def add_draft_tokens(self, draft_ids: list[int]) -> None:
        """Append drafts after the last token, for the next step to verify (none may be pending)."""
        if self.num_draft_tokens:
            raise ValueError(f"sequence {self.seq_id} already holds {self.num_draft_tokens} draft tokens")
        self.token_ids.extend(draft_ids)
        self.num_draft_tokens = len(draft_ids)

    def discard_draft_tokens(self) -> list[int]:
        """Remove the pending drafts from ``token_ids``; returns them."""
        k = self.num_draft_tokens
        if not k:
            return []
        drafts = self.token_ids[-k:]
        del self.token_ids[-k:]
        self.num_draft_tokens = 0
        return drafts

    def fork(self, index: int, rng: random.Random | None = None) -> Sequence:
        """A new sequence with this one's tokens, progress and text, but no blocks.

        The block manager's ``fork`` then shares this sequence's blocks with it.
        """
        child = Sequence(self.prompt_token_ids, self.block_size, self.request_id, index,
                         rng if rng is not None else self.rng, self.arrival)
        child.token_ids = list(self.token_ids)
        child.block_hashes = list(self.block_hashes)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.allow_prefix_hits = self.allow_prefix_hits
        child.scores_prompt = self.scores_prompt
        child.reserve_len = self.reserve_len
        child.num_reserved_seqs = self.num_reserved_seqs
        child.cumulative_logprob = self.cumulative_logprob
        child.logprobs = None if self.logprobs is None else list(self.logprobs)
        child.output_text = self.output_text
        child.prefix_offset, child.read_offset = self.prefix_offset, self.read_offset
        return child

    def reset_for_recompute(self) -> None:
        """Forget the cache state after preemption; tokens are kept (pending drafts are not: never accepted)."""
        self.discard_draft_tokens()
        self.block_table = []
        self.group_tables = []
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, len={len(self)}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table}, "
            f"{f'group_blocks={self.group_tables}, ' if self.group_tables else ''}"
            f"status={self.status.value})"
        )
