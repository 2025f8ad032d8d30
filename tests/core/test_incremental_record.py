"""The incremental step record: sequences sent whole once, then only what changed.

The engine's ``StepRecordBuilder`` and the runner's ``SequenceStates`` are
driven here by the real scheduler and block manager, without a model: the
"sampled" tokens come from a seeded stream. Every step, the runner's full
view (``SequenceStep``) is checked against one built directly from the live
sequences, as the record was built when it was sent whole.
"""

from __future__ import annotations

import pickle
import random

from pagedllm import SamplingParams
from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.sequence import Sequence, SequenceStatus
from pagedllm.engine.step_builder import StepRecordBuilder, build_step_record, sampling_spec
from pagedllm.runner.sequence_states import SequenceStates
from pagedllm.step_record import LogitsRules, SequenceStep, StepRecord

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
# the repetition penalty needs the prompt, the frequency penalty each output
RULES = LogitsRules(repetition_penalty=1.3, frequency_penalty=0.5)


class _Loop:
    """A scheduler, the engine's record builder and the runner's states, stepped without a model."""

    def __init__(self, num_blocks: int, max_num_seqs: int = 8, caching: bool = False, seed: int = 0) -> None:
        self.bm = BlockManager(num_blocks=num_blocks, block_size=BS, enable_prefix_caching=caching)
        self.sched = Scheduler(self.bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=32)
        self.builder = StepRecordBuilder()
        self.states = SequenceStates()
        self.rng = random.Random(seed)
        self.records: list[StepRecord] = []

    def add(self, prompt: list[int], rid: str) -> Sequence:
        seq = Sequence(prompt, block_size=BS, request_id=rid)
        self.sched.add(seq)
        return seq

    def step(self, max_output: int = 6) -> SchedulerOutput:
        out = self.sched.schedule()
        num = len(out.scheduled)
        record = self.builder.build(out, [GREEDY] * num, [None] * num, [RULES] * num)
        self.records.append(pickle.loads(pickle.dumps(record)))  # as it crosses to a tensor-parallel rank
        views = self.states.apply(self.records[-1])
        assert views == [_expected(s, RULES) for s in out.scheduled]
        self.sched.update(out)
        for s in out.scheduled:
            if s.samples:
                for seq in (s.seq, *s.forks):
                    seq.append_token(self.rng.randrange(100))
                    if seq.num_output_tokens >= max_output:
                        self.sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
        return out


def _expected(s, rules: LogitsRules | None) -> SequenceStep:  # noqa: ANN001 - a ScheduledSequence
    """The full view as the engine built it when the record was sent whole."""
    c, seq = s.num_computed_tokens, s.seq
    rows = (s.seq, *s.forks) if s.samples else ()
    prompt = tuple(seq.prompt_token_ids) if rows and rules is not None and rules.needs_prompt else ()
    needs_output = rows and rules is not None and rules.needs_output
    return SequenceStep(
        request_id=seq.request_id,
        num_computed_tokens=c,
        token_ids=tuple(seq.token_ids[c : c + s.num_new_tokens]),
        block_table=tuple(seq.block_table),
        sampling=sampling_spec(GREEDY, None, rules),
        uniforms=tuple(0.0 for _ in rows),
        prompt_token_ids=prompt,
        output_token_ids=tuple(tuple(r.output_token_ids) for r in rows) if needs_output else (),
        num_prompt_tokens=seq.num_prompt_tokens,
    )


def test_a_second_decode_step_carries_no_block_table_and_no_prompt() -> None:
    loop = _Loop(num_blocks=16)
    seq = loop.add(list(range(1, 10)), "a")  # 9 tokens: the first outputs stay in block 2
    loop.step()  # the prompt, sent whole
    first = loop.records[0]
    assert [n.seq_id for n in first.new_sequences] == [seq.seq_id]
    assert first.new_sequences[0].token_ids == tuple(range(1, 10))
    loop.step()  # decode 1
    loop.step()  # decode 2
    second_decode = loop.records[2]
    (step,) = second_decode.sequences
    assert second_decode.new_sequences == () and second_decode.finished_seq_ids == ()
    assert step.block_table is None and step.new_block_ids == ()
    # the token sampled the step before, nothing else (the step has since sampled one more)
    assert step.new_token_ids == (seq.token_ids[-2],)
    # the runner still has what the penalties read
    assert loop.states.states[seq.seq_id].token_ids == seq.token_ids[:-1]


def test_a_new_block_is_sent_alone() -> None:
    loop = _Loop(num_blocks=16)
    seq = loop.add(list(range(1, 9)), "a")  # 8 tokens: two full blocks, the first output needs a third
    loop.step()
    loop.step()
    (step,) = loop.records[1].sequences
    assert step.block_table is None and step.new_block_ids == (seq.block_table[2],)


def test_a_preempted_sequence_is_sent_again_in_full() -> None:
    loop = _Loop(num_blocks=6, max_num_seqs=4)
    seqs = [loop.add(list(range(10 * i + 1, 10 * i + 8)), str(i)) for i in range(3)]
    for _ in range(40):
        if not loop.sched.has_unfinished():
            break
        loop.step(max_output=8)
    preempted = [s for s in seqs if s.num_preemptions]
    assert preempted, "the pool is small enough to preempt"
    victim = preempted[0]
    dropped = [i for i, r in enumerate(loop.records) if victim.seq_id in r.finished_seq_ids]
    resent = [
        (i, n) for i, r in enumerate(loop.records) for n in r.new_sequences if n.seq_id == victim.seq_id
    ]
    assert dropped and len(resent) == 2  # at its admission, and again after the preemption
    i, new = resent[1]
    assert i >= dropped[0]
    # the prompt and the outputs it had, and its new block table
    assert len(new.token_ids) > new.num_prompt_tokens == 7
    assert new.block_table


def test_views_equal_full_records_with_prefix_hits_preemption_and_copy_on_write() -> None:
    loop = _Loop(num_blocks=14, max_num_seqs=6, caching=True, seed=3)
    shared = list(range(1, 10))
    for i in range(8):
        loop.add(shared + [50 + i] * (i % 3), str(i))
    forked = 0
    for _ in range(80):
        if not loop.sched.has_unfinished():
            break
        loop.step(max_output=7)
        # a beam-search fork: the child shares every block, so the next append copies on write
        running = [s for s in loop.sched.running if s.num_computed_tokens == len(s) - 1 and s.index == 0]
        if running and forked < 3 and loop.bm.num_free_blocks > 4:
            parent = running[0]
            child = parent.fork(index=1)
            loop.sched.fork_running(parent, child)
            forked += 1
    assert forked and loop.sched.num_preemptions
    assert any(s.block_table is not None for r in loop.records for s in r.sequences)  # copy-on-write seen
    # a prefix-cache hit: a sequence first sent with tokens already computed
    first_seen = {n.seq_id: r for r in reversed(loop.records) for n in r.new_sequences}
    assert any(s.num_computed_tokens > 0 for rid, r in first_seen.items() for s in r.sequences if s.seq_id == rid)


def test_finished_sequences_leave_the_runner_no_leak_over_1000_requests() -> None:
    loop = _Loop(num_blocks=64, max_num_seqs=8)
    rng = random.Random(1)
    added = 0
    while added < 1000 or loop.sched.has_unfinished():
        while added < 1000 and loop.sched.num_waiting < 4:
            loop.add([rng.randrange(1, 100) for _ in range(rng.randrange(1, 9))], str(added))
            added += 1
        loop.step(max_output=rng.randrange(1, 4))
        held = set(loop.states.states)
        assert len(held) <= 8 and loop.builder.num_held == len(held)
    loop.states.apply(loop.builder.build(SchedulerOutput(), [], []))  # the next step tells the last ones
    assert len(loop.states) == 0 and loop.builder.num_held == 0


def test_decode_records_stay_small_while_the_context_grows() -> None:
    loop = _Loop(num_blocks=64)
    loop.add(list(range(1, 60)), "long")
    for _ in range(6):
        loop.step(max_output=100)
    sizes = [len(pickle.dumps(r)) for r in loop.records]
    assert sizes[-1] < sizes[0] / 2  # the 59-token prompt went once


def test_build_step_record_sends_everything_whole() -> None:
    loop = _Loop(num_blocks=16)
    seq = loop.add([1, 2, 3, 4, 5], "a")
    loop.step()
    loop.step()
    out = loop.sched.schedule()
    record = build_step_record(out, [GREEDY], [None])
    (new,) = record.new_sequences
    assert new.token_ids == tuple(seq.token_ids) and new.block_table == tuple(seq.block_table)
    assert SequenceStates().apply(record) == [_expected(out.scheduled[0], None)]


def test_a_record_that_never_reached_the_runner_still_has_its_finished_sent() -> None:
    loop = _Loop(num_blocks=16)
    seq = loop.add([1, 2, 3], "a")
    loop.step()
    loop.sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
    other = loop.add([4, 5, 6], "b")
    out = loop.sched.schedule()
    lost = loop.builder.build(out, [GREEDY], [None])  # the step failed: the runner never saw it
    assert lost.finished_seq_ids == (seq.seq_id,)
    loop.builder.not_delivered(lost)
    loop.sched.finish(other, SequenceStatus.FINISHED_ABORTED)  # the engine aborts what the step scheduled
    loop.states.apply(loop.builder.build(SchedulerOutput(), [], []))
    assert len(loop.states) == 0 and loop.builder.num_held == 0
