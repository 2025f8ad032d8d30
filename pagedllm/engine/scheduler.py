"""Continuous batching: which sequences run in the next step, and how far.

Each step the scheduler
  1. gives every running sequence a slot for its next token (decode). When the
     pool has no block left it *preempts* the newest running sequence: frees
     its blocks and puts it back at the front of the waiting queue, to be
     recomputed later from its tokens (prompt + what it generated so far).
     With speculative decoding (``drafts``) a decode may carry draft tokens:
     they are appended to the sequence and take slots like any token, and the
     decode becomes a verify chunk of ``1 + k`` tokens (docs/speculative-decoding.md;
     the engine rolls the rejected ones back with ``BlockManager.rollback``);
  2. continues prompts that an earlier step prefilled only in part (chunked
     prefill), oldest first, with the token budget the decodes left; a
     chunk takes its blocks now and is cut to what the pool holds, and a
     prompt that cannot get a slot for one token preempts as a decode does;
  3. admits waiting sequences first come first served (prefill), as long as
     the token budget, ``max_num_seqs`` and the pool allow. ``allocate()``
     returning False stops admission: the request waits, nothing crashes.

While decodes run, the prompt tokens of a step (chunks and admissions) are
also capped by ``prefill_cap``, so that a long prompt cannot stall the
running streams for seconds (``step_budget.py``: the cap follows a latency
target from measured step costs).

A prompt whose tokens are scored (prompt logprobs) is computed at most
``MAX_SCORED_PROMPT_TOKENS`` a step whatever the budget: its logits are one
full-vocabulary row per token, and a request arriving meanwhile is admitted
after one such chunk rather than after the whole prompt.

Prefills and decodes share one step. A prompt longer than the budget left
is computed in chunks over several steps (``max_num_batched_tokens`` may be
smaller than ``max_model_len``); it takes blocks chunk by chunk, as vLLM
does, and samples only in the step that computes its last token::

    budget 8 tokens, prompt A of 12 tokens, B decoding
    step 1:  B x1 | A[0:7]     (A: 7 of 12 computed, no sample)
    step 2:  B x1 | A[7:12]    (A samples its first token)

The result is one ``SchedulerOutput`` record that the model runner turns
into tensors.

Several samples of one prompt (``n``, ``best_of``) are admitted as one
sequence whose ``fork_children`` are forked from it in the step that
completes its prompt: they share its blocks and its prefill, and sample
their first tokens from its logits. Preemption takes a whole request (all
its samples) at a time.

``max_num_seqs`` counts, per request, the larger of the sequences it runs
(its waiting forks included) and the places it reserved
(``Sequence.num_reserved_seqs``: a beam search's width, since its beams fork
while it runs)::

    max_num_seqs 4: beam request (width 4) running 1 beam -> holds 4,
                    so nothing else is admitted until it finishes
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.sequence import Sequence, SequenceStatus
from pagedllm.engine.step_budget import MAX_SCORED_PROMPT_TOKENS


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
    # samples forked from ``seq`` at admission: they ride on its prefill and
    # sample their own first token from its last logits
    forks: tuple[Sequence, ...] = ()
    # a verify step (speculative decoding): the last ``num_draft_tokens`` of the new tokens are drafts,
    # and every new token's logits are sampled (docs/speculative-decoding.md)
    num_draft_tokens: int = 0

    @property
    def is_prefill(self) -> bool:
        """True while prompt tokens are being computed (a one-token prompt too)."""
        return self.num_computed_tokens < self.seq.num_prompt_tokens

    @property
    def samples(self) -> bool:
        """True when this step reaches the sequence's last token, so it samples."""
        return self.num_computed_tokens + self.num_new_tokens == len(self.seq)


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything the model runner needs for one step.

    ``scheduled`` lists prefills first, then decodes. ``preempted`` are the
    sequences that lost their blocks while this step was planned.
    ``blocks_to_copy`` are the copy-on-write (source, destination) block
    pairs that must be copied in the cache before the step runs.
    ``blocks_to_load`` are blocks of admitted prompts read back from the
    prefix cache on disk: (block id, K/V bytes) the runner writes into the
    pool first. ``state_copies_before`` / ``state_copies_after``: a hybrid
    model's forks, (source, destination) state slots the runner copies before
    the step runs / after it (``BlockManager.fork``). ``states_to_load``: a
    hybrid model's states of admitted prompts read back from disk, (state
    slot, bytes) the runner writes into the slots first.
    """

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_load: list[tuple[int, bytes]] = field(default_factory=list)
    state_copies_before: list[tuple[int, int]] = field(default_factory=list)
    state_copies_after: list[tuple[int, int]] = field(default_factory=list)
    states_to_load: list[tuple[int, bytes]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class DraftSource(Protocol):
    """What proposes draft tokens for a decode (``spec_decode/speculator.py``)."""

    def propose(self, seq: Sequence, max_num_tokens: int, batch_size: int) -> list[int]:
        """Up to ``max_num_tokens`` drafts after ``seq``'s last token in a step of ``batch_size`` sequences."""
        ...


def _num_decode_tokens(decodes: list[Sequence]) -> int:
    """Tokens the planned decodes compute: one each, plus their drafts."""
    return sum(1 + s.num_draft_tokens for s in decodes)


def _chunk_budget(seq: Sequence, budget: int) -> int:
    """The tokens of ``budget`` that ``seq``'s next chunk may take: at most ``MAX_SCORED_PROMPT_TOKENS``
    while it computes a prompt it scores (prompt logprobs), so that no step holds the logits of a
    whole long prompt and a request arriving meanwhile waits for one chunk, not the whole prompt."""
    if seq.scores_prompt and seq.num_computed_tokens < seq.num_prompt_tokens:
        return min(budget, MAX_SCORED_PROMPT_TOKENS)
    return budget


def _age(seq: Sequence) -> tuple[int, int]:
    """Arrival order; ties (the samples of one request) broken by seq_id."""
    return (seq.arrival, seq.seq_id)


class Scheduler:
    """FCFS continuous-batching scheduler with recompute preemption.

    Args:
        block_manager: the pool to allocate from.
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: most tokens computed in one step.
        prefill_cap: given the number of decodes a step plans, the most
            prompt tokens (chunks and admissions) it may add to them, or None
            for no cap beyond ``max_num_batched_tokens``
            (``StepCostModel.max_prefill_tokens``: running streams keep their
            pace while a long prompt prefills); None: never capped.
        drafts: proposes draft tokens for decodes (speculative decoding); None: none.
    """

    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
        prefill_cap: Callable[[int], int | None] | None = None, drafts: DraftSource | None = None,
    ) -> None:
        # max_num_seqs and max_num_batched_tokens are EngineConfig's, checked there (tests pass small sizes)
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_cap = prefill_cap
        self.drafts = drafts
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # --- queue management ----------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (status WAITING, no blocks)."""
        if seq.block_table or seq.group_tables:
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
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)  # (a not-yet-forked sample is in no queue)
        self.block_manager.free(seq)
        seq.status = status

    def fork_running(self, parent: Sequence, child: Sequence) -> None:
        """Start ``child`` as a running copy of ``parent``, sharing its blocks (beam search)."""
        if parent.status != SequenceStatus.RUNNING:
            raise ValueError("only a running sequence can be forked")
        self.block_manager.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    # --- the step ------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _preempt_request(self, victim: Sequence) -> list[Sequence]:
        """Preempt every running sample of the victim's request, newest first.

        Pushed to the front newest first, so they wait oldest first.
        """
        group = sorted((s for s in self.running if s.request_id == victim.request_id), key=_age, reverse=True)
        for s in group:
            self._preempt(s)
        return group

    def _preempt_until(self, seq: Sequence, fits: Callable[[], bool]) -> list[Sequence]:
        """Preempt the newest request until ``fits()`` or ``seq`` itself was preempted; return the preempted."""
        victims: list[Sequence] = []
        while not fits():
            victims.extend(self._preempt_request(max(self.running, key=_age)))
            if seq.status != SequenceStatus.RUNNING:
                break
        return victims

    def _start_forks(self, seq: Sequence) -> tuple[Sequence, ...]:
        """Start the samples waiting on ``seq``'s prompt as running copies sharing its blocks."""
        forks = tuple(seq.fork_children)
        seq.fork_children = []
        for child in forks:
            # the parent's state after its prompt is the one this step computes: copied after the step
            self.block_manager.fork(seq, child, state_after_step=True)
            child.num_computed_tokens = seq.num_computed_tokens
            child.num_cached_tokens = seq.num_cached_tokens
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        return forks

    def _chunk(self, seq: Sequence, budget: int) -> ScheduledSequence:
        """Schedule as much of ``seq``'s pending tokens as ``budget`` allows (at least one)."""
        num_new = min(len(seq) - seq.num_computed_tokens, budget)
        point = self.block_manager.next_snapshot_point(seq)
        if point is not None and seq.num_computed_tokens + num_new > point:
            num_new = point - seq.num_computed_tokens  # a hybrid model's state is snapshotted there
        completes = seq.num_computed_tokens + num_new == len(seq)
        forks = self._start_forks(seq) if completes else ()
        # published at once, so an identical prompt admitted next in this same
        # step already hits these blocks; only what this step computes
        self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens + num_new)
        self.block_manager.snapshot_state(seq, seq.num_computed_tokens + num_new)
        return ScheduledSequence(seq, seq.num_computed_tokens, num_new, forks)

    def _verify_chunk(self, seq: Sequence) -> ScheduledSequence:
        """A decode with drafts: its last token and the drafts, all sampled.

        Only blocks full of the sequence's own tokens are published: a block
        holding a draft enters the prefix cache only once a later step finds
        it full of accepted tokens (``rollback`` returns the others).
        """
        self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens + 1)
        return ScheduledSequence(seq, seq.num_computed_tokens, 1 + seq.num_draft_tokens, (), seq.num_draft_tokens)

    def _add_drafts(self, seq: Sequence, budget: int, num_decodes_left: int) -> int:
        """Draft tokens for the decode of ``seq`` (slot already given), within ``budget`` tokens; their number.

        Drafts take blocks only while every running sequence not yet planned
        could still get one (a draft never preempts anyone); when the pool
        cannot hold them, the decode stays plain. A hybrid model's verify step
        needs a checkpoint of the state before the drafts (``checkpoint_state``):
        with none free, the decode stays plain too.
        """
        if self.drafts is None or budget < 1 or not self.block_manager.can_checkpoint_state():
            return 0
        draft_ids = self.drafts.propose(seq, budget, len(self.running))
        if not draft_ids:
            return 0
        seq.add_draft_tokens(draft_ids)
        missing = self.block_manager.num_missing_blocks(seq)
        # each decode still to plan may need a block in every KV cache group
        num_reserved = num_decodes_left * self.block_manager.num_groups
        if missing > self.block_manager.num_free_blocks - num_reserved or not self.block_manager.append_slot(seq):
            seq.discard_draft_tokens()
            return 0
        self.block_manager.checkpoint_state(seq)
        return len(draft_ids)

    def schedule(self) -> SchedulerOutput:
        """Plan one step: decodes of running sequences, unfinished prefills, then admissions.

        The token budget left at each stage is ``max_num_batched_tokens`` less
        what the plan holds so far (a preemption takes the victims' part out);
        the prompt tokens of stages 2 and 3 together are also held to
        ``prefill_cap(number of decodes)``, of which the oldest prompt in chunks
        leaves up to half to younger prompts (``_share_of_younger_prompts``).
        """
        preempted: list[Sequence] = []
        decodes = self._plan_decodes(preempted)
        cap = self.prefill_cap(len(decodes)) if self.prefill_cap is not None else None
        prompt_budget = self.max_num_batched_tokens if cap is None else max(1, cap)
        # under a cap, a long prompt in chunks would take every step's share until it is done,
        # and every request arriving meanwhile would wait for it (35 s of TTFT for a 64-token
        # chat behind a 4k prompt, BENCHMARKS.md): the oldest prompt takes at most half while
        # younger prompts want tokens
        reserve = self._share_of_younger_prompts(prompt_budget) if cap is not None else 0
        decodes, continued = self._plan_prompt_chunks(decodes, preempted, prompt_budget, reserve)
        budget = min(
            self.max_num_batched_tokens - _num_decode_tokens(decodes), prompt_budget
        ) - sum(n for _, n in continued)
        # published only now: a block of a sequence dropped above is never
        # written; a prompt's last token (its final one-token chunk) may start its forks
        planned_decodes = [self._verify_chunk(seq) if seq.num_draft_tokens else self._chunk(seq, 1) for seq in decodes]
        prefills = [self._chunk(seq, n) for seq, n in continued]
        # no admission after a preemption: the pool just proved too small for what is running
        if not preempted:
            prefills += self._admit(budget)
        before, after = self.block_manager.take_state_copies()
        return SchedulerOutput(
            scheduled=prefills + planned_decodes,
            preempted=preempted,
            blocks_to_copy=self.block_manager.take_copies(),
            blocks_to_load=self.block_manager.take_loads(),
            state_copies_before=before,
            state_copies_after=after,
            states_to_load=self.block_manager.take_state_loads(),
        )

    def _share_of_younger_prompts(self, prompt_budget: int) -> int:
        """Prompt tokens of a capped step the oldest prompt in chunks leaves to younger ones: what the
        other prompts in chunks and the oldest waiting request still have to compute, at most half."""
        in_chunks = sorted(
            (s for s in self.running
             if s.status == SequenceStatus.RUNNING and not s.num_draft_tokens and len(s) - s.num_computed_tokens > 1),
            key=_age,
        )
        wanted = sum(len(s) - s.num_computed_tokens for s in in_chunks[1:])
        if self.waiting:
            wanted += len(self.waiting[0]) - self.waiting[0].num_computed_tokens
        return min(prompt_budget // 2, wanted) if in_chunks else 0

    def _plan_decodes(self, preempted: list[Sequence]) -> list[Sequence]:
        """Step 1: running sequences with one new token, oldest first, each given its slot; the victim of a
        preemption is the newest request (all its samples), appended to ``preempted``."""
        decodes: list[Sequence] = []
        order = sorted(self.running, key=_age)
        for i, seq in enumerate(order):
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if len(seq) - seq.num_computed_tokens != 1:
                continue  # 0: a beam waiting for its siblings; > 1: a prompt in chunks (step 2)
            if self.max_num_batched_tokens - _num_decode_tokens(decodes) < 1:
                break
            victims = self._preempt_until(seq, lambda seq=seq: self.block_manager.append_slot(seq))
            if victims:
                # a preempted request may have had older samples planned already: they leave the plan
                # (a preempted sequence drops its drafts with its blocks)
                preempted.extend(victims)
                decodes = [d for d in decodes if d.status == SequenceStatus.RUNNING]
            if seq.status == SequenceStatus.RUNNING:
                decodes.append(seq)
                self._add_drafts(seq, self.max_num_batched_tokens - _num_decode_tokens(decodes), len(order) - i - 1)
        return decodes

    def _plan_prompt_chunks(
        self, decodes: list[Sequence], preempted: list[Sequence], prompt_budget: int, reserve: int = 0
    ) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
        """Step 2: prompts prefilled in part by earlier steps, oldest first: the next chunk takes its blocks
        now, cut to the budget (``max_num_batched_tokens`` less the decodes, and at most ``prompt_budget``
        prompt tokens in all; the oldest chunk leaves ``reserve`` of it to younger prompts) and to what the
        pool holds; when not one token fits, the newest request is preempted as for a decode. Returns the
        decodes still planned and the chunks ``(sequence, tokens)``."""
        continued: list[tuple[Sequence, int]] = []

        def left() -> int:
            return min(self.max_num_batched_tokens - _num_decode_tokens(decodes), prompt_budget) - sum(
                n for _, n in continued
            )

        for seq in sorted(self.running, key=_age):
            budget = left()
            if budget < 1:
                break
            if seq.status != SequenceStatus.RUNNING or seq.num_draft_tokens or len(seq) - seq.num_computed_tokens <= 1:
                continue  # a decode with drafts was planned in step 1
            victims = self._preempt_until(seq, lambda seq=seq: self.block_manager.num_appendable_tokens(seq) >= 1)
            if victims:
                # what the victims had planned leaves the plan; its budget comes back
                preempted.extend(victims)
                decodes = [d for d in decodes if d.status == SequenceStatus.RUNNING]
                continued = [(s, n) for s, n in continued if s.status == SequenceStatus.RUNNING]
                budget = left()
            if seq.status != SequenceStatus.RUNNING:
                continue
            if not continued:
                budget = max(1, budget - reserve)  # the oldest: what younger prompts want stays for them
            num_new = min(len(seq) - seq.num_computed_tokens, _chunk_budget(seq, budget),
                          self.block_manager.num_appendable_tokens(seq))
            if not self.block_manager.append_slot(seq, num_new):
                raise RuntimeError("append_slot refused the tokens num_appendable_tokens promised")
            continued.append((seq, num_new))
        return decodes, continued

    def _admit(self, budget: int) -> list[ScheduledSequence]:
        """Step 3: waiting requests, first come first served, while the budget, ``max_num_seqs`` and the pool
        allow; each gets blocks for its cached prefix and its first chunk (later chunks take theirs in step 2).

        Every running sequence counts against ``max_num_seqs``, also those the
        budget left out of this step, beams waiting for their siblings and the
        samples that wait for a prompt in chunks to complete; a request counts
        at least the places it reserved.
        """
        running: dict[str, int] = {}
        reserved: dict[str, int] = {}
        for s in self.running:
            running[s.request_id] = running.get(s.request_id, 0) + 1 + len(s.fork_children)
            reserved[s.request_id] = max(reserved.get(s.request_id, 1), s.num_reserved_seqs)
        num_seqs = sum(max(n, reserved[r]) for r, n in running.items())
        admitted: list[ScheduledSequence] = []
        while self.waiting and budget >= 1:
            seq = self.waiting[0]
            rid = seq.request_id
            held = max(running.get(rid, 0), reserved.get(rid, 0))
            new_running = running.get(rid, 0) + 1 + len(seq.fork_children)
            new_reserved = max(reserved.get(rid, 1), seq.num_reserved_seqs)
            if num_seqs - held + max(new_running, new_reserved) > self.max_num_seqs:
                break
            seq_budget = _chunk_budget(seq, budget)
            if not self.block_manager.allocate(seq, seq_budget):
                break
            self.waiting.popleft()
            self.block_manager.record_prefix_lookup(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            running[rid], reserved[rid] = new_running, new_reserved
            num_seqs += max(new_running, new_reserved) - held
            chunk = self._chunk(seq, seq_budget)
            admitted.append(chunk)
            budget -= chunk.num_new_tokens
        return admitted

    def update(self, output: SchedulerOutput) -> None:
        """Record that the step ran: the scheduled tokens are now in the cache."""
        for s in output.scheduled:
            for seq in (s.seq, *s.forks):
                seq.num_computed_tokens = s.num_computed_tokens + s.num_new_tokens
