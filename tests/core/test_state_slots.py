"""A hybrid model's state slots in the block manager and the scheduler (no torch).

Exact slot ids on tiny pools, worked out from the rules (engine/state_slots.py,
the block manager's docstring): lowest free slot first; one per running
sequence, taken by ``allocate`` with one for each sample waiting to fork, given
back by ``free`` (preemption too); a fork's child gets its own slot and a
(source, destination) copy, after the step for samples of a prompt completing
in it, before the next step for a running parent (beam search); speculative
decoding's checkpoints: taken before a verify step (a copy of the slot), given
back by the rollback after it (a rejection copies it back and moves the
computed length to it) or by ``free``. Then a hypothesis property: random
requests with n > 1, beam forks, drafts right and wrong, preemptions and
finishes, periodic snapshot points or none; every slot, checkpoint and block
comes back, none is held twice, the snapshot pool and a prompt's points stay
bounded.

Snapshot points (the block manager's docstring): a prompt's last full block,
where its cached blocks end, and the last few multiples of
``state_snapshot_interval`` below its last full block, so the second prompt
sharing a system prompt hits the last of them inside it, the third its end.
"""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pagedllm.config import EngineConfig
from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence, SequenceStatus
from pagedllm.engine.state_slots import StateSlots
from pagedllm.resolved_config import state_snapshot_interval

BS = 4


def test_slots_go_out_lowest_first_and_come_back() -> None:
    slots = StateSlots(3)
    assert [slots.take(), slots.take()] == [0, 1]
    slots.give_back(0)
    assert slots.free_slots == [0, 2] and slots.num_used == 1
    assert slots.take() == 0
    assert slots.take() == 2
    with pytest.raises(ValueError, match="held"):
        slots.take()
    slots.give_back(1)
    with pytest.raises(ValueError, match="not held"):
        slots.give_back(1)
    with pytest.raises(ValueError):
        StateSlots(0)


def test_allocate_takes_a_slot_and_waits_when_none_is_free() -> None:
    bm = BlockManager(16, BS, num_state_slots=2)
    a, b, c = (Sequence([i] * 5, BS) for i in range(3))
    assert bm.allocate(a) and bm.allocate(b)
    assert (a.state_slot, b.state_slot) == (0, 1)
    free_blocks = bm.num_free_blocks
    assert not bm.can_allocate(c)  # blocks enough, no slot
    assert not bm.allocate(c)
    assert c.state_slot is None and c.block_table == [] and bm.num_free_blocks == free_blocks
    bm.free(a)
    assert a.state_slot is None
    assert bm.can_allocate(c) and bm.allocate(c)
    assert c.state_slot == 0


def test_samples_waiting_to_fork_reserve_their_slots() -> None:
    bm = BlockManager(16, BS, num_state_slots=3)
    parent = Sequence([1] * 6, BS)
    parent.fork_children = [parent.fork(1), parent.fork(2)]
    other = Sequence([2] * 3, BS)
    assert bm.allocate(other)  # slot 0: two left for a parent with two samples, not enough
    assert not bm.can_allocate(parent)
    bm.free(other)
    assert bm.allocate(parent)
    assert [parent.state_slot] + [c.state_slot for c in parent.fork_children] == [0, 1, 2]
    bm.free(parent)  # a preempted parent gives back its samples' slots too
    assert bm.state_slots.num_free == 3
    assert all(c.state_slot is None for c in parent.fork_children)


def test_forks_of_a_completing_prompt_copy_the_state_after_the_step() -> None:
    bm = BlockManager(16, BS, num_state_slots=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    other = Sequence([9] * 3, BS)
    sched.add(other)
    parent = Sequence([1] * 6, BS)
    parent.fork_children = [parent.fork(1), parent.fork(2)]
    sched.add(parent)
    out = sched.schedule()
    assert (other.state_slot, parent.state_slot) == (0, 1)
    assert out.state_copies_before == []
    assert out.state_copies_after == [(1, 2), (1, 3)]  # the prompt's state is the one this step computes
    assert [c.state_slot for c in out.scheduled[1].forks] == [2, 3]
    assert sched.schedule().state_copies_after == []  # taken once


def test_a_beam_fork_copies_before_the_next_step() -> None:
    bm = BlockManager(16, BS, num_state_slots=3)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=64)
    parent = Sequence([1] * 5, BS)
    sched.add(parent)
    sched.update(sched.schedule())
    parent.append_token(7)
    child = parent.fork(1)
    sched.fork_running(parent, child)
    assert child.state_slot == 1
    out = sched.schedule()
    assert (out.state_copies_before, out.state_copies_after) == ([(0, 1)], [])


def test_a_freed_fork_drops_its_pending_copy() -> None:
    bm = BlockManager(16, BS, num_state_slots=3)
    parent = Sequence([1] * 5, BS)
    assert bm.allocate(parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    bm.free(child)  # finished (pruned beam) before any step ran
    assert bm.take_state_copies() == ([], [])
    assert bm.state_slots.num_free == 2


def test_preemption_gives_the_slot_back() -> None:
    # 3 blocks of 4: two sequences of 5 tokens hold 2 + 1 blocks after their prompts... the second's decode
    # into a new block finds none free and preempts the newest
    bm = BlockManager(3, BS, num_state_slots=2)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    a, b = Sequence([1] * 5, BS), Sequence([2] * 4, BS)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [a, b] and (a.state_slot, b.state_slot) == (0, 1)
    sched.update(out)
    a.append_token(0)
    b.append_token(0)  # b's 5th token needs a 4th block: none left
    out = sched.schedule()
    assert out.preempted == [b]
    assert b.state_slot is None and bm.state_slots.free_slots == [1]


def test_no_prefix_hit_without_the_state_at_the_hit_point() -> None:
    bm = BlockManager(16, BS, num_state_slots=2)
    a = Sequence(list(range(9)), BS)
    assert bm.allocate(a)
    bm.cache_full_blocks(a, 9)
    bm.free(a)
    b = Sequence(list(range(9)), BS)
    assert bm.num_cached_prefix_tokens(b) == 0
    assert bm.allocate(b) and b.num_computed_tokens == 0


def test_a_snapshot_at_the_last_full_block_gives_the_next_prompt_its_hit() -> None:
    bm = BlockManager(32, BS, num_state_slots=2, num_snapshot_slots=2)
    a = Sequence(list(range(10)), BS)  # a lookup reaches (10 - 1) // 4 = 2 blocks: the point is 8 tokens
    assert bm.allocate(a) and a.state_snapshot_points == [8]
    assert bm.next_snapshot_point(a) == 8
    bm.cache_full_blocks(a, 8)
    bm.snapshot_state(a, 8)
    assert bm.take_state_copies() == ([], [(0, 2)])  # slot 0's state into snapshot slot 2, after the step
    b = Sequence(list(range(8)) + [50, 51, 52], BS)
    assert bm.num_cached_prefix_tokens(b) == 0  # the step has not run: the snapshot is not written yet
    bm.confirm_published()
    assert bm.num_cached_prefix_tokens(b) == 8
    assert bm.allocate(b) and (b.state_slot, b.num_computed_tokens) == (1, 8)
    assert bm.take_state_copies() == ([(2, 1)], [])  # the snapshot into b's slot, before its first step
    assert b.state_snapshot_points == []  # (11 - 1) // 4 * 4 = 8: nothing past its hit


def test_a_snapshot_goes_with_its_block() -> None:
    bm = BlockManager(3, BS, num_state_slots=1, num_snapshot_slots=1)
    a = Sequence(list(range(5)), BS)
    assert bm.allocate(a)
    bm.cache_full_blocks(a, 4)
    bm.snapshot_state(a, 4)
    bm.confirm_published()
    bm.free(a)
    again = Sequence(list(range(5)), BS)
    assert bm.num_cached_prefix_tokens(again) == 4
    other = Sequence([9] * 12, BS)  # takes all three blocks: the cached one is evicted
    assert bm.allocate(other)
    bm.free(other)
    assert bm.num_cached_prefix_tokens(again) == 0 and len(bm.snapshots) == 0


def test_a_shared_prefix_gets_its_own_snapshot_for_the_third_prompt() -> None:
    """b shares a's first 2 blocks, but a's snapshot is at 12 tokens: b computes from 0, its chunks end at 8
    (where its cached blocks end) and at 12 (its last full block), and c then hits the shared 8."""
    bm = BlockManager(32, BS, num_state_slots=2, num_snapshot_slots=3)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    a = Sequence(list(range(14)), BS)
    sched.add(a)
    out = sched.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [12]  # cut at a's point
    bm.confirm_published()
    sched.update(out)
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    b = Sequence(list(range(8)) + [90 + i for i in range(6)], BS)
    sched.add(b)
    chunks = []
    while b.num_computed_tokens < len(b):
        out = sched.schedule()
        chunks.append(out.scheduled[0].num_new_tokens)
        bm.confirm_published()
        sched.update(out)
    assert chunks == [8, 4, 2]
    c = Sequence(list(range(8)) + [70, 71, 72], BS)
    assert bm.num_cached_prefix_tokens(c) == 8


def _prefill(sched: Scheduler, seq: Sequence) -> list[int]:
    """Run ``seq``'s prompt alone, each step confirmed as the engine does, then abort it; its chunk sizes."""
    sched.add(seq)
    chunks = []
    while seq.num_computed_tokens < len(seq):
        out = sched.schedule()
        chunks.append(out.scheduled[0].num_new_tokens)
        sched.block_manager.confirm_published()
        sched.update(out)
    sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
    return chunks


def test_periodic_points_let_the_second_prompt_hit_a_shared_prefix() -> None:
    """A system prompt of 22 tokens (its full blocks end at 20), interval 8: a's points are the multiples of 8
    below its last full block (28) and 28; b hits 16, the last of them inside the shared part, and keeps its
    points 20 (its cached blocks end), 24, 28; c hits 20."""
    bm = BlockManager(64, BS, num_state_slots=2, num_snapshot_slots=16, state_snapshot_interval=8)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    system = list(range(22))
    a = Sequence(system + [100 + i for i in range(10)], BS)  # 32 tokens: (32 - 1) // 4 * 4 = 28
    assert _prefill(sched, a) == [8, 8, 8, 4, 4]  # a chunk ends at each point
    assert a.state_snapshot_points == [8, 16, 24, 28]
    b = Sequence(system + [200 + i for i in range(8)], BS)  # 30 tokens: its last full block ends at 28
    assert bm.num_cached_prefix_tokens(b) == 16  # blocks up to 20 are a's, the state is kept at 16
    assert _prefill(sched, b) == [4, 4, 4, 2]
    assert (b.num_cached_tokens, b.state_snapshot_points) == (16, [20, 24, 28])
    c = Sequence(system + [300 + i for i in range(6)], BS)
    assert bm.num_cached_prefix_tokens(c) == 20  # the shared part's end, which b kept
    assert bm.allocate(c) and c.num_computed_tokens == 20
    # snapshot slots 2.. go out lowest first: a's 8, 16, 24, 28 in 2-5, b's 20, 24, 28 in 6-8
    assert bm.take_state_copies() == ([(6, 0)], [])


def test_without_periodic_points_the_second_prompt_misses_the_shared_prefix() -> None:
    bm = BlockManager(64, BS, num_state_slots=2, num_snapshot_slots=16)  # interval 0: none
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    system = list(range(22))
    a = Sequence(system + [100 + i for i in range(10)], BS)
    assert _prefill(sched, a) == [28, 4] and a.state_snapshot_points == [28]
    assert bm.num_cached_prefix_tokens(Sequence(system + [200 + i for i in range(8)], BS)) == 0


@pytest.mark.parametrize(("num_snapshot_slots", "points"), [
    (16, [80, 84, 88, 92, 96]),  # the last 4 periodic points and the last full block
    (7, [92, 96]),  # a quarter of 7 slots: one periodic point
    (3, [96]),  # under 4 slots: none
])
def test_a_long_prompt_keeps_its_last_periodic_points_only(num_snapshot_slots: int, points: list[int]) -> None:
    bm = BlockManager(64, BS, num_state_slots=1, num_snapshot_slots=num_snapshot_slots, state_snapshot_interval=4)
    seq = Sequence(list(range(100)), BS)  # (100 - 1) // 4 * 4 = 96: 23 multiples of 4 below it
    assert bm.allocate(seq) and seq.state_snapshot_points == points


def test_one_long_prompt_does_not_flush_the_snapshot_pool() -> None:
    """8 prompts' snapshots, then a prompt with 24 periodic candidates: it adds 5 (4 periodic, its last
    block), so all 8 stay in a pool of 16."""
    bm = BlockManager(128, BS, num_state_slots=1, num_snapshot_slots=16, state_snapshot_interval=4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=256)
    shorts = [Sequence([1000 * (i + 1) + t for t in range(6)], BS) for i in range(8)]
    for seq in shorts:
        assert _prefill(sched, seq) == [4, 2]  # one point: its last full block (periodic ones lie below it)
    long = Sequence(list(range(100)), BS)
    assert _prefill(sched, long) == [80, 4, 4, 4, 4, 4]
    assert len(bm.snapshots) == 8 + 5 <= bm.snapshots.num_slots
    assert all(bm.num_cached_prefix_tokens(Sequence([*s.token_ids[:6], 7], BS)) == 4 for s in shorts)


def test_the_snapshot_interval_is_checked() -> None:
    with pytest.raises(ValueError, match="multiple of block_size=4"):
        BlockManager(8, BS, num_state_slots=1, num_snapshot_slots=4, state_snapshot_interval=6)
    with pytest.raises(ValueError, match="multiple of block_size=16"):
        EngineConfig(model="m", state_snapshot_interval=24)
    with pytest.raises(ValueError, match="needs prefix caching"):
        EngineConfig(model="m", state_snapshot_interval=32, enable_prefix_caching=False)
    # the default resolved once (ResolvedConfig.state_snapshot_interval): 1024 rounded down to block_size
    assert state_snapshot_interval(EngineConfig(model="m")) == 1024
    assert state_snapshot_interval(EngineConfig(model="m", block_size=48)) == 1008
    assert state_snapshot_interval(EngineConfig(model="m", block_size=2048)) == 2048  # at least one block
    assert state_snapshot_interval(EngineConfig(model="m", state_snapshot_interval=0)) == 0


def test_rollback_without_a_checkpoint_is_refused_for_state_models() -> None:
    bm = BlockManager(16, BS, num_state_slots=1)
    a = Sequence(list(range(6)), BS)
    assert bm.allocate(a)
    a.num_computed_tokens = 6
    assert not bm.can_checkpoint_state()  # no checkpoint slots at all: decodes stay plain
    with pytest.raises(ValueError, match="rolled back"):
        bm.rollback(a, 4)
    assert bm.rollback(a, 6) == [] and a.num_computed_tokens == 6  # keeping every token needs none


def _verify_planned(bm: BlockManager, seq: Sequence, drafts: list[int]) -> None:
    """What the scheduler does for a verify step: drafts appended, their blocks taken, the state checkpointed."""
    seq.add_draft_tokens(drafts)
    assert bm.append_slot(seq)
    bm.checkpoint_state(seq)


def _verified(seq: Sequence, emitted: list[int]) -> None:
    """What the engine does after it: the drafts dropped, the emitted tokens appended, all computed."""
    seq.num_computed_tokens = len(seq)
    seq.discard_draft_tokens()
    for t in emitted:
        seq.append_token(t)


def test_a_checkpoint_is_taken_before_a_verify_step_and_restored_after_a_rejection() -> None:
    # slots: 0-1 running, 2-3 snapshots, 4-5 checkpoints
    bm = BlockManager(16, BS, enable_prefix_caching=True, num_state_slots=2, num_snapshot_slots=2,
                      num_checkpoint_slots=2)
    a = Sequence([7] * 6, BS)
    assert bm.allocate(a) and a.state_slot == 0
    a.num_computed_tokens = 6
    a.append_token(8)  # 7 tokens, 6 computed: a decode
    bm.take_state_copies()
    _verify_planned(bm, a, [9, 9, 9])  # tokens 6..9 verified: blocks 0, 1, 2
    assert a.state_checkpoint == (4, 6) and a.block_table == [0, 1, 2]
    assert bm.take_state_copies() == ([(0, 4)], []) and bm.checkpoints.free_slots == [5]
    _verified(a, [9, 5])  # one draft accepted, the second rejected: 9 tokens, the last one new
    freed = bm.rollback(a, len(a) - 1)
    # the state holds the three drafts: back to the checkpoint (6 tokens); tokens 6..8 computed again next step
    assert a.num_computed_tokens == 6 and freed == [2] and a.block_table == [0, 1]
    assert bm.take_state_copies() == ([(4, 0)], []) and a.state_checkpoint is None
    assert bm.checkpoints.free_slots == [4, 5]


def test_a_verify_step_that_keeps_every_draft_gives_its_checkpoint_back_unused() -> None:
    bm = BlockManager(16, BS, num_state_slots=1, num_checkpoint_slots=1)
    a = Sequence([7] * 5, BS)
    assert bm.allocate(a)
    a.num_computed_tokens = 5
    a.append_token(8)
    _verify_planned(bm, a, [9, 9])
    assert a.state_checkpoint == (1, 5) and not bm.can_checkpoint_state()  # the one checkpoint slot is held
    assert bm.take_state_copies() == ([(0, 1)], [])
    _verified(a, [9, 9, 3])
    assert bm.rollback(a, len(a) - 1) == [] and a.num_computed_tokens == 8
    assert bm.take_state_copies() == ([], []) and a.state_checkpoint is None and bm.can_checkpoint_state()


def test_free_gives_a_checkpoint_back_and_drops_its_copy() -> None:
    bm = BlockManager(16, BS, num_state_slots=2, num_checkpoint_slots=2)
    a, b = Sequence([1] * 5, BS), Sequence([2] * 5, BS)
    assert bm.allocate(a) and bm.allocate(b)
    for s in (a, b):
        s.num_computed_tokens = 5
        s.append_token(3)
        _verify_planned(bm, s, [4])
    assert (a.state_checkpoint, b.state_checkpoint) == ((2, 5), (3, 5))
    bm.free(a)  # preempted while its verify step was planned: the copy into its checkpoint is moot
    assert a.state_checkpoint is None and bm.checkpoints.free_slots == [2]
    assert bm.take_state_copies() == ([(1, 3)], [])
    with pytest.raises(ValueError, match="checkpoint"):
        bm.checkpoint_state(b)  # one at a time


def test_the_scheduler_drafts_only_with_a_checkpoint_slot_free() -> None:
    class TwoDrafts:
        def propose(self, seq: Sequence, max_num_tokens: int, batch_size: int) -> list[int]:
            return [5, 5][:max_num_tokens]

    bm = BlockManager(32, BS, num_state_slots=2, num_checkpoint_slots=1)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64, drafts=TwoDrafts())
    a, b = Sequence([1] * 5, BS), Sequence([2] * 5, BS)
    sched.add(a)
    sched.add(b)
    sched.update(sched.schedule())  # both prompts
    for s in (a, b):
        s.append_token(3)
    out = sched.schedule()
    # a (the oldest) takes the one checkpoint slot and verifies two drafts; b decodes plainly
    assert [(s.seq, s.num_new_tokens, s.num_draft_tokens) for s in out.scheduled] == [(a, 3, 2), (b, 1, 0)]
    assert out.state_copies_before == [(a.state_slot, 2)]


def test_a_model_without_state_layers_holds_no_slots() -> None:
    bm = BlockManager(4, BS)
    a = Sequence([1] * 5, BS)
    assert bm.allocate(a) and a.state_slot is None
    assert bm.take_state_copies() == ([], [])


# --- the property ---------------------------------------------------------------
request = st.tuples(
    st.integers(0, 5),  # arrival step
    st.lists(st.integers(0, 2), min_size=1, max_size=9),  # prompt
    st.integers(1, 5),  # max new tokens
    st.integers(1, 3),  # n (samples forked when the prompt completes)
)


def _check_slots(bm: BlockManager, sched: Scheduler) -> None:
    held = []
    for s in sched.running:
        assert s.state_slot is not None, "a running sequence without a state slot"
        held.append(s.state_slot)
        held += [c.state_slot for c in s.fork_children]
    for w in sched.waiting:
        assert w.state_slot is None and w.block_table == []
    assert None not in held and len(set(held)) == len(held), f"slots held twice or missing: {held}"
    assert sorted(held) == sorted(set(range(bm.state_slots.num_slots)) - set(bm.state_slots.free_slots))
    checkpoints = [s.state_checkpoint[0] for s in sched.running if s.state_checkpoint is not None]
    assert all(s.state_checkpoint is None for s in sched.waiting)
    if bm.checkpoints is not None:
        assert len(set(checkpoints)) == len(checkpoints) == bm.checkpoints.num_used
    else:
        assert not checkpoints


class _PlannedDrafts:
    """Drafts of the tokens' pattern, as many as ``plan`` says for each decode in turn (0: none), as the
    speculator after a sequence's first output token."""

    def __init__(self, plan: list[int]) -> None:
        self.plan = plan
        self.num_proposed = 0

    def propose(self, seq: Sequence, max_num_tokens: int, batch_size: int) -> list[int]:
        if not seq.num_output_tokens:
            return []  # a prompt's last token (its samples fork after it): decodes draft
        self.num_proposed += 1
        return [0] * min(max_num_tokens, self.plan[self.num_proposed % len(self.plan)])


def _apply_verify(sched: Scheduler, seq: Sequence, num_accepted: int, max_tokens: int) -> None:
    """What the engine does after a verify step: the drafts dropped, the accepted ones and one more token
    appended until the sequence is done, the rest rolled back."""
    drafts = seq.discard_draft_tokens()
    num_accepted = min(num_accepted, len(drafts))
    for t in [*drafts[:num_accepted], 1]:
        seq.append_token(t)
        if seq.num_output_tokens >= max_tokens:
            sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
            return
    event("drafts: all accepted" if num_accepted == len(drafts) else "drafts: some rejected")
    sched.block_manager.rollback(seq, len(seq) - 1)


@settings(max_examples=150, deadline=None)
@given(
    max_num_seqs=st.integers(1, 4),
    extra_blocks=st.integers(0, 4),
    requests=st.lists(request, min_size=1, max_size=6),
    beam_forks=st.lists(st.booleans(), min_size=40, max_size=40),
    num_snapshots=st.integers(0, 8),  # 4 and more: periodic snapshot points (a quarter of the pool)
    interval=st.sampled_from([0, BS, 2 * BS]),
    num_checkpoints=st.integers(0, 4),
    draft_plan=st.lists(st.integers(0, 3), min_size=1, max_size=8),
    accept_plan=st.lists(st.integers(0, 3), min_size=40, max_size=40),
)
def test_every_slot_and_block_comes_back(max_num_seqs, extra_blocks, requests, beam_forks, num_snapshots, interval,
                                         num_checkpoints, draft_plan, accept_plan) -> None:
    requests = [(t, p, m, min(n, max_num_seqs)) for t, p, m, n in requests]
    longest = max(len(p) + m for _, p, m, _ in requests)
    # liveness: any one sequence fits at its longest; fewer blocks than the samples want preempt
    num_blocks = -(-longest // BS) + extra_blocks
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=True, num_state_slots=max_num_seqs,
                      num_snapshot_slots=num_snapshots, num_checkpoint_slots=num_checkpoints,
                      state_snapshot_interval=interval)
    snapshot_slots = set(range(max_num_seqs, max_num_seqs + num_snapshots))
    checkpoint_slots = set(range(max_num_seqs + num_snapshots, max_num_seqs + num_snapshots + num_checkpoints))
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max(4, longest),
                      drafts=_PlannedDrafts(draft_plan))
    pending = sorted(range(len(requests)), key=lambda i: requests[i][0])
    max_tokens: dict[int, int] = {}
    forked: set[int] = set()  # a sequence forks a beam once, a beam never: the work stays finite
    step_no = 0
    while pending or sched.has_unfinished():
        assert step_no < 400, "no progress"
        while pending and requests[pending[0]][0] <= step_no:
            idx = pending.pop(0)
            _, prompt, m, n = requests[idx]
            seq = Sequence(prompt, BS, request_id=str(idx))
            seq.fork_children = [seq.fork(i) for i in range(1, n)]
            for s in (seq, *seq.fork_children):
                max_tokens[s.seq_id] = m
            sched.add(seq)
        step_no += 1
        if not sched.has_unfinished():
            continue
        out = sched.schedule()
        if out.preempted:
            event("preemption")
        running_slots = {s.state_slot for s in sched.running}
        for src, dst in out.state_copies_before:  # a fork's copy, a prefix hit's snapshot, a checkpoint
            assert dst in running_slots | checkpoint_slots and src != dst
            assert src in running_slots | snapshot_slots | checkpoint_slots
            assert (src in checkpoint_slots) + (dst in checkpoint_slots) <= 1
            if src in snapshot_slots:
                event("prefix hit from a snapshot")
            if src in checkpoint_slots:
                event("a checkpoint restored")
        for src, dst in out.state_copies_after:  # a fork's copy, or a new snapshot
            assert src in running_slots and dst in running_slots | snapshot_slots and src != dst
        for s in out.scheduled:  # a chunk never runs past a snapshot point
            point = bm.next_snapshot_point(s.seq)
            assert point is None or s.num_computed_tokens + s.num_new_tokens <= point
            # at most the last full block, the shared part's end and a quarter of the pool's periodic points
            assert len(s.seq.state_snapshot_points) <= 2 + num_snapshots // 4
            if interval and any(p % interval == 0 and p < (len(s.seq) - 1) // BS * BS
                                for p in s.seq.state_snapshot_points):
                event("a periodic snapshot point")
        assert bm.snapshots is None or len(bm.snapshots) <= num_snapshots
        bm.confirm_published()
        _check_slots(bm, sched)
        sched.update(out)
        for s in out.scheduled:
            if s.num_draft_tokens:
                if s.seq.status == SequenceStatus.RUNNING:
                    _apply_verify(sched, s.seq, accept_plan[step_no % 40], max_tokens[s.seq.seq_id])
                continue
            samples = s.samples  # read before a token is appended to the parent
            for seq in (s.seq, *s.forks):
                if not samples or seq.status != SequenceStatus.RUNNING:
                    continue
                seq.append_token(seq.num_output_tokens % 3)
                if seq.num_output_tokens >= max_tokens[seq.seq_id]:
                    sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
                elif (beam_forks[step_no % 40] and seq.index < 100 and seq.seq_id not in forked
                      and len(sched.running) < max_num_seqs and bm.state_slots.num_free):
                    forked.add(seq.seq_id)
                    child = seq.fork(seq.index + 100)
                    max_tokens[child.seq_id] = max_tokens[seq.seq_id]
                    sched.fork_running(seq, child)
                    event("beam fork")
        _check_slots(bm, sched)
    assert bm.state_slots.num_free == max_num_seqs
    assert bm.checkpoints is None or bm.checkpoints.num_free == num_checkpoints
    assert bm.num_free_blocks == bm.num_blocks and bm.ref_counts == [0] * num_blocks


def test_the_kv_snapshot_shows_state_slots_and_snapshots() -> None:
    from pagedllm.engine.kv_snapshot import build_kv_snapshot

    bm = BlockManager(16, BS, num_state_slots=3, num_snapshot_slots=2)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=64)
    seq = Sequence(list(range(10)), BS, request_id="r")
    sched.add(seq)
    sched.update(sched.schedule())  # 8 tokens: cut at the snapshot point
    bm.confirm_published()
    assert build_kv_snapshot(sched)["state"] == {
        "bytes_per_slot": 0, "num_slots": 3, "used_slots": 1, "free_slots": 2,
        "slot_holders": [{"slot": 0, "seq_id": seq.seq_id, "request_id": "r"}],
        "num_snapshot_slots": 2, "snapshots": 1, "snapshots_taken": 1, "snapshot_bytes": 0, "snapshot_lru": [3],
        "num_checkpoint_slots": 0, "used_checkpoint_slots": 0, "checkpoints": [],
    }
    assert build_kv_snapshot(Scheduler(BlockManager(4, BS), 1, 8))["state"] is None
