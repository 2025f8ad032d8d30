"""Continuous batching: which sequences run in the next step, and how far.

Each step the scheduler
  1. gives every running sequence a slot for its next token (decode). When the
     pool has no block left it *preempts* the newest running sequence: frees
     its blocks and puts it back at the front of the waiting queue, to be
     recomputed later from its tokens (prompt + what it generated so far);
  2. admits waiting sequences first come first served (prefill), as long as
     the token budget, ``max_num_seqs`` and the pool allow. ``allocate()``
     returning False stops admission: the request waits, nothing crashes.

Prefills and decodes share one step. The result is one ``SchedulerOutput``
record that the model runner turns into tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step.

    The runner computes tokens ``[num_computed_tokens, num_computed_tokens +
    num_new_tokens)`` of ``seq.token_ids``; K/V of earlier tokens is already
    in the blocks of ``seq.block_table``.
    """

    seq: Sequence
    num_computed_tokens: int
    num_new_tokens: int

    @property
    def is_prefill(self) -> bool:
        return self.num_new_tokens > 1 or self.num_computed_tokens < self.seq.num_prompt_tokens - 1

    @property
    def samples(self) -> bool:
        """True when this step reaches the sequence's last token, so it samples."""
        return self.num_computed_tokens + self.num_new_tokens == len(self.seq)


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything the model runner needs for one step.

    ``scheduled`` lists prefills first, then decodes. ``preempted`` are the
    sequences that lost their blocks while this step was planned.
    """

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """FCFS continuous-batching scheduler with recompute preemption.

    Args:
        block_manager: the pool to allocate from.
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: most tokens computed in one step.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # --- queue management ----------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (status WAITING, no blocks)."""
        if seq.block_table:
            raise ValueError("a new sequence must not hold blocks")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a sequence (stopped, length or aborted) and free its blocks at once."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = status

    # --- the step ------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        """Plan one step: decodes of running sequences, then admissions."""
        budget = self.max_num_batched_tokens
        decodes: list[ScheduledSequence] = []
        preempted: list[Sequence] = []

        # 1. running sequences, oldest first, each needs one slot. Ties in
        #    ``arrival`` are broken by seq_id, so the victim (the newest) is
        #    never a sequence already scheduled earlier in this loop.
        def age(s: Sequence) -> tuple[int, int]:
            return (s.arrival, s.seq_id)

        for seq in sorted(self.running, key=age):
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget < 1:
                break
            while not self.block_manager.append_slot(seq):
                victim = max(self.running, key=age)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            num_new = len(seq) - seq.num_computed_tokens
            decodes.append(ScheduledSequence(seq, seq.num_computed_tokens, num_new))
            self.block_manager.cache_full_blocks(seq, len(seq))
            budget -= num_new

        # 2. admissions, first come first served; none after a preemption,
        #    since the pool just proved too small for what is running
        prefills: list[ScheduledSequence] = []
        num_seqs = len(decodes)
        while self.waiting and not preempted and num_seqs < self.max_num_seqs:
            seq = self.waiting[0]
            # check the budget before allocating: allocating and freeing again
            # would pop (evict) cached blocks from the free list for nothing
            if len(seq) - self.block_manager.num_cached_prefix_tokens(seq) > budget:
                break
            if not self.block_manager.allocate(seq):
                break
            num_new = len(seq) - seq.num_computed_tokens
            self.waiting.popleft()
            self.block_manager.record_prefix_lookup(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            prefills.append(ScheduledSequence(seq, seq.num_computed_tokens, num_new))
            # published at once, so an identical prompt admitted next in this
            # same step already hits these blocks
            self.block_manager.cache_full_blocks(seq, len(seq))
            budget -= num_new
            num_seqs += 1

        return SchedulerOutput(scheduled=prefills + decodes, preempted=preempted)

    def update(self, output: SchedulerOutput) -> None:
        """Record that the step ran: the scheduled tokens are now in the cache."""
        for s in output.scheduled:
            s.seq.num_computed_tokens = s.num_computed_tokens + s.num_new_tokens
