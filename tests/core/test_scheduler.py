"""Scheduler: continuous batching, admission, budgets and recompute preemption.

The model runner is simulated: after ``out = sched.schedule()`` the step is
recorded with ``sched.update(out)`` and every scheduled sequence whose
``samples`` is True gets one new token.
"""

from __future__ import annotations

import pytest

from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.sequence import Sequence, SequenceStatus

BS = 4
FINISHED = SequenceStatus.FINISHED_LENGTH


def mk(tokens, **kw):
    return Sequence(list(tokens), block_size=BS, **kw)


def make(num_blocks=8, max_num_seqs=8, max_num_batched_tokens=64, caching=False):
    bm = BlockManager(num_blocks=num_blocks, block_size=BS, enable_prefix_caching=caching)
    return bm, Scheduler(
        bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
    )


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    """What must hold for any planned step."""
    bm = sched.block_manager
    seqs = [s.seq for s in out.scheduled]
    assert len(set(map(id, seqs))) == len(seqs)
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    assert len(out.scheduled) <= sched.max_num_seqs
    for s in out.scheduled:
        assert s.seq.status == SequenceStatus.RUNNING
        assert s.seq in sched.running
        assert s.num_new_tokens >= 1
        # every token computed this step has a slot
        assert len(s.seq.block_table) * BS >= s.num_computed_tokens + s.num_new_tokens
        assert s.seq not in out.preempted
    for p in out.preempted:
        assert p.block_table == [] and p.num_computed_tokens == 0
        assert p.status == SequenceStatus.WAITING
        assert p in sched.waiting
    for w in sched.waiting:
        assert w.block_table == []
    assert sum(bm.ref_counts) == sum(len(s.block_table) for s in sched.running)


def step(sched: Scheduler, out: SchedulerOutput | None = None) -> SchedulerOutput:
    """Plan a step (unless ``out`` is given) and simulate running it."""
    if out is None:
        out = sched.schedule()
    check_step(sched, out)
    sched.update(out)
    for s in out.scheduled:
        if s.samples:
            assert s.seq.num_computed_tokens == len(s.seq)
            s.seq.append_token(1000 + len(s.seq))
    return out


def finish_done(sched: Scheduler, max_tokens: dict) -> list[Sequence]:
    done = [s for s in sched.running if s.num_output_tokens >= max_tokens[s.seq_id]]
    for s in done:
        sched.finish(s, FINISHED)
    return done


def view(out: SchedulerOutput):
    return [(s.seq, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]


# --- construction ----------------------------------------------------------------
# the limits are EngineConfig's fields, checked there once (the scheduler no longer re-checks them)
@pytest.mark.parametrize(("field", "value"), [("max_num_seqs", 0), ("max_num_batched_tokens", 0),
                                              ("max_num_seqs", -1)])
def test_bad_limits(field, value):
    from pagedllm.config import EngineConfig

    with pytest.raises(ValueError, match=f"{field} must be a positive integer, got {value}"):
        EngineConfig(model="m", **{field: value})


def test_add_rejects_sequence_with_blocks():
    bm, sched = make()
    s = mk(range(5))
    bm.allocate(s)
    with pytest.raises(ValueError):
        sched.add(s)


def test_empty_schedule():
    _, sched = make()
    out = sched.schedule()
    assert out.is_empty and out.scheduled == [] and out.preempted == []
    assert out.num_batched_tokens == 0
    assert not sched.has_unfinished()


# --- prefill then decode ------------------------------------------------------------
def test_prefill_then_decodes():
    bm, sched = make()
    a = mk(range(6))
    sched.add(a)
    assert a.status == SequenceStatus.WAITING
    assert sched.num_waiting == 1 and sched.has_unfinished()

    out = sched.schedule()
    assert view(out) == [(a, 0, 6)]
    (pa,) = out.scheduled
    assert pa.is_prefill and pa.samples
    assert a.status == SequenceStatus.RUNNING
    assert sched.running == [a] and sched.num_waiting == 0
    assert len(a.block_table) == 2  # ceil(6 / 4)
    assert bm.num_free_blocks == 6
    sched.update(out)
    assert a.num_computed_tokens == 6
    a.append_token(100)

    # decode: one new token, written into block 1 (slot 3 of 4)
    out = sched.schedule()
    assert view(out) == [(a, 6, 1)]
    assert not out.scheduled[0].is_prefill and out.scheduled[0].samples
    assert len(a.block_table) == 2
    step(sched, out)
    # token 7 fills block 1; still 2 blocks
    out = step(sched)
    assert view(out) == [(a, 7, 1)]
    assert len(a.block_table) == 2
    # token 8 starts block 2
    out = step(sched)
    assert view(out) == [(a, 8, 1)]
    assert len(a.block_table) == 3
    assert bm.num_free_blocks == 5
    assert a.num_output_tokens == 4


def test_request_joins_running_batch():
    _, sched = make()
    a = mk(range(6))
    sched.add(a)
    step(sched)
    step(sched)
    b = mk(range(100, 105))
    sched.add(b)
    out = step(sched)
    # prefill of the newcomer and decode of the runner in the same step
    assert view(out) == [(b, 0, 5), (a, 7, 1)]
    assert out.scheduled[0].is_prefill and not out.scheduled[1].is_prefill
    assert out.num_batched_tokens == 6
    out = step(sched)
    assert view(out) == [(a, 8, 1), (b, 5, 1)]  # decodes, oldest first
    assert out.num_batched_tokens == 2


def test_decodes_are_ordered_by_arrival():
    _, sched = make()
    b = mk(range(100, 103), arrival=5)
    a = mk(range(3), arrival=1)
    sched.add(b)
    sched.add(a)
    out = step(sched)
    assert [s.seq for s in out.scheduled] == [b, a]  # admitted in queue order
    out = step(sched)
    assert [s.seq for s in out.scheduled] == [a, b]  # decodes oldest first


# --- budgets ---------------------------------------------------------------------------
def test_token_budget_chunks_prefill():
    bm, sched = make(max_num_batched_tokens=10)
    a = mk(range(6))
    b = mk(range(100, 106))
    c = mk(range(200, 202))  # small, but behind b: FCFS
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    # a whole, then the first 4 tokens of b with the budget left: 6 + 4 = 10
    assert view(out) == [(a, 0, 6), (b, 0, 4)]
    assert out.scheduled[0].samples and not out.scheduled[1].samples
    assert out.scheduled[1].is_prefill
    step(sched, out)
    assert list(sched.waiting) == [c]
    assert b.block_table == [2]  # blocks for its first chunk only; later chunks take theirs
    assert b.num_computed_tokens == 4 and b.num_output_tokens == 0
    assert bm.num_free_blocks == 8 - 3
    out = sched.schedule()
    # decode a (1), the rest of b (2), all of c (2)
    assert view(out) == [(b, 4, 2), (c, 0, 2), (a, 6, 1)]
    assert all(s.samples for s in out.scheduled)
    assert b.block_table == [2, 3] and c.block_table == [4]  # b's second chunk took its block first
    step(sched, out)
    assert out.num_batched_tokens == 5
    assert sched.num_waiting == 0
    assert b.num_output_tokens == 1


def test_long_prompt_is_chunked_over_steps_while_others_decode():
    bm, sched = make(num_blocks=16, max_num_batched_tokens=4)
    a = mk(range(2))
    sched.add(a)
    step(sched)
    long = mk(range(100, 111))  # 11 tokens, budget 4 per step
    sched.add(long)
    plans = [view(step(sched)) for _ in range(4)]
    assert plans == [
        [(long, 0, 3), (a, 2, 1)],
        [(long, 3, 3), (a, 3, 1)],
        [(long, 6, 3), (a, 4, 1)],
        [(long, 9, 2), (a, 5, 1)],
    ]
    assert long.num_output_tokens == 1 and long.num_computed_tokens == 11
    assert len(long.block_table) == 3
    assert view(step(sched)) == [(a, 6, 1), (long, 11, 1)]


def test_prompt_bigger_than_budget_runs_alone():
    # max_num_batched_tokens below the prompt length: no deadlock
    _, sched = make(num_blocks=8, max_num_batched_tokens=3)
    a = mk(range(8))
    sched.add(a)
    assert [view(step(sched)) for _ in range(3)] == [[(a, 0, 3)], [(a, 3, 3)], [(a, 6, 2)]]
    assert a.num_output_tokens == 1


def test_chunked_prompt_publishes_only_computed_blocks():
    bm, sched = make(num_blocks=16, max_num_batched_tokens=6, caching=True)
    a = mk(range(12))
    sched.add(a)
    step(sched)  # tokens 0..5: block 0 full, block 1 half computed
    twin = mk(range(12))
    assert bm.num_cached_prefix_tokens(twin) == 4
    step(sched)  # tokens 6..11
    assert bm.num_cached_prefix_tokens(twin) == 8  # never the block of the last token


def test_forks_wait_for_a_chunked_prompt_to_complete():
    bm, sched = make(num_blocks=8, max_num_batched_tokens=4)
    parent = mk(range(6))
    kids = [parent.fork(i) for i in (1, 2)]
    parent.fork_children = list(kids)
    sched.add(parent)
    out = step(sched)
    assert view(out) == [(parent, 0, 4)] and out.scheduled[0].forks == ()
    assert parent.fork_children == kids and all(k.block_table == [] for k in kids)
    assert sched.running == [parent]
    out = step(sched)
    assert view(out) == [(parent, 4, 2)]
    assert out.scheduled[0].forks == tuple(kids)
    assert all(k.block_table == parent.block_table for k in kids)
    assert bm.ref_counts[parent.block_table[0]] == 3
    assert all(k.num_computed_tokens == 6 for k in kids)


def test_preempted_chunked_prompt_starts_over_and_keeps_its_forks():
    bm, sched = make(num_blocks=3, max_num_batched_tokens=4)
    a = mk(range(7))  # 2 blocks
    sched.add(a)
    step(sched)
    step(sched)
    parent = mk(range(100, 108))  # its first chunk takes the last free block
    kid = parent.fork(1)
    parent.fork_children = [kid]
    sched.add(parent)
    out = step(sched)
    assert view(out) == [(parent, 0, 3), (a, 7, 1)]
    assert parent.block_table == [2] and bm.num_free_blocks == 0
    # a needs a third block at token 8: the newest request (parent, mid-prompt) yields
    out = step(sched)
    assert out.preempted == [parent] and view(out) == [(a, 8, 1)]
    assert parent.block_table == [] and parent.num_computed_tokens == 0
    assert parent.fork_children == [kid] and list(sched.waiting) == [parent]
    assert a.block_table == [0, 1, 2] and bm.num_free_blocks == 0


def test_token_budget_counts_decodes_first():
    _, sched = make(max_num_batched_tokens=8)
    a = mk(range(4))
    b = mk(range(100, 104))
    sched.add(a)
    sched.add(b)
    out = step(sched)
    assert out.num_batched_tokens == 8  # both prompts, budget exactly used
    c = mk(range(200, 207))  # 7 tokens, but 2 are taken by decodes
    sched.add(c)
    out = step(sched)
    assert view(out) == [(c, 0, 6), (a, 4, 1), (b, 4, 1)]
    assert out.num_batched_tokens == 8
    assert c.num_output_tokens == 0


def test_max_num_seqs():
    _, sched = make(max_num_seqs=2)
    seqs = [mk(range(10 * i, 10 * i + 3)) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = step(sched)
    assert [s.seq for s in out.scheduled] == seqs[:2]
    assert list(sched.waiting) == [seqs[2]]
    out = step(sched)
    assert len(out.scheduled) == 2
    assert list(sched.waiting) == [seqs[2]]
    sched.finish(seqs[0], FINISHED)
    out = step(sched)
    assert view(out)[0] == (seqs[2], 0, 3)
    assert len(out.scheduled) == 2
    assert sched.num_running == 2


def test_a_reservation_holds_places_against_max_num_seqs():
    """A beam search (reserving its width) holds that many places from admission, beams forked or not."""
    bm, sched = make(num_blocks=16, max_num_seqs=4)
    beam = mk(range(3), request_id="beam")
    beam.num_reserved_seqs = 3
    other, third = mk(range(10, 13), request_id="other"), mk(range(20, 23), request_id="third")
    for s in (beam, other, third):
        sched.add(s)
    out = step(sched)
    # beam holds 3 places with 1 sequence running: one place left, for `other`
    assert [s.seq for s in out.scheduled] == [beam, other]
    assert list(sched.waiting) == [third]
    # two forked beams stay within the reservation: still no room for `third`
    for index in (1, 2):
        child = beam.fork(index=index)
        sched.fork_running(beam, child)
        assert child.num_reserved_seqs == 3
    out = step(sched)
    assert sched.num_running == 4 and list(sched.waiting) == [third]
    # a preempted beam re-admitted alone takes its request's whole reservation again
    preempted = sched._preempt_request(beam)
    assert len(preempted) == 3 and sched.num_running == 1
    sched.finish(other, FINISHED)
    out = step(sched)
    assert [s.seq for s in out.scheduled][:1] == [preempted[-1]]
    running_beams = [s for s in sched.running if s.request_id == "beam"]
    assert len(running_beams) == 3  # re-admitted together: they fit in the reservation
    assert third in sched.running and not sched.waiting  # 3 reserved + 1 = max_num_seqs
    for s in running_beams:
        sched.finish(s, FINISHED)
    step(sched)
    assert sched.num_running == 1
    assert bm.num_free_blocks == bm.num_blocks - len(third.block_table)


# --- a request that does not fit waits ---------------------------------------------------
def test_request_too_big_for_free_pool_waits():
    bm, sched = make(num_blocks=4)
    a = mk(range(12))  # 3 of 4 blocks
    b = mk(range(100, 108))  # 2 blocks: does not fit beside a
    sched.add(a)
    sched.add(b)
    out = step(sched)
    assert view(out) == [(a, 0, 12)]
    assert list(sched.waiting) == [b]
    assert b.status == SequenceStatus.WAITING and b.block_table == []
    assert bm.num_free_blocks == 1
    sched.finish(a, FINISHED)
    assert bm.num_free_blocks == 4
    out = step(sched)
    assert view(out) == [(b, 0, 8)]


# --- preemption ---------------------------------------------------------------------------
def _two_full_runners(caching=False):
    """Pool of 4 blocks held by a (oldest) and b, 8 prompt tokens each."""
    bm, sched = make(num_blocks=4, caching=caching)
    a = mk(range(8))
    b = mk(range(100, 108))
    sched.add(a)
    sched.add(b)
    out = step(sched)
    assert view(out) == [(a, 0, 8), (b, 0, 8)]
    assert bm.num_free_blocks == 0
    assert len(a) == len(b) == 9  # each needs a third block to decode
    return bm, sched, a, b


def test_preempts_newest_running_sequence():
    bm, sched, a, b = _two_full_runners()
    b_blocks = list(b.block_table)
    c = mk(range(200, 202))
    sched.add(c)
    b_tokens = list(b.token_ids)
    out = step(sched)
    assert out.preempted == [b]
    assert view(out) == [(a, 8, 1)]  # no admission in a preempting step (c waits)
    # b lost its blocks, kept its tokens, and waits at the front
    assert b.block_table == []
    assert b.num_computed_tokens == 0
    assert b.token_ids == b_tokens
    assert b.status == SequenceStatus.WAITING
    assert b.num_preemptions == 1
    assert list(sched.waiting) == [b, c]
    assert sched.running == [a]
    assert sched.num_preemptions == 1
    # a's new block is one of b's
    assert a.block_table[2] in b_blocks
    assert bm.num_free_blocks == 1


def test_preempted_sequence_resumes_and_completes():
    bm, sched, a, b = _two_full_runners()
    max_tokens = {a.seq_id: 4, b.seq_id: 3}
    out = step(sched)
    assert out.preempted == [b]
    b_tokens = list(b.token_ids)  # prompt + 1 generated token
    # a runs alone; it needs at most 3 blocks (8 + 4 - 1 tokens written)
    while a.num_output_tokens < 4:
        out = step(sched)
        assert out.preempted == []
        assert all(s.seq is a for s in out.scheduled)
        assert list(sched.waiting) == [b]  # b (3 blocks) does not fit beside a
    assert finish_done(sched, max_tokens) == [a]
    assert a.status == FINISHED
    assert a.num_output_tokens == 4
    # b is recomputed from all its tokens: prompt and the one it generated
    out = step(sched)
    assert view(out) == [(b, 0, 9)]
    assert b.token_ids[:9] == b_tokens
    while b.num_output_tokens < 3:
        step(sched)
    assert finish_done(sched, max_tokens) == [b]
    assert b.num_output_tokens == 3
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == 4
    assert bm.ref_counts == [0] * 4


def test_preempted_victim_can_be_the_sequence_itself():
    bm, sched = make(num_blocks=4)
    a = mk(range(7))  # its next token still fits its 2 blocks
    b = mk(range(100, 108))  # its next token needs a third block
    sched.add(a)
    sched.add(b)
    step(sched)
    assert len(a) == 8 and len(b) == 9
    out = step(sched)
    assert out.preempted == [b]
    assert view(out) == [(a, 7, 1)]
    assert len(a.block_table) == 2
    assert bm.num_free_blocks == 2


def test_preemption_frees_only_as_many_as_needed():
    bm, sched = make(num_blocks=6)
    a = mk(range(8))  # 2 blocks
    b = mk(range(100, 103))  # 1 block, room for one more token
    c = mk(range(200, 208))  # 2 blocks
    for s in (a, b, c):
        sched.add(s)
    step(sched)
    assert bm.num_free_blocks == 1
    # a needs a block and gets the free one; b's token fits; c needs a block
    # and is itself the newest: only c is preempted
    out = step(sched)
    assert out.preempted == [c]
    assert view(out) == [(a, 8, 1), (b, 3, 1)]
    assert bm.num_free_blocks == 2
    # b now needs its second block and gets one of c's; c (3 blocks) waits
    out = step(sched)
    assert out.preempted == []
    assert view(out) == [(a, 9, 1), (b, 4, 1)]
    assert len(b.block_table) == 2
    assert bm.num_free_blocks == 1
    assert list(sched.waiting) == [c]


def test_several_preemptions_keep_arrival_order_in_waiting():
    bm, sched = make(num_blocks=3)
    a = mk(range(4))
    b = mk(range(100, 104))
    c = mk(range(200, 204))
    for s in (a, b, c):
        sched.add(s)
    step(sched)
    assert bm.num_free_blocks == 0
    # all three need a second block: c then b are preempted for a
    out = step(sched)
    assert out.preempted == [c, b]
    assert view(out) == [(a, 4, 1)]
    assert list(sched.waiting) == [b, c]


def test_preemption_with_tied_arrivals_never_preempts_a_scheduled_sequence():
    # n outputs of one request may share their arrival key
    bm, sched = make(num_blocks=4)
    a = mk(range(7), arrival=5)
    b = mk(range(100, 108), arrival=5)
    sched.add(a)
    sched.add(b)
    step(sched)
    out = sched.schedule()
    check_step(sched, out)
    assert len(out.preempted) == 1
    victim = out.preempted[0]
    survivor = a if victim is b else b
    assert [s.seq for s in out.scheduled] == [survivor]
    assert len(survivor.block_table) * BS >= len(survivor)


def test_preemption_recompute_reuses_its_cached_first_block():
    bm, sched, a, b = _two_full_runners(caching=True)
    assert b.block_table == [2, 3]
    out = step(sched)
    assert out.preempted == [b]
    # b's blocks went back last-first; a popped the head, b's block 3
    assert a.block_table == [0, 1, 3]
    while a.num_output_tokens < 4:
        step(sched)
    sched.finish(a, FINISHED)
    out = step(sched)
    # b's first block (block 2) was still cached: only tokens 4..8 recomputed
    assert view(out) == [(b, 4, 5)]
    assert b.block_table[0] == 2
    assert b.num_cached_tokens == 4


# --- prefix caching through the scheduler ---------------------------------------------
def test_prefix_hit_within_and_across_steps():
    bm, sched = make(caching=True)
    prompt = list(range(9))
    a = mk(prompt)
    b = mk(prompt)
    sched.add(a)
    sched.add(b)
    out = step(sched)
    # a's full blocks are published as soon as a is scheduled (their K/V is
    # written in this step, before attention reads it), so b, admitted right
    # after a in the same step, already shares them
    assert view(out) == [(a, 0, 9), (b, 8, 1)]
    assert b.block_table[:2] == a.block_table[:2]
    c = mk(prompt)
    sched.add(c)
    out = step(sched)
    assert view(out)[0] == (c, 8, 1)
    assert c.block_table[:2] == a.block_table[:2]
    assert bm.ref_counts[a.block_table[0]] == 3
    assert bm.num_prefix_queries == 27
    assert bm.num_prefix_hits == 16


def test_pool_rejected_admission_leaves_the_cache_alone():
    bm, sched = make(num_blocks=6, max_num_batched_tokens=24, caching=True)
    # an earlier prompt left its two full blocks cached (the LRU's head); its partial block 2 holds nothing
    p = mk(range(9))
    bm.allocate(p)
    bm.cache_full_blocks(p, len(p))
    bm.free(p)
    cached = dict(bm.hash_to_block)
    assert list(bm.free_blocks) == [2, 3, 4, 5, 1, 0]
    a = mk(range(100, 104))
    sched.add(a)
    step(sched)
    w = mk(range(200, 220))  # 20 tokens in one chunk = 5 blocks; a holds 2 of the 6
    sched.add(w)
    for _ in range(3):
        out = step(sched)
        assert [s.seq for s in out.scheduled] == [a]
        assert list(sched.waiting) == [w] and w.block_table == []
        # the waiting head took nothing, so it evicted nothing
        assert all(bm.hash_to_block.get(h) == blk for h, blk in cached.items())
    assert bm.num_free_blocks == 6 - len(a.block_table)
    # the earlier prompt still hits both blocks
    again = mk(range(9))
    assert bm.allocate(again)
    assert again.num_cached_tokens == 8


def test_budget_counts_only_uncached_tokens():
    bm, sched = make(max_num_batched_tokens=8, caching=True)
    p = mk(range(9))
    bm.allocate(p)
    bm.cache_full_blocks(p, len(p))
    bm.free(p)
    a = mk(range(100, 104))
    sched.add(a)
    step(sched)
    # 12 tokens > the 7 left beside a's decode, but 8 of them are cached
    w = mk(list(range(8)) + [50, 51, 52, 53])
    sched.add(w)
    out = step(sched)
    assert view(out) == [(w, 8, 4), (a, 4, 1)]
    assert out.num_batched_tokens == 5


def test_no_admission_in_a_preempting_step_even_if_the_head_fits():
    bm, sched = make(num_blocks=4, caching=True)
    a = mk(range(8))
    v = mk(range(8))
    sched.add(a)
    sched.add(v)
    out = step(sched)
    # v shares a's first block; its second block (the last-token block) is
    # its own copy of a's, since a prompt's last token is never served from cache
    assert view(out) == [(a, 0, 8), (v, 4, 4)]
    assert a.block_table == [0, 1] and v.block_table == [0, 2]
    # both need a third block; one is free: a takes it, v preempts itself
    out = step(sched)
    assert out.preempted == [v]
    assert view(out) == [(a, 8, 1)]
    # v would fit right now (both its full blocks are a's, plus the one free
    # block), but a step that preempted admits nothing
    assert bm.num_free_blocks == 1
    assert bm.num_cached_prefix_tokens(v) == 8
    assert list(sched.waiting) == [v]
    out = step(sched)
    assert view(out) == [(v, 8, 1), (a, 9, 1)]
    assert v.block_table[:2] == a.block_table[:2]
    assert bm.num_free_blocks == 0


# --- finish -----------------------------------------------------------------------------
def test_finish_frees_blocks_at_once():
    bm, sched = make()
    a = mk(range(6))
    b = mk(range(100, 110))
    sched.add(a)
    sched.add(b)
    step(sched)
    assert bm.num_free_blocks == 8 - 2 - 3
    sched.finish(b, SequenceStatus.FINISHED_STOPPED)
    assert bm.num_free_blocks == 6
    assert b.block_table == []
    assert b.status == SequenceStatus.FINISHED_STOPPED and b.is_finished
    assert sched.running == [a]
    out = step(sched)
    assert view(out) == [(a, 6, 1)]


def test_finish_waiting_sequence():
    _, sched = make()
    a = mk(range(3))
    sched.add(a)
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    assert sched.num_waiting == 0 and not sched.has_unfinished()
    assert a.status == SequenceStatus.FINISHED_ABORTED
    assert sched.schedule().is_empty


@pytest.mark.parametrize("status", [SequenceStatus.WAITING, SequenceStatus.RUNNING])
def test_finish_rejects_unfinished_status(status):
    _, sched = make()
    a = mk(range(3))
    sched.add(a)
    with pytest.raises(ValueError):
        sched.finish(a, status)
    assert list(sched.waiting) == [a]
