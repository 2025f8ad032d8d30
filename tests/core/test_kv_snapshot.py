"""The KV snapshot (``/kv/state``) against the block manager, with exact block ids (no torch).

Expected values are worked out by hand from the chapter (seed ch.04) and the
block manager's rules, not read back from the code: 600 tokens in 256-token
blocks take 3 blocks ([47, 12, 83] when those come first off the free list);
three samples of one prompt share its two blocks, then diverge into 5.
The bookkeeping is driven through the scheduler, the model runner simulated
by ``Scheduler.update`` and appended tokens.
"""

from __future__ import annotations

import json

import pytest

from pagedllm.block_table import slot_for
from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.kv_snapshot import build_kv_snapshot
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence, SequenceStatus


def pool_in_order(num_blocks: int, first: list[int], block_size: int) -> BlockManager:
    """A pool whose free list starts with ``first``: allocate and publish every block, free ``first`` first.

    Published blocks keep their hashes when freed and wait in least-recently-freed order.
    """
    bm = BlockManager(num_blocks, block_size)
    holders = []
    for b in range(num_blocks):
        s = Sequence([50_000 + b] * block_size, block_size)
        assert bm.allocate(s)
        bm.cache_full_blocks(s, block_size)
        holders.append(s)
    for b in [*first, *(b for b in range(num_blocks) if b not in first)]:
        bm.free(holders[b])
    assert list(bm.free_blocks)[: len(first)] == first
    return bm


def run_step(sched: Scheduler) -> None:
    """Plan and 'run' one step: the scheduled tokens are computed."""
    out = sched.schedule()
    sched.update(out)


def sample(seqs: list[Sequence], base: int) -> None:
    for i, s in enumerate(seqs):
        s.append_token(base + i)


def states_of(snap: dict, blocks: list[int]) -> str:
    return "".join(snap["block_states"][b] for b in blocks)


def test_600_tokens_in_256_token_blocks_take_three_blocks() -> None:
    bm = pool_in_order(8, [47 % 8, 12 % 8, 83 % 8], 256)  # ids 7, 4, 3 first
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=1024)
    seq = Sequence(list(range(600)), 256, request_id="r600")
    sched.add(seq)
    run_step(sched)
    snap = build_kv_snapshot(sched)
    assert snap["num_blocks"] == 8 and snap["block_size"] == 256
    [req] = snap["requests"]
    assert req["id"] == "r600" and req["status"] == "running"
    [s] = req["sequences"]
    assert s["block_table"] == [7, 4, 3]
    assert s["num_tokens"] == s["num_computed_tokens"] == 600
    # the other blocks still hold pool_in_order's published one-block prompts: cached, free to evict
    assert snap["block_states"] == "ccchhcch"
    assert snap["ref_counts"] == [0, 0, 0, 1, 1, 0, 0, 1]
    c = snap["counters"]
    assert (c["used_blocks"], c["cached_blocks"], c["free_blocks"]) == (3, 5, 0)
    # the chapter's waste: 3 * 256 slots held, 600 written, the last block's 168 empty
    assert c["held_slots"] == 768 and c["waste_slots"] == 168
    # token 257 -> logical block 1, offset 1 -> physical block 4 -> slot 4 * 256 + 1
    assert slot_for(s["block_table"], 256, 257) == 1025
    assert slot_for([47, 12, 83], 256, 257) == 3073  # the chapter's own numbers
    # finished: its two full blocks stay as cached prefix, the partial one is plain free
    sched.finish(seq, SequenceStatus.FINISHED_STOPPED)
    snap = build_kv_snapshot(sched)
    assert snap["requests"] == []
    assert states_of(snap, [7, 4, 3]) == "ccf"
    assert snap["counters"]["cached_blocks"] == 5 + 2 and snap["counters"]["used_blocks"] == 0
    assert snap["counters"]["waste_slots"] == 0


def three_samples(bm: BlockManager, prompt_len: int) -> tuple[Scheduler, list[Sequence]]:
    """One request of three samples (n=3): the first is queued, the others fork from it at prefill."""
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a = Sequence(list(range(prompt_len)), bm.block_size, request_id="n3", index=0)
    a.fork_children = [a.fork(1), a.fork(2)]
    seqs = [a, *a.fork_children]
    sched.add(a)
    return sched, seqs


def test_three_samples_share_two_blocks_then_diverge_into_five() -> None:
    bm = pool_in_order(16, [15, 12, 9, 3, 6], 4)
    sched, seqs = three_samples(bm, 8)
    run_step(sched)  # the shared prefill: 8 tokens fill blocks 15 and 12
    snap = build_kv_snapshot(sched)
    [req] = snap["requests"]
    assert req["id"] == "n3" and req["status"] == "running"
    assert [s["block_table"] for s in req["sequences"]] == [[15, 12]] * 3
    assert [s["index"] for s in req["sequences"]] == [0, 1, 2]
    assert states_of(snap, [15, 12]) == "ss"
    assert snap["ref_counts"][15] == snap["ref_counts"][12] == 3
    c = snap["counters"]
    assert (c["used_blocks"], c["shared_blocks"], c["waste_slots"]) == (2, 2, 0)
    # each samples a token; the next step writes it past the full blocks: a fresh block each
    sample(seqs, 900)
    run_step(sched)
    snap = build_kv_snapshot(sched)
    tables = [s["block_table"] for s in snap["requests"][0]["sequences"]]
    assert tables == [[15, 12, 9], [15, 12, 3], [15, 12, 6]]
    assert states_of(snap, [15, 12, 9, 3, 6]) == "sshhh"
    c = snap["counters"]
    assert c["used_blocks"] == 5  # three separate requests would hold 9
    assert c["cached_blocks"] == 11 and c["cow_copies"] == 0  # the rest: pool_in_order's cached prompts
    assert c["waste_slots"] == 3 * 3  # one token written in each new 4-slot block


def test_diverging_in_a_partial_block_copies_on_write() -> None:
    # a 6-token prompt leaves block 12 half full: the first two writers copy it, the third writes in place
    bm = pool_in_order(16, [15, 12, 9, 3], 4)
    sched, seqs = three_samples(bm, 6)
    run_step(sched)
    snap = build_kv_snapshot(sched)
    # the shared half-full block counts its 2 empty slots once, not once per sample
    assert snap["counters"]["waste_slots"] == 2
    sample(seqs, 900)
    run_step(sched)
    snap = build_kv_snapshot(sched)
    tables = [s["block_table"] for s in snap["requests"][0]["sequences"]]
    assert tables == [[15, 9], [15, 3], [15, 12]]
    assert states_of(snap, [15, 9, 3, 12]) == "shhh"
    c = snap["counters"]
    assert c["cow_copies"] == 2 and c["used_blocks"] == 4
    assert c["waste_slots"] == 3 * 1  # 3 of 4 slots written in each private block


def test_preempted_request_is_listed_with_no_blocks() -> None:
    # two one-block prompts fill the pool; their next tokens need a block each: the newer is preempted
    bm = BlockManager(2, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    old, new = Sequence([1, 2, 3, 4], 4, request_id="old"), Sequence([5, 6, 7, 8], 4, request_id="new")
    sched.add(old)
    sched.add(new)
    run_step(sched)
    assert [r["status"] for r in build_kv_snapshot(sched)["requests"]] == ["running", "running"]
    sample([old, new], 900)
    run_step(sched)
    snap = build_kv_snapshot(sched)
    assert [(r["id"], r["status"]) for r in snap["requests"]] == [("old", "running"), ("new", "preempted")]
    assert snap["requests"][0]["sequences"][0]["block_table"] == [0, 1]
    assert snap["requests"][1]["sequences"][0]["block_table"] == []
    assert snap["counters"]["preemptions"] == 1
    assert (snap["counters"]["num_running_seqs"], snap["counters"]["num_waiting_seqs"]) == (1, 1)


def test_prefix_cache_hit_rate_and_cached_blocks() -> None:
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    first = Sequence(list(range(9)), 4, request_id="a")
    sched.add(first)
    run_step(sched)
    assert build_kv_snapshot(sched)["counters"]["prefix_cache_hit_rate"] == 0.0
    sched.finish(first, SequenceStatus.FINISHED_STOPPED)
    assert build_kv_snapshot(sched)["block_states"][:3] == "ccf"
    again = Sequence(list(range(9)), 4, request_id="b")
    sched.add(again)
    run_step(sched)
    snap = build_kv_snapshot(sched)
    # 8 of 18 looked-up prompt tokens were found: the two full blocks came back from the cache
    assert snap["counters"]["prefix_cache_queries"] == 18 and snap["counters"]["prefix_cache_hits"] == 8
    assert snap["counters"]["prefix_cache_hit_rate"] == pytest.approx(8 / 18)
    assert snap["requests"][0]["sequences"][0]["block_table"][:2] == [0, 1]
    assert snap["requests"][0]["sequences"][0]["num_cached_tokens"] == 8


def test_snapshot_is_plain_json_and_a_copy() -> None:
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=16)
    seq = Sequence([1, 2, 3], 4)
    sched.add(seq)
    run_step(sched)
    snap = build_kv_snapshot(sched)
    assert json.loads(json.dumps(snap)) == snap
    seq.block_table.append(3)  # later bookkeeping must not show through an old snapshot
    assert snap["requests"][0]["sequences"][0]["block_table"] == [0]


def test_memory_counts_the_blocks_written_and_not_given_back() -> None:
    # 9 tokens in 4-slot blocks: blocks 0, 1 (full, cached when finished) and 2 (one token)
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=16)
    assert build_kv_snapshot(sched)["memory"] is None  # no runner's figures given
    seq = Sequence(list(range(9)), 4, request_id="m")
    sched.add(seq)
    run_step(sched)
    mem = build_kv_snapshot(sched, 1000, 9000)["memory"]
    assert mem == {"bytes_per_block": 1000, "reserved_bytes": 9000, "resident_blocks": 3, "resident_bytes": 3000}
    # finished: the partial block is free but still written until its pages are given back
    sched.finish(seq, SequenceStatus.FINISHED_STOPPED)
    assert build_kv_snapshot(sched, 1000, 9000)["memory"]["resident_blocks"] == 3
    assert bm.take_releasable() == [(2, 3)]
    snap = build_kv_snapshot(sched, 1000, 9000)
    # drained: only the cached prefix stays resident
    assert snap["memory"]["resident_blocks"] == snap["counters"]["cached_blocks"] == 2
    assert snap["memory"]["resident_bytes"] == 2000
