"""KV cache groups: the layout of layers into groups, and the block manager's per-group tables (no torch).

Exact block ids with tiny pools. The rule under test (engine/block_manager.py): a window group of W
tokens gives back, before a step computing from position c, every block whose keys all lie before
c - W + 1 (a query at i sees keys i - W < j <= i); a block goes back to the pool only when its last
holder lets go; the tables of one sequence are as long as each other.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedllm.engine.block_manager import HOLE, BlockManager
from pagedllm.engine.sequence import Sequence, SequenceStatus
from pagedllm.kv_groups import kv_cache_layout

BS = 4


def mk(tokens, block_size=BS):
    return Sequence(list(tokens), block_size=block_size)


def computed(bm, seq, num):
    """As after a step: ``num`` tokens hold K/V, the sampled token appended when it completes the sequence."""
    seq.num_computed_tokens = num


# --- layout -----------------------------------------------------------------------------------------
def gemma3_windows(num_layers, window=512, every=6):
    return [None if (i + 1) % every == 0 else window for i in range(num_layers)]


def test_layout_one_kind_is_one_group():
    layout = kv_cache_layout([None] * 5)
    assert layout.num_groups == 1 and layout.num_rows == 5
    assert layout.groups[0].layers == (0, 1, 2, 3, 4) and layout.windows == (None,)
    assert [layout.layer_slot(i) for i in range(5)] == [(0, i) for i in range(5)]
    assert layout.num_padded_rows == 0


def test_layout_gemma3_1b():
    # 26 layers, full at 5, 11, 17, 23: 4 rows; 22 window layers in 6 groups, the last 2 rows padded
    layout = kv_cache_layout(gemma3_windows(26))
    assert layout.num_rows == 4
    assert layout.windows == (None,) + (512,) * 6
    assert layout.groups[0].layers == (5, 11, 17, 23)
    assert layout.groups[1].layers == (0, 1, 2, 3)
    assert layout.groups[6].layers == (24, 25)
    assert layout.num_padded_rows == 2 and layout.padding_fraction == pytest.approx(2 / 28)
    assert layout.layer_slot(11) == (0, 1) and layout.layer_slot(25) == (6, 1) and layout.layer_slot(6) == (2, 1)  # group 2: 4 6 7 8


def test_layout_alternating_and_long_windows():
    layout = kv_cache_layout([128, None, 128, None])  # gpt-oss
    assert layout.windows == (None, 128) and layout.num_rows == 2 and layout.groups[1].layers == (0, 2)
    # a window as long as the context never drops a key: full attention, one group
    assert kv_cache_layout([4096, None], max_model_len=4096).windows == (None,)
    with pytest.raises(ValueError):
        kv_cache_layout([0, None])
    with pytest.raises(ValueError):
        kv_cache_layout([])


# --- per-group tables ---------------------------------------------------------------------------------
def test_per_group_tables_take_from_one_pool():
    bm = BlockManager(16, BS, group_windows=(None, 8))
    seq = mk(range(10))
    assert bm.allocate(seq)
    # group 0 pops first, then group 1, from the one free list
    assert seq.block_table == [0, 1, 2] and seq.group_tables == [[3, 4, 5]]
    assert bm.num_free_blocks == 10 and bm.num_used_blocks_per_group() == [3, 3]
    bm.free(seq)
    assert bm.num_free_blocks == 16 and seq.group_tables == []


def test_one_group_keeps_the_single_table_ids():
    plain, grouped = BlockManager(8, BS), BlockManager(8, BS, group_windows=(None,))
    for bm in (plain, grouped):
        a = mk(range(9))
        assert bm.allocate(a)
        computed(bm, a, 9)
        a.append_token(1)
        assert bm.append_slot(a) and a.block_table == [0, 1, 2] and a.group_tables == []


def test_window_frees_exactly_the_blocks_that_leave_it():
    bm = BlockManager(16, BS, group_windows=(None, 8))
    seq = mk(range(10))
    assert bm.allocate(seq)  # full [0, 1, 2], window [3, 4, 5]
    computed(bm, seq, 10)
    seq.append_token(0)
    assert bm.append_slot(seq)  # a query at 10 reads keys 3..10: block 3 (keys 0-3) is still read
    assert seq.group_tables == [[3, 4, 5]]
    computed(bm, seq, 11)
    seq.append_token(0)
    assert bm.append_slot(seq)  # at 11: keys 4..11, block 3 holds keys 0-3 only: given back
    assert seq.group_tables == [[HOLE, 4, 5]] and bm.num_window_released == 1
    computed(bm, seq, 12)
    seq.append_token(0)
    assert bm.append_slot(seq)  # a new logical block in each group; 3 went back to the lowest-first heap
    assert seq.block_table == [0, 1, 2, 3] and seq.group_tables == [[HOLE, 4, 5, 6]]
    for c in range(13, 16):
        computed(bm, seq, c)
        seq.append_token(0)
        assert bm.append_slot(seq)
    # at 15: keys 8..15: block 4 (keys 4-7) given back too
    assert seq.group_tables == [[HOLE, HOLE, 5, 6]]
    assert bm.num_free_blocks == 16 - 4 - 2
    bm.free(seq)
    assert bm.num_free_blocks == 16


def test_a_shared_block_is_not_freed_under_another_holder():
    bm = BlockManager(16, BS, group_windows=(None, 4))
    parent = mk(range(8))
    assert bm.allocate(parent)  # full [0, 1], window [2, 3]
    child = parent.fork(1)
    bm.fork(parent, child)
    computed(bm, parent, 8)
    computed(bm, child, 8)
    parent.append_token(5)
    assert bm.append_slot(parent)  # at 8: keys 5..8: block 2 (0-3) leaves the parent's window only
    assert parent.group_tables[0][:2] == [HOLE, 3]
    assert bm.ref_counts[2] == 1 and 2 not in bm.free_blocks and child.group_tables == [[2, 3]]
    child.append_token(6)
    assert bm.append_slot(child)  # block 2 leaves its last holder: free, and the lowest for the new full block
    assert child.block_table == [0, 1, 2] and child.group_tables == [[HOLE, 3, 6]]
    assert parent.block_table == [0, 1, 4] and parent.group_tables == [[HOLE, 3, 5]]
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 16 and bm.ref_counts == [0] * 16


def test_prefix_hit_needs_only_the_window_blocks():
    bm = BlockManager(32, BS, group_windows=(None, 8))
    a = mk(range(17))
    assert bm.allocate(a)  # full [0..4], window [5..9]
    bm.cache_full_blocks(a, 17)
    computed(bm, a, 17)
    a.append_token(99)
    assert bm.append_slot(a)  # at 17: keys 10..: window blocks 5 (0-3) and 6 (4-7) given back, still cached
    assert a.group_tables[0][:3] == [HOLE, HOLE, 7]
    b = mk(list(range(16)) + [50, 51])
    assert bm.allocate(b)
    # 4 full blocks hit; a query at 16 reads keys 9..: the window group needs blocks 2 and 3 only
    assert b.num_cached_tokens == 16
    assert b.block_table[:4] == [0, 1, 2, 3] and b.group_tables[0][:4] == [HOLE, HOLE, 7, 8]
    assert bm.ref_counts[5] == 0 and 5 in bm.free_blocks  # not taken back by the hit
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 32


def test_prefix_hit_shortened_when_a_window_block_is_gone():
    bm = BlockManager(32, BS, group_windows=(None, 8))
    a = mk(range(17))
    assert bm.allocate(a)  # window [5..9]
    bm.cache_full_blocks(a, 17)
    bm._uncache(8)  # the window group's block 3 (tokens 12-15) lost its hash (as an eviction does)
    b = mk(list(range(16)) + [50])
    assert bm.allocate(b)
    # a hit at 4 blocks reads window blocks 2-3 (3 is gone), at 3 blocks blocks 1-2: both cached
    assert b.num_cached_tokens == 12 and b.group_tables[0][:3] == [HOLE, 6, 7]


def test_rollback_across_groups_and_below_the_window_refused():
    bm = BlockManager(16, BS, group_windows=(None, 4))
    seq = mk(range(7))
    assert bm.allocate(seq)  # full [0, 1], window [2, 3]
    computed(bm, seq, 7)
    seq.add_draft_tokens([1, 2, 3])  # 10 tokens: a verify step from 7
    assert bm.append_slot(seq)  # at 7: keys 4..: window block 2 given back
    assert seq.block_table == [0, 1, 2] and seq.group_tables == [[HOLE, 3, 4]]
    computed(bm, seq, 10)
    seq.discard_draft_tokens()
    seq.append_token(1)  # one draft rejected in effect: 8 tokens, 7 computed
    assert bm.rollback(seq, 7) == [2, 4]  # each group's blocks past ceil(7 / 4)
    assert seq.block_table == [0, 1] and seq.group_tables == [[HOLE, 3]]
    with pytest.raises(ValueError):
        bm.rollback(seq, 3)  # a query at 3 would read keys 0-3: block given back
    bm.free(seq)
    assert bm.num_free_blocks == 16


def test_short_pool_takes_nothing_and_counts_every_group():
    bm = BlockManager(5, BS, group_windows=(None, 8))
    seq = mk(range(10))  # 3 blocks per group: 6 > 5
    assert not bm.can_allocate(seq) and not bm.allocate(seq)
    assert bm.num_free_blocks == 5 and seq.block_table == [] and seq.group_tables == []
    assert bm.allocate(seq, max_num_new_tokens=8)  # a first chunk of 8 tokens: 2 per group
    assert seq.block_table == [0, 1] and seq.group_tables == [[2, 3]]
    assert bm.num_appendable_tokens(seq) == 8  # 1 free block: no logical block fits in both groups
    assert not bm.append_slot(seq, 9) and bm.num_free_blocks == 1


def test_bad_group_windows():
    with pytest.raises(ValueError):
        BlockManager(4, BS, group_windows=())
    with pytest.raises(ValueError):
        BlockManager(4, BS, group_windows=(None, 0))


# --- the property: any add / step / draft-rollback / fork / preempt / finish keeps every pool whole ---
class GroupsMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(2, 14), block_size=st.integers(1, 3),
                windows=st.lists(st.one_of(st.none(), st.integers(1, 6)), min_size=1, max_size=3),
                caching=st.booleans())
    def setup(self, num_blocks, block_size, windows, caching):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching, group_windows=windows)
        self.bs = block_size
        self.live: list[Sequence] = []
        self.waiting: list[Sequence] = []

    def _admit(self, seq, chunk):
        can = self.bm.can_allocate(seq, chunk)
        free_before = self.bm.num_free_blocks
        ok = self.bm.allocate(seq, chunk)
        assert ok == can
        if ok:
            self.bm.cache_full_blocks(seq, min(len(seq), seq.num_computed_tokens + chunk))
            self.live.append(seq)
        else:
            assert self.bm.num_free_blocks == free_before and not seq.block_table
            self.waiting.append(seq)

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=14), chunk=st.integers(1, 6))
    def add(self, tokens, chunk):
        self._admit(Sequence(tokens, self.bs), chunk)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 6))
    def readmit(self, data, chunk):
        seq = data.draw(st.sampled_from(self.waiting))
        self.waiting.remove(seq)
        self._admit(seq, chunk)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 6), token=st.integers(0, 1))
    def step(self, data, chunk, token):
        """The next chunk of a prompt, or a decode; the step runs, then a token is sampled."""
        seq = data.draw(st.sampled_from(self.live))
        end = min(len(seq), seq.num_computed_tokens + chunk) if seq.num_computed_tokens < len(seq) else len(seq)
        if seq.num_computed_tokens >= len(seq):
            seq.append_token(token)
            end = len(seq)
        num_new = end - seq.num_computed_tokens
        if not self.bm.append_slot(seq, num_new):
            return
        self.bm.take_copies()
        self.bm.cache_full_blocks(seq, end)
        seq.num_computed_tokens = end

    @precondition(lambda self: self.live)
    @rule(data=st.data(), num_drafts=st.integers(1, 4), num_accepted=st.integers(0, 4))
    def verify_drafts(self, data, num_drafts, num_accepted):
        seq = data.draw(st.sampled_from(self.live))
        if seq.num_computed_tokens != len(seq) - 1:
            return  # only a sequence waiting for a decode drafts
        seq.add_draft_tokens([1] * num_drafts)
        if not self.bm.append_slot(seq):
            seq.discard_draft_tokens()
            return
        seq.num_computed_tokens = len(seq)
        seq.discard_draft_tokens()
        accepted = min(num_accepted, num_drafts)
        for _ in range(accepted + 1):
            seq.append_token(1)
        self.bm.rollback(seq, len(seq) - 1)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = parent.fork(1)
        self.bm.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), finish=st.booleans())
    def preempt_or_finish(self, data, finish):
        seq = data.draw(st.sampled_from(self.live))
        self.bm.free(seq)
        self.live.remove(seq)
        if not finish:
            seq.reset_for_recompute()
            self.waiting.append(seq)

    @invariant()
    def pool_whole(self):
        bm = self.bm
        held = Counter()
        for s in self.live:
            tables = [s.block_table, *s.group_tables]
            assert len(tables) == bm.num_groups
            assert len({len(t) for t in tables}) == 1, "the groups' tables differ in length"
            for g, t in enumerate(tables):
                holes = sum(1 for b in t if b == HOLE)
                assert all(b == HOLE for b in t[:holes]), "holes are not a prefix"
                window = bm.group_windows[g]
                # a hole never stands where a query still to be computed reads
                first_read = 0 if window is None else max(0, s.num_computed_tokens - window + 1) // self.bs
                assert holes <= first_read
                for b in t[holes:]:
                    held[b] += 1
                    assert bm.block_group[b] == g
        free = bm.free_blocks
        assert len(free) == len(set(free))
        for b in range(bm.num_blocks):
            assert bm.ref_counts[b] == held[b], f"block {b}"
            assert (b in set(free)) == (held[b] == 0)

    def teardown(self):
        if hasattr(self, "bm"):
            for s in self.live:
                self.bm.free(s)
            assert self.bm.num_free_blocks == self.bm.num_blocks, "a block leaked"


GroupsMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_groups_pool_stays_whole = GroupsMachine.TestCase


def test_disk_prefix_cache_across_groups(tmp_path):
    """Every group's published blocks are saved under their own keys; after a restart a hit loads each full
    group's blocks and a window group's inside the window only."""
    from pagedllm.kv_disk.store import DiskBlockStore

    payload = 8
    store = DiskBlockStore(tmp_path, {"model": "groups-test"}, payload)
    bm = BlockManager(16, BS, group_windows=(None, 8), disk=store)
    a = mk(range(17))
    assert bm.allocate(a)  # full [0..4], window [5..9]
    bm.cache_full_blocks(a, 17)
    bm.confirm_published()
    saves = bm.take_saves()
    assert sorted(block for block, _, _ in saves) == [0, 1, 2, 3, 5, 6, 7, 8]
    for block, key, tokens in saves:
        store.write(key, tokens, bytes([block]) * payload)  # the runner copies the block's bytes out
    store.flush()
    fresh = BlockManager(16, BS, group_windows=(None, 8), disk=store)  # a restart: RAM holds nothing
    b = mk(list(range(16)) + [50])
    assert fresh.num_cached_prefix_tokens(b) == 16
    assert fresh.allocate(b)
    # a query at 16 reads keys 9..: the window group loads logical blocks 2 and 3 only
    assert b.num_cached_tokens == 16
    # group by group: the loaded blocks, then the new one
    assert b.block_table == [0, 1, 2, 3, 4] and b.group_tables == [[HOLE, HOLE, 5, 6, 7]]
    loads = dict(fresh.take_loads())
    # each fresh block gets the bytes of the block that held the same logical block of the same group
    assert loads == {0: bytes([0]) * payload, 1: bytes([1]) * payload, 2: bytes([2]) * payload,
                     3: bytes([3]) * payload, 5: bytes([7]) * payload, 6: bytes([8]) * payload}
    store.close()


def test_bench_window_blocks_gemma3_figures():
    """``bench memory --window-blocks``: at its last step a 32k Gemma 3 1B sequence holds the full group's 2048
    blocks and, in each of 6 window groups, the blocks from the one holding key 32767 - 512 + 1 on."""
    from pagedllm.bench.window_blocks import window_block_rows

    rows = {(r["model"], r["context_len"]): r for r in window_block_rows(context_lens=(32768,))}
    r = rows[("gemma-3-1b", 32768)]
    assert r["blocks_before"] == 32768 // 16
    assert r["blocks_after_last"] == 2048 + 6 * (2048 - (32767 - 512 + 1) // 16)
    # the peak: the prompt's (32512 tokens) last chunk, 30720..32511: 2032 blocks in the full group, and in
    # each window group those from the one holding key 30720 - 512 + 1 on
    assert r["blocks_after_peak"] == 2032 + 6 * (2032 - (30720 - 512 + 1) // 16)
    assert r["mib_before"] == 2048 * 26 * 16 * 256 * 2 * 2 / 2**20


def test_scheduler_steps_and_kv_snapshot_show_the_groups():
    """Through the scheduler: a decode's step gives back the window block, and /kv's snapshot shows each group."""
    from pagedllm.engine.kv_snapshot import build_kv_snapshot
    from pagedllm.engine.scheduler import Scheduler

    bm = BlockManager(16, BS, group_windows=(None, 8))
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    seq = Sequence(list(range(10)), BS, request_id="r")
    sched.add(seq)
    for token in (100, 101):
        sched.update(sched.schedule())  # the prefill, then a decode at 10
        seq.append_token(token)
    assert seq.group_tables == [[3, 4, 5]]  # a query at 10 still reads keys 3..
    sched.update(sched.schedule())  # the decode at 11: keys 4.. only
    assert seq.block_table == [0, 1, 2] and seq.group_tables == [[HOLE, 4, 5]]
    snap = build_kv_snapshot(sched)
    # block 3 (keys 0..3, a full prompt block, published) stays cached for a prefix hit: group 1's still
    assert [(g["kind"], g["window"], g["used_blocks"], g["cached_blocks"], g["hole_entries"], g["released_blocks"])
            for g in snap["kv_groups"]] == [("full", None, 3, 0, 0, 0), ("window", 8, 2, 1, 1, 1)]
    assert snap["block_groups"] == [0, 0, 0, 1, 1, 1] + [-1] * 10
    assert snap["counters"]["window_released_blocks"] == 1 and snap["counters"]["used_blocks"] == 5
    assert snap["requests"][0]["sequences"][0]["group_tables"] == [[HOLE, 4, 5]]
    sched.finish(seq, SequenceStatus.FINISHED_STOPPED)
    assert bm.num_free_blocks == 16
