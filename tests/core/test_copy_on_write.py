"""Copy-on-write block sharing, at the level of block ids and reference counts (no torch).

The expected values are worked out by hand from the rules of the design
(seed ch.04 section 6 and the block manager's docstring), not read back
from the code:

  * ``fork`` points a second block table at the same blocks: ref counts go
    up, no block leaves the free list;
  * before a token is written into a block whose ref count is above 1, the
    writer gets a private copy (a fresh block, recorded as a (source,
    destination) pair); a block with ref count 1 is written in place;
  * a new token past the last block takes a fresh block: full blocks are
    never copied.

The model runner is simulated: a step is recorded with ``Scheduler.update``
and every sample that reached its last token gets a token that depends only
on its own tokens and index, like a seeded model would.
"""

from __future__ import annotations

import pytest

from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.sequence import Sequence, SequenceStatus

BS = 4


def pool_in_order(num_blocks: int, first: list[int], block_size: int = BS, caching: bool = True) -> BlockManager:
    """A pool whose free list starts with the block ids ``first``, in that order.

    Built through the public API only: every block is allocated to a
    one-block sequence (ids come out 0, 1, 2, ...) and published in the
    prefix cache, then the holders of ``first`` are freed first, then the
    others. Published blocks keep their hashes when freed, so they wait in
    least-recently-freed order (empty blocks would come out lowest id first).
    """
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    holders = []
    for b in range(num_blocks):
        s = Sequence([10_000 + b] * block_size, block_size)
        assert bm.allocate(s)
        assert s.block_table == [b]
        bm.cache_full_blocks(s, block_size)
        holders.append(s)
    for b in first:
        bm.free(holders[b])
    for b in range(num_blocks):
        if b not in first:
            bm.free(holders[b])
    assert list(bm.free_blocks)[: len(first)] == first
    assert bm.num_free_blocks == num_blocks
    return bm


def three_forks(bm: BlockManager, prompt: list[int]) -> list[Sequence]:
    """Requests A, B, C with one prompt: A allocates, B and C are forked from it."""
    a = Sequence(prompt, bm.block_size, request_id="r", index=0)
    assert bm.allocate(a)
    b, c = a.fork(1), a.fork(2)
    bm.fork(a, b)
    bm.fork(a, c)
    return [a, b, c]


def first_token(seqs: list[Sequence]) -> None:
    """The shared prefill ran (all prompt tokens computed); each sample got its own token."""
    for i, s in enumerate(seqs):
        s.num_computed_tokens = len(s)
        s.append_token(900 + i)


# --- fork ------------------------------------------------------------------------------
def test_fork_shares_every_block_and_takes_none():
    bm = pool_in_order(100, [47, 12, 91, 34, 67])
    a, b, c = three_forks(bm, list(range(8)))  # 8 tokens: blocks 47 and 12, both full
    assert a.block_table == b.block_table == c.block_table == [47, 12]
    assert b.block_table is not a.block_table  # each has its own table
    assert bm.ref_counts[47] == bm.ref_counts[12] == 3
    assert sum(bm.ref_counts) == 6
    assert bm.num_used_blocks == 2
    assert list(bm.free_blocks)[:3] == [91, 34, 67]  # nothing was popped
    assert bm.take_copies() == []
    assert bm.num_cow_copies == 0


def test_fork_into_a_sequence_that_holds_blocks_raises():
    bm = BlockManager(8, BS)
    a = Sequence(list(range(6)), BS)
    b = Sequence(list(range(6)), BS)
    assert bm.allocate(a) and bm.allocate(b)
    with pytest.raises(ValueError):
        bm.fork(a, b)


def test_seed_example_full_prompt_blocks_each_new_token_takes_a_private_block():
    # seed ch.04 section 6: A, B, C share [47, 12]; after each generates a
    # token they hold [47, 12, 91], [47, 12, 34], [47, 12, 67]: 5 blocks, and
    # nothing is copied since the prompt fills its two blocks exactly.
    bm = pool_in_order(100, [47, 12, 91, 34, 67])
    seqs = three_forks(bm, list(range(8)))
    assert bm.num_used_blocks == 2
    first_token(seqs)
    for s in seqs:
        assert bm.append_slot(s)
    assert [s.block_table for s in seqs] == [[47, 12, 91], [47, 12, 34], [47, 12, 67]]
    assert bm.num_used_blocks == 5  # three independent requests would hold 9
    assert bm.ref_counts[47] == bm.ref_counts[12] == 3
    assert bm.ref_counts[91] == bm.ref_counts[34] == bm.ref_counts[67] == 1
    assert bm.take_copies() == []
    assert bm.num_cow_copies == 0


def test_seed_example_with_a_partial_last_block_two_copy_and_the_last_writes_in_place():
    # a 6-token prompt: block 12 holds 2 of its 4 slots; every first token
    # goes to slot 2 of block 12, so the first two writers copy it and the
    # third, by then its only holder, writes in place
    bm = pool_in_order(100, [47, 12, 91, 34])
    a, b, c = three_forks(bm, list(range(6)))
    first_token([a, b, c])
    assert bm.append_slot(a)
    assert a.block_table == [47, 91]
    assert bm.ref_counts[12] == 2
    assert bm.append_slot(b)
    assert b.block_table == [47, 34]
    assert bm.ref_counts[12] == 1
    assert bm.append_slot(c)
    assert c.block_table == [47, 12]  # ref count 1: written in place
    assert bm.ref_counts[47] == 3
    assert bm.ref_counts[12] == bm.ref_counts[91] == bm.ref_counts[34] == 1
    assert bm.num_used_blocks == 4
    assert bm.num_cow_copies == 2
    # the copies come out once, in the order they were decided
    assert bm.take_copies() == [(12, 91), (12, 34)]
    assert bm.take_copies() == []
    # the next token (slot 3) lands in each one's now private block: no copy, no block
    for i, s in enumerate((a, b, c)):
        s.num_computed_tokens = len(s)
        s.append_token(950 + i)
        assert bm.append_slot(s)
    assert [s.block_table for s in (a, b, c)] == [[47, 91], [47, 34], [47, 12]]
    assert bm.take_copies() == []
    # slot 8 is past the last block: a fresh block each, the shared full block 47 is not copied
    for i, s in enumerate((a, b, c)):
        s.num_computed_tokens = len(s)
        s.append_token(960 + i)
        assert bm.append_slot(s)
    assert all(len(s.block_table) == 3 and s.block_table[0] == 47 for s in (a, b, c))
    assert len({s.block_table[2] for s in (a, b, c)}) == 3
    assert bm.ref_counts[47] == 3
    assert bm.take_copies() == []
    assert bm.num_cow_copies == 2


def test_unshared_block_is_written_in_place():
    bm = BlockManager(8, BS)
    s = Sequence(list(range(6)), BS)
    assert bm.allocate(s)
    assert s.block_table == [0, 1]
    first_token([s])
    assert bm.append_slot(s)
    assert s.block_table == [0, 1]
    assert bm.num_used_blocks == 2
    assert bm.take_copies() == []
    assert bm.num_cow_copies == 0


def test_can_append_slot_counts_the_copy():
    # one free block: the first writer can copy, the second cannot (and takes nothing)
    bm = BlockManager(3, BS)
    a, b, c = three_forks(bm, list(range(6)))  # blocks [0, 1]; block 2 free
    first_token([a, b, c])
    assert bm.can_append_slot(a)
    assert bm.append_slot(a)
    assert a.block_table == [0, 2]
    assert not bm.can_append_slot(b)
    before = (list(bm.free_blocks), list(bm.ref_counts), list(b.block_table))
    assert not bm.append_slot(b)
    assert (list(bm.free_blocks), list(bm.ref_counts), list(b.block_table)) == before
    assert bm.take_copies() == [(1, 2)]


def test_freeing_one_fork_leaves_the_others_intact_and_all_return_the_pool():
    bm = pool_in_order(100, [47, 12, 91, 34])
    a, b, c = three_forks(bm, list(range(6)))
    first_token([a, b, c])
    for s in (a, b, c):
        assert bm.append_slot(s)
    bm.take_copies()
    bm.free(a)
    assert a.block_table == []
    assert b.block_table == [47, 34] and c.block_table == [47, 12]
    assert bm.ref_counts[47] == 2 and bm.ref_counts[34] == 1 and bm.ref_counts[12] == 1
    assert bm.ref_counts[91] == 0 and 91 in bm.free_blocks
    assert 47 not in bm.free_blocks
    assert bm.num_used_blocks == 3
    bm.free(c)
    assert b.block_table == [47, 34]
    assert bm.ref_counts[47] == 1 and 12 in bm.free_blocks
    bm.free(b)
    assert bm.num_free_blocks == bm.num_blocks == 100
    assert bm.ref_counts == [0] * 100


def test_freeing_a_fork_before_any_write_only_drops_its_references():
    bm = pool_in_order(100, [47, 12])
    a, b, c = three_forks(bm, list(range(8)))
    bm.free(b)
    assert bm.ref_counts[47] == bm.ref_counts[12] == 2
    assert bm.num_used_blocks == 2
    assert a.block_table == c.block_table == [47, 12]
    bm.free(a)
    bm.free(c)
    assert bm.num_free_blocks == 100 and bm.ref_counts == [0] * 100


# --- pending copies ------------------------------------------------------------------------
def test_copy_into_a_block_freed_before_the_step_is_dropped():
    bm = BlockManager(8, BS)
    a, b, c = three_forks(bm, list(range(6)))  # [0, 1]
    first_token([a, b, c])
    assert bm.append_slot(a)
    assert a.block_table == [0, 2]
    bm.free(a)  # e.g. aborted before the step runs: its copy is moot
    assert bm.take_copies() == []


def test_freed_copy_destination_reused_by_another_copy_is_copied_once():
    # two shared groups in a 5-block pool, one free block (4). A's copy 1 -> 4
    # is dropped when A is freed; E then copies 3 -> 4. Only (3, 4) may reach
    # the runner: two copies into one destination would race.
    bm = BlockManager(5, BS)
    a = Sequence(list(range(6)), BS)
    e = Sequence(list(range(100, 106)), BS)
    assert bm.allocate(a) and bm.allocate(e)
    assert a.block_table == [0, 1] and e.block_table == [2, 3]
    b, f = a.fork(1), e.fork(1)
    bm.fork(a, b)
    bm.fork(e, f)
    first_token([a, b, e, f])
    assert bm.append_slot(a)
    assert a.block_table == [0, 4]
    bm.free(a)
    assert list(bm.free_blocks) == [4]
    assert bm.append_slot(e)
    assert e.block_table == [2, 4]
    assert bm.take_copies() == [(3, 4)]


# --- through the scheduler ------------------------------------------------------------------
def fake_token(seq: Sequence) -> int:
    """What a seeded model would sample: a function of the sample's own tokens and index."""
    h = seq.index * 7919
    for t in seq.token_ids:
        h = (h * 31 + t) % 1_000_003
    return 100 + h % 40_000


def run_step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(out)
    for s in out.scheduled:
        if not s.samples:  # (read before appending: it compares with len(s.seq))
            continue
        for seq in (s.seq, *s.forks):
            assert seq.num_computed_tokens == len(seq)
            seq.append_token(fake_token(seq))
    check_references(sched)
    return out


def check_references(sched: Scheduler) -> None:
    bm = sched.block_manager
    held = [b for s in sched.running for b in s.block_table]
    assert sum(bm.ref_counts) == len(held)
    for b in set(held):
        assert bm.ref_counts[b] == held.count(b)
    assert bm.num_used_blocks == len(set(held))


def request(prompt: list[int], n: int, request_id: str, arrival: int, block_size: int = BS) -> list[Sequence]:
    """A request's samples as ``Request`` builds them: the first queued, the others its fork_children."""
    seqs = [Sequence(prompt, block_size, request_id, i, arrival=arrival) for i in range(n)]
    seqs[0].fork_children = seqs[1:]
    return seqs


def finish_long_enough(sched: Scheduler, max_tokens: int) -> None:
    for s in list(sched.running):
        if s.num_output_tokens >= max_tokens:
            sched.finish(s, SequenceStatus.FINISHED_LENGTH)


def test_issue_example_40_token_prompt_n3_holds_5_blocks_while_decoding_in_block_3():
    # 40 tokens in 16-token blocks: 2 full blocks + 8 tokens of a third.
    # Shared: blocks 0, 1 (ref 3). The three samples write their tokens
    # 40..47 into the third block: two copy it, one keeps it -> 2 + 3 = 5
    # blocks, against 3 x 3 = 9 for three unshared sequences.
    bm = BlockManager(32, 16)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=256)
    prompt = list(range(1000, 1040))
    seqs = request(prompt, 3, "r", arrival=0, block_size=16)
    sched.add(seqs[0])
    out = run_step(sched)  # the prefill: once, for all three
    (s,) = out.scheduled
    assert s.seq is seqs[0] and s.forks == tuple(seqs[1:])
    assert (s.num_computed_tokens, s.num_new_tokens) == (0, 40)
    assert out.blocks_to_copy == []
    assert [q.block_table for q in seqs] == [[0, 1, 2]] * 3
    assert bm.ref_counts[:3] == [3, 3, 3]
    assert bm.num_used_blocks == 3
    assert all(q.num_output_tokens == 1 for q in seqs)

    out = run_step(sched)  # first decode: writes position 40 into the shared block 2
    assert sorted(out.blocks_to_copy) == [(2, 3), (2, 4)]
    assert sorted(q.block_table[2] for q in seqs) == [2, 3, 4]
    assert all(q.block_table[:2] == [0, 1] for q in seqs)
    assert bm.ref_counts[:5] == [3, 3, 1, 1, 1]
    assert bm.num_used_blocks == 5
    third = [q.block_table[2] for q in seqs]
    for _ in range(7):  # positions 41..47: still inside each one's third block
        out = run_step(sched)
        assert out.blocks_to_copy == []
        assert bm.num_used_blocks == 5
        assert [q.block_table[2] for q in seqs] == third
    assert all(len(q) == 49 and q.num_computed_tokens == 48 for q in seqs)
    out = run_step(sched)  # position 48 opens a fourth block for each
    assert out.blocks_to_copy == []
    assert bm.num_used_blocks == 8
    assert bm.num_cow_copies == 2
    # the samples diverged: their own tokens, not one shared stream
    assert len({tuple(q.output_token_ids) for q in seqs}) == 3
    for q in seqs:
        sched.finish(q, SequenceStatus.FINISHED_LENGTH)
    assert bm.num_free_blocks == 32 and bm.ref_counts == [0] * 32


def test_issue_example_without_sharing_takes_9_blocks():
    # the baseline of the test above, derived the same way: three requests
    # with the same prompt but no fork and no prefix cache
    bm = BlockManager(32, 16, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=256)
    prompt = list(range(1000, 1040))
    for i in range(3):
        sched.add(Sequence(prompt, 16, f"r{i}", 0, arrival=i))
    run_step(sched)
    run_step(sched)
    assert bm.num_used_blocks == 9


def run_to_completion(sched: Scheduler, reqs: list[list[Sequence]], max_tokens: int, max_steps: int = 500):
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        out = run_step(sched)
        outs.append(out)
        finish_long_enough(sched, max_tokens)
    assert not sched.has_unfinished()
    return {(q.request_id, q.index): q.output_token_ids for r in reqs for q in r}, outs


def two_requests(bs: int = BS):
    older = request(list(range(100, 107)), 1, "A", arrival=0, block_size=bs)
    newer = request(list(range(200, 206)), 3, "B", arrival=1, block_size=bs)
    return [older, newer]


def test_preemption_takes_all_samples_of_a_request_and_they_finish_with_the_same_tokens():
    max_tokens = 6
    # ample pool: the reference tokens
    bm = BlockManager(64, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    reqs = two_requests()
    for r in reqs:
        sched.add(r[0])
    expected, outs = run_to_completion(sched, reqs, max_tokens)
    assert not any(o.preempted for o in outs)
    assert len({tuple(expected[("B", i)]) for i in range(3)}) == 3

    # tight pool: A (2 blocks, 3 at the end) and B (2 shared + 3 private
    # blocks after the copies, 7 at the end) cannot run side by side in 8
    bm = BlockManager(8, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    reqs = two_requests()
    a, b = reqs[0][0], reqs[1]
    for r in reqs:
        sched.add(r[0])
    got, outs = run_to_completion(sched, reqs, max_tokens)
    preempting = [o for o in outs if o.preempted]
    assert preempting, "the tight pool should have forced a preemption"
    first = preempting[0]
    # the victim is the newer request, all three samples at once
    assert sorted(q.seq_id for q in first.preempted) == sorted(q.seq_id for q in b)
    assert all(d.seq is a for d in first.scheduled)
    assert sched.num_preemptions >= 3
    assert got == expected
    assert bm.num_free_blocks == 8 and bm.ref_counts == [0] * 8


def test_preempted_samples_give_their_blocks_back_at_once():
    max_tokens = 6
    bm = BlockManager(8, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    reqs = two_requests()
    a, b = reqs[0][0], reqs[1]
    for r in reqs:
        sched.add(r[0])
    for _ in range(20):
        out = run_step(sched)
        if out.preempted:
            break
        finish_long_enough(sched, max_tokens)
    else:
        pytest.fail("no preemption")
    for q in b:
        assert q.status == SequenceStatus.WAITING
        assert q.block_table == [] and q.num_computed_tokens == 0
        assert q.num_preemptions == 1
    # oldest first at the head of the queue
    assert list(sched.waiting)[:3] == sorted(b, key=lambda q: q.seq_id)
    assert sched.running == [a]
    assert bm.num_used_blocks == len(a.block_table)


def test_copy_of_a_request_preempted_in_the_same_step_never_reaches_the_runner():
    # pool of 5: A holds [0, 1], B's three samples share [2, 3] (block 3
    # partial), block 4 is free. In B's first decode its first sample copies
    # 3 -> 4, the second finds no block and B (the newest) is preempted whole:
    # the copy into the freed block 4 must be dropped.
    bm = BlockManager(5, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    reqs = two_requests()
    for r in reqs:
        sched.add(r[0])
    run_step(sched)
    assert bm.num_free_blocks == 1
    out = run_step(sched)
    assert sorted(q.seq_id for q in out.preempted) == sorted(q.seq_id for q in reqs[1])
    assert out.blocks_to_copy == []
    assert [d.seq for d in out.scheduled] == [reqs[0][0]]
    assert bm.take_copies() == []


def test_block_of_a_decode_preempted_in_the_same_step_is_not_served_from_the_prefix_cache():
    # A holds [0, 1]; B's 7-token prompt is in [2, 3]; block 4 is free. B's
    # first decode writes position 7, completing block 3: the first sample
    # copies 3 -> 4 and block 4 would be full after the step; the second
    # sample finds no block and B is preempted whole. Block 4's copy is
    # dropped and nothing is written into it, so it must not be a cache hit.
    bm = BlockManager(5, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a = request(list(range(100, 107)), 1, "A", arrival=0)
    b = request(list(range(200, 207)), 3, "B", arrival=1)
    sched.add(a[0])
    sched.add(b[0])
    out = sched.schedule()
    sched.update(out)
    for s in out.scheduled:
        for q in (s.seq, *s.forks):
            q.append_token(300)  # the same token for every sample (as under greedy)
    tokens = list(b[0].token_ids)  # 8 tokens: two full blocks once position 7 is written
    out = sched.schedule()
    assert len(out.preempted) == 3 and out.blocks_to_copy == []
    # a later prompt that starts with those 8 tokens may reuse block 2 (its
    # K/V was written by B's prefill) but not the never-written block 4
    later = Sequence(tokens + [999], BS)
    assert bm.num_cached_prefix_tokens(later) <= BS
