"""Turns the scheduler's plan (live ``Sequence`` objects) into the runner's plain ``StepRecord``.

The record is incremental (``step_record.py``): ``StepRecordBuilder``
remembers what it has sent of each sequence and sends a sequence whole only
the first time (and again after a preemption), then what each step adds.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.engine.block_manager import HOLE
from pagedllm.engine.scheduler import ScheduledSequence, SchedulerOutput
from pagedllm.engine.sequence import Sequence
from pagedllm.sampling_params import SamplingParams
from pagedllm.step_record import LogitsRules, NewSequence, SamplingSpec, ScheduledStep, StepRecord

# below this, dividing logits by the temperature overflows: greedy
MIN_TEMPERATURE = 1e-5


def sampling_spec(
    params: SamplingParams, num_top_logprobs: int | None, rules: LogitsRules | None = None
) -> SamplingSpec:
    """The sampling settings of ``params`` as the sampler applies them."""
    temperature = params.temperature if params.temperature >= MIN_TEMPERATURE else 0.0
    return SamplingSpec(temperature, params.top_k, params.top_p, params.min_p, num_top_logprobs, rules)


def _prompt_scoring(s: ScheduledSequence, params: SamplingParams) -> tuple[int | None, tuple[int, ...]]:
    """Whether this step scores prompt tokens, and which.

    The step computes positions ``c .. c+k-1`` (a whole prompt, or one chunk
    of it); their logits score prompt tokens ``c+1 .. c+k``, those that
    exist. Every chunk that scores some does; a one-token prompt gets its
    empty list on its first chunk.
    """
    first = s.num_computed_tokens
    prompt_len = s.seq.num_prompt_tokens
    if params.prompt_logprobs is None or not (first == 0 or first < prompt_len - 1):
        return None, ()
    last = min(first + s.num_new_tokens, prompt_len - 1)  # exclusive
    return params.prompt_logprobs, tuple(s.seq.token_ids[first + 1 : last + 1])


def runner_table(seq: Sequence, first: int, held: list[int] | None) -> list[int]:
    """The table the runner holds of ``seq`` from logical block ``first`` on: its one table, or with KV cache
    groups their interleaved tables (logical block ``i`` of group ``g`` at ``i * num_groups + g``).

    A window group's hole (a block given back, ``block_manager.HOLE``) is never read for a result (the
    attention masks it): the runner keeps the block it holds there (``held``), or reads block 0.
    """
    if not seq.group_tables and not (seq.block_table and seq.block_table[0] == HOLE):
        return seq.block_table[first:]  # one table and no hole (holes are a prefix)
    tables = [seq.block_table, *seq.group_tables]
    num_groups = len(tables)
    flat = [t[i] for i in range(first, len(seq.block_table)) for t in tables]
    for j, block in enumerate(flat):
        if block == HOLE:
            k = first * num_groups + j
            flat[j] = held[k] if held is not None and k < len(held) else 0
    return flat


@dataclass(slots=True)
class _Sent:
    """What the runner holds of one sequence: as many tokens, this block table (a copy)."""

    seq: Sequence
    num_preemptions: int
    num_tokens: int
    block_table: list[int]


class StepRecordBuilder:
    """Builds each step's incremental ``StepRecord``, remembering what the runner holds.

    One per runner: every record it builds must reach the runner, in order
    (a step that fails aborts its requests, and their ids are sent as
    finished next step, so the two never disagree on a sequence still running).
    """

    def __init__(self) -> None:
        self._sent: dict[int, _Sent] = {}
        # finished ids of a record that never reached the runner, sent again with the next one
        self._unsent_finished: list[int] = []

    @property
    def num_held(self) -> int:
        """Sequences the runner holds state for."""
        return len(self._sent)

    def build(
        self,
        output: SchedulerOutput,
        params: list[SamplingParams],
        num_top: list[int | None],
        rules: list[LogitsRules | None] | None = None,
        bitmasks: list[tuple[bytes, ...]] | None = None,
    ) -> StepRecord:
        """The record of one step: ``params[i]``, ``num_top[i]``, ``rules[i]``, ``bitmasks[i]`` are ``output.scheduled[i]``'s.

        The uniforms each sampling row needs are drawn here, once, from its
        sequence's own stream; greedy rows draw nothing, so a seeded stream is
        never disturbed by them. ``rules`` (None: no request has any) are the
        requests' logits processors (``inputs.logits_rules``); ``bitmasks`` (None: no
        request has a constraint) the structured-output masks of each sampled
        row, as the engine's grammar state filled them (empty for a sequence
        without a constraint or that does not sample).
        """
        num = len(output.scheduled)
        rules = [None] * num if rules is None else rules
        bitmasks = [()] * num if bitmasks is None else bitmasks
        if len(params) != num or len(num_top) != num or len(rules) != num or len(bitmasks) != num:
            raise ValueError("a step needs one SamplingParams, num_top, rules and bitmasks per scheduled sequence")
        finished = self._forget_gone()
        new: list[NewSequence] = []
        try:
            steps = tuple(self._step(*row, new) for row in zip(output.scheduled, params, num_top, rules, bitmasks))
        except BaseException:
            self._unsent_finished.extend(finished)  # the runner must still hear of them
            raise
        return StepRecord(steps, tuple(output.blocks_to_copy), tuple(new), finished,
                          blocks_to_load=tuple(output.blocks_to_load),
                          state_copies_before=tuple(output.state_copies_before),
                          state_copies_after=tuple(output.state_copies_after),
                          states_to_load=tuple(output.states_to_load))

    def _step(
        self, s: ScheduledSequence, p: SamplingParams, top: int | None, rule: LogitsRules | None,
        masks: tuple[bytes, ...], new: list[NewSequence],
    ) -> ScheduledStep:
        """``s``'s entry of the record; a sequence the runner does not hold is appended to ``new`` whole."""
        uniforms: tuple[float, ...] = ()
        pooling = getattr(p, "pooling_type", None)  # a pooling request samples nothing (pooling/params.py)
        if s.samples and pooling is None:
            # sampling_spec's greedy rule: the spec itself is built only for a sequence sent whole
            random_rows = p.temperature >= MIN_TEMPERATURE
            uniforms = tuple(seq.rng.random() if random_rows else 0.0 for seq in (s.seq, *s.forks))
            if s.num_draft_tokens:
                # a verify step: one draw per draft (accept or not) and one for the token after them,
                # drawn whatever is accepted, so a seeded stream does not depend on the batch
                uniforms += tuple(s.seq.rng.random() if random_rows else 0.0 for _ in range(s.num_draft_tokens))
        if masks and len(masks) != len(uniforms):
            raise ValueError("a constrained sequence needs one bitmask per sampled row")
        scored, targets = _prompt_scoring(s, p)
        kept: int | None = None
        if s.seq.seq_id not in self._sent:
            new.append(self._send_whole(s, sampling_spec(p, top, rule)))
            token_ids: tuple[int, ...] = ()
            block_ids: tuple[int, ...] = ()
            table: tuple[int, ...] | None = None
        else:
            kept = self._rolled_back(s)
            token_ids, block_ids, table = self._changes(s)
        # positional (the field order of ScheduledStep): the fastest way to build one
        return ScheduledStep(
            s.seq.seq_id, s.num_computed_tokens, s.num_new_tokens, token_ids, block_ids, table,
            uniforms, scored, targets, tuple(masks), kept, s.num_draft_tokens, pooling,
            getattr(p, "pooled_logit_ids", ()),
        )

    def _rolled_back(self, s: ScheduledSequence) -> int | None:
        """The runner's token count to cut back to when it holds tokens past the computed ones, else None.

        Only a verify step leaves it so: the runner got its drafts, and those
        rejected are gone from the sequence (``BlockManager.rollback``).
        """
        sent = self._sent[s.seq.seq_id]
        if sent.num_tokens <= s.num_computed_tokens:
            return None
        sent.num_tokens = s.num_computed_tokens
        return s.num_computed_tokens

    def release(self, ranges: list[tuple[int, int]]) -> StepRecord:
        """A record that runs nothing: the runner drops the sequences gone since the last step and gives
        back the pages of the blocks in ``ranges`` (``[start, stop)`` ids that hold nothing)."""
        return StepRecord((), finished_seq_ids=self._forget_gone(), release_blocks=tuple(ranges))

    def not_delivered(self, record: StepRecord) -> None:
        """``record`` may not have reached the runner (its step failed): its finished ids go with the next one.

        Its other contents need nothing: the engine aborts every request the
        failed step scheduled, so their sequences are sent as finished next.
        """
        self._unsent_finished.extend(record.finished_seq_ids)

    def _forget_gone(self) -> tuple[int, ...]:
        """Drop the sequences that finished or were preempted since the last step; their ids.

        A preempted sequence lost its blocks and is computed again from its
        first token: when it runs again it is sent whole, as a new one.
        """
        gone = [
            seq_id for seq_id, sent in self._sent.items()
            if sent.seq.is_finished or sent.seq.num_preemptions != sent.num_preemptions
        ]
        for seq_id in gone:
            del self._sent[seq_id]
        if self._unsent_finished:
            gone = self._unsent_finished + gone
            self._unsent_finished = []
        return tuple(gone)

    def _send_whole(self, s: ScheduledSequence, spec: SamplingSpec) -> NewSequence:
        """Remember ``s``'s sequence as held by the runner, and the record that sends it whole."""
        seq, end = s.seq, s.num_computed_tokens + s.num_new_tokens
        table = runner_table(seq, 0, None)
        self._sent[seq.seq_id] = _Sent(seq, seq.num_preemptions, end, table)
        return NewSequence(seq.seq_id, seq.request_id, tuple(seq.token_ids[:end]), seq.num_prompt_tokens,
                           tuple(table), spec, -1 if seq.state_slot is None else seq.state_slot)

    def _changes(self, s: ScheduledSequence) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...] | None]:
        """What ``s`` adds to the runner's state: (new token ids, appended block ids, a whole new table or None)."""
        seq, end = s.seq, s.num_computed_tokens + s.num_new_tokens
        sent = self._sent[seq.seq_id]
        token_ids: tuple[int, ...] = ()
        if end > sent.num_tokens:
            token_ids = tuple(seq.token_ids[sent.num_tokens : end])
            sent.num_tokens = end
        held = sent.block_table
        num_held = len(held)
        if seq.group_tables or (seq.block_table and seq.block_table[0] == HOLE):
            # only blocks from the first one this step writes can have changed (holes aside): compare from there
            num_groups = 1 + len(seq.group_tables)
            first = min(num_held, s.num_computed_tokens // seq.block_size * num_groups)
            tail = runner_table(seq, first // num_groups, held)
            if tail[: num_held - first] == held[first:]:
                added = tuple(tail[num_held - first :])
                held.extend(added)
                return token_ids, added, None
            current = runner_table(seq, 0, held)
        else:
            current = seq.block_table
        if current == held:
            return token_ids, (), None
        if len(current) >= num_held and current[:num_held] == held:
            added = tuple(current[num_held:])
            held.extend(added)
            return token_ids, added, None
        # copy-on-write replaced a block in place: the whole table again (rare: forks, beams)
        sent.block_table = list(current)
        return token_ids, (), tuple(current)


def build_step_record(
    output: SchedulerOutput,
    params: list[SamplingParams],
    num_top: list[int | None],
    rules: list[LogitsRules | None] | None = None,
    bitmasks: list[tuple[bytes, ...]] | None = None,
) -> StepRecord:
    """The record of one step for a runner that holds no sequence yet: every sequence sent whole
    (``StepRecordBuilder.build``'s arguments)."""
    return StepRecordBuilder().build(output, params, num_top, rules, bitmasks)
