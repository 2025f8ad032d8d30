"""Draft tokens through the block manager: slots, the verify step, rollback; exact block ids (no torch).

Expected ids are worked out by hand from the pool's rules (a fresh pool hands
out the lowest empty id first; a freed block without a hash goes back to the
empty heap; ``append_slot`` copies a shared block before the step writes it):

  * drafts get slots like any token: a verify step of ``1 + k`` tokens takes
    the blocks they need past the last one;
  * after the step the sequence keeps exactly the blocks a plain decode would
    hold (``ceil(computed / block_size)``): blocks that held only rejected
    drafts go back to the free list, the rejected slots of a kept block are
    overwritten later;
  * no block holding a draft is published to the prefix cache; a block is
    published once a later step finds it full of accepted tokens;
  * a shared (copy-on-write) block is never written by the verify step: the
    sequence writes into its private copy.

The runner is simulated: ``settle`` does what ``LLMEngine._apply_verify_step`` does.
"""

from __future__ import annotations

from pagedllm.engine.block_manager import BlockManager, hash_block
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence, SequenceStatus
from pagedllm.engine.step_builder import StepRecordBuilder
from pagedllm.runner.sequence_states import SequenceStates
from pagedllm.sampling_params import SamplingParams

BS = 4
DRAFTS = [901, 902, 903, 904]  # ids no prompt uses, so a draft in the cache is easy to see


class FixedDrafts:
    """A draft source that proposes the given drafts for the sequences named, once each."""

    def __init__(self, drafts: dict[int, list[int]]) -> None:
        self.drafts = drafts

    def propose(self, seq: Sequence, max_num_tokens: int, batch_size: int) -> list[int]:
        return self.drafts.pop(seq.seq_id, [])[:max_num_tokens]


def prefilled(bm: BlockManager, prompt: list[int], sampled: int) -> tuple[Scheduler, Sequence]:
    """A scheduler whose one sequence computed ``prompt`` and sampled its first token ``sampled``."""
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, drafts=FixedDrafts({}))
    seq = Sequence(prompt, BS)
    sched.add(seq)
    out = sched.schedule()
    sched.update(out)
    seq.append_token(sampled)
    return sched, seq


def settle(bm: BlockManager, seq: Sequence, num_accepted: int, next_token: int) -> list[int]:
    """The verify step ran: keep ``num_accepted`` drafts, append the sampled token, roll back; the freed blocks."""
    drafts = seq.discard_draft_tokens()
    for t in [*drafts[:num_accepted], next_token]:
        seq.append_token(t)
    return bm.rollback(seq, len(seq) - 1)


def published_tokens(bm: BlockManager) -> list[tuple[int, ...]]:
    return [t for t in bm.block_token_ids if t is not None]


def assert_no_draft_cached(bm: BlockManager, rejected: list[int]) -> None:
    for tokens in published_tokens(bm):
        assert not set(tokens) & set(rejected), f"a rejected draft reached the prefix cache: {tokens}"


def assert_no_leak(bm: BlockManager, sched: Scheduler) -> None:
    for seq in list(sched.running):
        sched.finish(seq, SequenceStatus.FINISHED_STOPPED)
    assert bm.num_free_blocks == bm.num_blocks
    assert all(r == 0 for r in bm.ref_counts)


def verify_step(sched: Scheduler, seq: Sequence, drafts: list[int]):  # noqa: ANN201
    sched.drafts = FixedDrafts({seq.seq_id: list(drafts)})
    out = sched.schedule()
    (s,) = out.scheduled
    sched.update(out)
    return out, s


def test_verify_step_takes_slots_and_publishes_no_draft():
    bm = BlockManager(16, BS)
    sched, seq = prefilled(bm, [1, 2, 3, 4, 5, 6], sampled=7)
    assert seq.block_table == [0, 1] and seq.num_computed_tokens == 6
    out, s = verify_step(sched, seq, DRAFTS)
    # the last token (position 6) and 4 drafts (7..10): positions up to 10 need a third block
    assert (s.num_computed_tokens, s.num_new_tokens, s.num_draft_tokens) == (6, 5, 4)
    assert seq.block_table == [0, 1, 2]
    assert seq.token_ids == [1, 2, 3, 4, 5, 6, 7, *DRAFTS]
    # block 0 is full of prompt tokens (published at the prefill); 1 and 2 hold drafts
    assert bm.block_hash[0] is not None and bm.block_hash[1] is None and bm.block_hash[2] is None
    assert out.blocks_to_copy == []


def test_partial_rejection_frees_the_block_only_drafts_used_and_publishes_accepted():
    bm = BlockManager(16, BS)
    sched, seq = prefilled(bm, [1, 2, 3, 4, 5, 6], sampled=7)
    verify_step(sched, seq, DRAFTS)
    freed = settle(bm, seq, num_accepted=1, next_token=20)  # 901 kept, 902.. rejected, 20 sampled
    assert seq.token_ids == [1, 2, 3, 4, 5, 6, 7, 901, 20]
    assert seq.num_computed_tokens == 8 and seq.block_table == [0, 1]
    assert freed == [2] and bm.free_blocks[0] == 2  # back among the empty blocks, lowest id first
    assert_no_draft_cached(bm, [902, 903, 904])
    # the next step finds block 1 full of accepted tokens: it is published then, with their hash
    out = sched.schedule()
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled] == [(8, 1)]
    assert seq.block_table == [0, 1, 2]  # position 8 reuses the freed block
    assert bm.block_token_ids[1] == (5, 6, 7, 901)
    assert bm.block_hash[1] == hash_block(hash_block(0, [1, 2, 3, 4]), [5, 6, 7, 901])
    sched.update(out)
    assert_no_leak(bm, sched)


def test_full_rejection_across_a_block_boundary():
    bm = BlockManager(16, BS)
    sched, seq = prefilled(bm, [1, 2, 3, 4, 5, 6, 7], sampled=8)  # the last token opens block 1... at position 7
    assert seq.block_table == [0, 1]
    _, s = verify_step(sched, seq, DRAFTS)  # positions 7..11: block 1 fills, block 2 holds 3 drafts
    assert (s.num_computed_tokens, s.num_new_tokens) == (7, 5)
    assert seq.block_table == [0, 1, 2]
    freed = settle(bm, seq, num_accepted=0, next_token=30)
    assert seq.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 30]
    assert seq.num_computed_tokens == 8 and seq.block_table == [0, 1] and freed == [2]
    assert_no_draft_cached(bm, DRAFTS)
    assert bm.num_free_blocks == 14
    assert_no_leak(bm, sched)


def test_full_acceptance_keeps_every_block():
    bm = BlockManager(16, BS)
    sched, seq = prefilled(bm, [1, 2, 3, 4, 5, 6], sampled=7)
    verify_step(sched, seq, DRAFTS)
    freed = settle(bm, seq, num_accepted=4, next_token=40)  # the bonus token
    assert seq.token_ids == [1, 2, 3, 4, 5, 6, 7, *DRAFTS, 40]
    assert seq.num_computed_tokens == 11 and seq.block_table == [0, 1, 2] and freed == []
    sched.update(sched.schedule())
    assert bm.block_token_ids[1] == (5, 6, 7, 901)  # full of accepted tokens now: published
    # accepted drafts and the bonus token, which this decode writes: published when it is planned, as any block
    assert bm.block_token_ids[2] == (902, 903, 904, 40)
    assert_no_leak(bm, sched)


def test_shared_last_block_is_copied_never_written_by_drafts():
    bm = BlockManager(16, BS)
    a = Sequence([1, 2, 3, 4, 5, 6], BS, request_id="r", index=0)
    assert bm.allocate(a)
    b = a.fork(1)
    bm.fork(a, b)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, drafts=FixedDrafts({a.seq_id: list(DRAFTS)}))
    for s in (a, b):
        s.status = SequenceStatus.RUNNING
        sched.running.append(s)
        s.num_computed_tokens = 6
    a.append_token(7)
    b.append_token(17)
    assert a.block_table == b.block_table == [0, 1] and bm.ref_counts[:2] == [2, 2]
    out = sched.schedule()
    # a (older) writes into shared block 1 first: it gets copy 2; its drafts take block 3;
    # b then holds block 1 alone and writes it in place
    assert out.blocks_to_copy == [(1, 2)]
    assert a.block_table == [0, 2, 3] and b.block_table == [0, 1]
    by_seq = {s.seq.seq_id: (s.num_new_tokens, s.num_draft_tokens) for s in out.scheduled}
    assert by_seq == {a.seq_id: (5, 4), b.seq_id: (1, 0)}
    sched.update(out)
    freed = settle(bm, a, num_accepted=0, next_token=50)
    assert freed == [3] and a.block_table == [0, 2] and a.num_computed_tokens == 7
    assert bm.ref_counts[:4] == [2, 1, 1, 0]  # block 1 is b's alone, untouched by a's step
    assert_no_draft_cached(bm, DRAFTS)
    assert_no_leak(bm, sched)


def test_preempted_sequence_drops_its_drafts():
    seq = Sequence([1, 2, 3], BS)
    seq.append_token(4)
    seq.add_draft_tokens([5, 6])
    seq.reset_for_recompute()
    assert seq.token_ids == [1, 2, 3, 4] and seq.num_draft_tokens == 0


def test_a_prompt_chunk_preempts_a_sequence_holding_drafts_and_gets_its_blocks():
    """Preemption mid-speculation, exact ids: B's verify step took the pool's last block for its drafts in step 1;
    the older A's next prompt chunk then finds no block, B (the newest) is preempted, its drafts dropped with
    all its blocks, and A's chunk takes the lowest freed id."""
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, drafts=FixedDrafts({}))
    a = Sequence([1, 2, 3, 4, 5, 6, 7, 8], BS, arrival=0)
    assert bm.allocate(a, 4)  # its first chunk of 4: block 0
    b = Sequence([11, 12, 13, 14, 15], BS, arrival=1)
    assert bm.allocate(b)  # blocks 1, 2
    for seq, computed in ((a, 4), (b, 5)):
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = computed
        sched.running.append(seq)
    b.append_token(16)
    assert a.block_table == [0] and b.block_table == [1, 2] and bm.num_free_blocks == 1
    sched.drafts = FixedDrafts({b.seq_id: [901, 902, 903]})  # positions 6..8: position 8 needs block 3
    out = sched.schedule()
    # without B's drafts holding block 3, A's chunk would have taken it and no one would be preempted
    assert out.preempted == [b]
    assert b.block_table == [] and b.num_draft_tokens == 0 and b.token_ids == [11, 12, 13, 14, 15, 16]
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0
    (s,) = out.scheduled
    assert s.seq is a and (s.num_computed_tokens, s.num_new_tokens, s.num_draft_tokens) == (4, 4, 0)
    assert a.block_table == [0, 1]  # B's blocks 1, 2, 3 came back; the lowest first
    assert bm.num_free_blocks == 2 and bm.ref_counts == [1, 1, 0, 0]
    sched.update(out)
    assert_no_leak(bm, sched)


def test_drafts_never_take_the_last_free_blocks_of_others():
    # 3 blocks: a holds 2 after its prefill; b waits for a slot; a's drafts would need block 2
    bm = BlockManager(3, BS, enable_prefix_caching=False)
    sched, a = prefilled(bm, [1, 2, 3, 4, 5, 6], sampled=7)
    b = Sequence([8], BS)
    assert bm.allocate(b)  # block 2
    b.status = SequenceStatus.RUNNING
    sched.running.append(b)
    b.num_computed_tokens = 1
    b.append_token(9)
    sched.drafts = FixedDrafts({a.seq_id: list(DRAFTS)})
    out = sched.schedule()
    assert [s.num_draft_tokens for s in out.scheduled] == [0, 0]  # no room: a decodes plainly
    assert a.token_ids == [1, 2, 3, 4, 5, 6, 7] and out.preempted == []


def test_the_runner_state_drops_rejected_drafts():
    """The step record tells the runner to cut the rejected drafts: its tokens and table match the sequence."""
    bm = BlockManager(16, BS)
    params = SamplingParams(temperature=0, max_tokens=20)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, drafts=FixedDrafts({}))
    seq = Sequence([1, 2, 3, 4, 5, 6], BS)
    sched.add(seq)
    builder, states = StepRecordBuilder(), SequenceStates()

    def run(num_accepted: int | None, token: int):
        out = sched.schedule()
        steps = states.apply(builder.build(out, [params] * len(out.scheduled), [None] * len(out.scheduled)))
        sched.update(out)
        if num_accepted is None:
            seq.append_token(token)
        else:
            settle(bm, seq, num_accepted, token)
        return steps

    run(None, 7)
    sched.drafts = FixedDrafts({seq.seq_id: list(DRAFTS)})
    (step,) = run(1, 20)
    assert step.token_ids == (7, *DRAFTS) and step.num_draft_tokens == 4 and len(step.uniforms) == 5
    (step,) = run(None, 21)  # a plain decode after the rollback
    assert step.num_computed_tokens == 8 and step.token_ids == (20,)
    state = states.states[seq.seq_id]
    assert state.token_ids == [1, 2, 3, 4, 5, 6, 7, 901, 20]
    assert state.block_table == seq.block_table == [0, 1, 2]


def test_verify_rows_see_the_drafts_before_them_as_output():
    """Row j of a verify step counts drafts 0..j-1 in its output (penalties, bad words, min_tokens read it),
    as plain decoding's output was when it sampled that position; the prompt stays the prompt."""
    from pagedllm.step_record import (
        LogitsRules,
        NewSequence,
        SamplingSpec,
        ScheduledStep,
        StepRecord,
    )

    rules = LogitsRules(frequency_penalty=0.5, repetition_penalty=1.1)
    spec = SamplingSpec(0.0, 0, 1.0, 0.0, None, rules)
    states = SequenceStates()
    # prompt 10 11 12, outputs 20 21 (21 not computed yet), drafts 30 31 32
    new = NewSequence(7, "r", (10, 11, 12, 20, 21, 30, 31, 32), 3, (0, 1), spec)
    step = ScheduledStep(7, 4, 4, uniforms=(0.0,) * 4, num_draft_tokens=3)
    (full,) = states.apply(StepRecord((step,), new_sequences=(new,)))
    assert full.token_ids == (21, 30, 31, 32)
    assert full.prompt_token_ids == (10, 11, 12)
    assert full.output_token_ids == ((20, 21), (20, 21, 30), (20, 21, 30, 31), (20, 21, 30, 31, 32))
