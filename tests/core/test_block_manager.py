"""BlockManager: exact block ids with tiny pools.

Conventions under test (from the design and the module docstring):
  * the free list is least-recently-freed first: a fresh pool hands out
    0, 1, 2, ...; a block whose ref count drops to 0 goes to the tail; a
    freed sequence's blocks are pushed last block first;
  * allocate()/append_slot() return False and take nothing when short;
  * prefix caching shares *full* blocks by chained hash, never the block of
    a prompt's last token, and a cached block with ref count 0 is still free
    until it is popped (evicted).
"""

from __future__ import annotations

import pytest

from pagedllm.engine.block_manager import BlockManager, hash_block
from pagedllm.engine.sequence import Sequence

BS = 4


def mk(tokens, block_size=BS):
    return Sequence(list(tokens), block_size=block_size)


def free_list(bm):
    return list(bm.free_blocks)


def snapshot(bm):
    return (
        free_list(bm),
        list(bm.ref_counts),
        dict(bm.hash_to_block),
        list(bm.block_hash),
        list(bm.block_token_ids),
    )


# --- construction -------------------------------------------------------------
def test_fresh_pool():
    bm = BlockManager(num_blocks=8, block_size=BS)
    assert free_list(bm) == list(range(8))
    assert bm.num_free_blocks == 8
    assert bm.num_used_blocks == 0
    assert bm.usage == 0.0
    assert bm.ref_counts == [0] * 8
    assert bm.hash_to_block == {}


# num_blocks is computed by the runner, so the manager checks it; block_size is EngineConfig's, checked
# there once (tests/e2e/test_cli_flags.py, tests/core/test_config_record.py)
@pytest.mark.parametrize("num_blocks", [0, -1])
def test_bad_construction(num_blocks):
    with pytest.raises(ValueError):
        BlockManager(num_blocks=num_blocks, block_size=4)


# --- free list order ------------------------------------------------------------
@pytest.mark.parametrize("caching", [True, False])
def test_fresh_pool_hands_out_in_order(caching):
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=caching)
    a = mk(range(10))  # 3 blocks
    b = mk(range(100, 105))  # 2 blocks
    assert bm.allocate(a)
    assert a.block_table == [0, 1, 2]
    assert bm.allocate(b)
    assert b.block_table == [3, 4]
    assert free_list(bm) == [5, 6, 7]
    assert bm.ref_counts == [1, 1, 1, 1, 1, 0, 0, 0]
    assert bm.num_used_blocks == 5
    assert bm.usage == 5 / 8
    assert a.num_computed_tokens == 0 and a.num_cached_tokens == 0


@pytest.mark.parametrize("caching", [True, False])
def test_freed_empty_blocks_come_back_lowest_id_first(caching):
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=caching)
    a = mk(range(10))  # [0, 1, 2], never published: they hold nothing once freed
    b = mk(range(100, 105))  # [3, 4]
    bm.allocate(a)
    bm.allocate(b)
    bm.free(a)
    assert a.block_table == []
    assert free_list(bm) == [0, 1, 2, 5, 6, 7]
    # the next allocation takes the lowest ids: the blocks in use stay packed at the pool's start
    c = mk(range(200, 216))  # 4 blocks
    assert bm.allocate(c)
    assert c.block_table == [0, 1, 2, 5]
    assert free_list(bm) == [6, 7]
    bm.free(b)
    assert free_list(bm) == [3, 4, 6, 7]


# --- allocate when short ------------------------------------------------------------
@pytest.mark.parametrize("caching", [True, False])
def test_allocate_short_takes_nothing(caching):
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=caching)
    a = mk(range(20))  # 5 blocks
    assert bm.allocate(a)
    before = snapshot(bm)
    big = mk(range(100, 113))  # 4 blocks, 3 free
    assert bm.can_allocate(big) is False
    assert bm.allocate(big) is False
    assert snapshot(bm) == before
    assert big.block_table == []
    assert big.num_computed_tokens == 0
    # exactly what is left still fits, and exhausts the pool
    fits = mk(range(200, 212))  # 3 blocks
    assert bm.can_allocate(fits) is True
    assert bm.allocate(fits)
    assert fits.block_table == [5, 6, 7]
    assert bm.num_free_blocks == 0
    one = mk([999])
    assert bm.can_allocate(one) is False
    assert bm.allocate(one) is False
    assert one.block_table == []
    assert bm.num_free_blocks == 0


def test_allocate_larger_than_pool_fails_on_empty_pool():
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq = mk(range(9))  # 3 blocks > 2
    assert bm.allocate(seq) is False
    assert free_list(bm) == [0, 1]
    assert bm.ref_counts == [0, 0]


def test_allocate_twice_raises():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = mk(range(5))
    bm.allocate(seq)
    with pytest.raises(ValueError):
        bm.allocate(seq)


def test_allocate_empty_sequence_takes_no_block():
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq = mk([])
    assert bm.allocate(seq)
    assert seq.block_table == []
    assert bm.num_free_blocks == 2


# --- append_slot ---------------------------------------------------------------------
def test_append_slot_only_at_block_boundary():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    seq = mk([1, 2, 3, 4])  # exactly one full block
    assert bm.allocate(seq)
    assert seq.block_table == [0]
    # nothing new to hold: no block taken
    assert bm.append_slot(seq) is True
    assert seq.block_table == [0]
    # token 4 starts logical block 1
    seq.append_token(5)
    assert bm.append_slot(seq) is True
    assert seq.block_table == [0, 1]
    # tokens 5, 6, 7 fill block 1: no new block
    for t in (6, 7, 8):
        seq.append_token(t)
        assert bm.append_slot(seq) is True
        assert seq.block_table == [0, 1]
    assert bm.num_free_blocks == 6
    # token 8 starts logical block 2
    seq.append_token(9)
    assert bm.append_slot(seq) is True
    assert seq.block_table == [0, 1, 2]
    assert bm.ref_counts[:3] == [1, 1, 1]
    assert bm.num_free_blocks == 5


def test_append_slot_block_size_one_takes_a_block_per_token():
    bm = BlockManager(num_blocks=4, block_size=1)
    seq = Sequence([7], block_size=1)
    bm.allocate(seq)
    assert seq.block_table == [0]
    for expect in ([0, 1], [0, 1, 2], [0, 1, 2, 3]):
        seq.append_token(7)
        assert bm.append_slot(seq)
        assert seq.block_table == expect
    seq.append_token(7)
    assert bm.append_slot(seq) is False
    assert seq.block_table == [0, 1, 2, 3]


@pytest.mark.parametrize("caching", [True, False])
def test_append_slot_fails_on_empty_pool_and_takes_nothing(caching):
    bm = BlockManager(num_blocks=3, block_size=BS, enable_prefix_caching=caching)
    a = mk(range(8))  # [0, 1], both full
    b = mk(range(100, 103))  # [2], one slot left in it
    assert bm.allocate(a) and bm.allocate(b)
    assert bm.num_free_blocks == 0
    a.append_token(8)
    assert bm.can_append_slot(a) is False
    before = snapshot(bm)
    assert bm.append_slot(a) is False
    assert snapshot(bm) == before
    assert a.block_table == [0, 1]
    # a token that still fits in its last block needs no free block
    b.append_token(103)
    assert bm.can_append_slot(b) is True
    assert bm.append_slot(b) is True
    assert b.block_table == [2]
    # once b goes, a gets its block
    bm.free(b)
    assert free_list(bm) == [2]
    assert bm.can_append_slot(a) is True
    assert bm.append_slot(a) is True
    assert a.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 0


# --- free and ref counts -------------------------------------------------------------
@pytest.mark.parametrize("caching", [True, False])
def test_free_returns_everything(caching):
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=caching)
    seqs = [mk(range(0, 6)), mk(range(0, 6)), mk(range(50, 59))]
    for s in seqs:
        assert bm.allocate(s)
        bm.cache_full_blocks(s, len(s))
    for _ in range(5):
        seqs[0].append_token(1)
        assert bm.append_slot(seqs[0])
    for s in seqs:
        bm.free(s)
        assert s.block_table == []
        assert s.num_computed_tokens == 0
    assert bm.num_free_blocks == 8
    assert sorted(free_list(bm)) == list(range(8))
    assert bm.ref_counts == [0] * 8


def test_free_of_shared_block_keeps_it_until_last_reference():
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(9))  # blocks 0-3, 4-7 are full; token 8 is the last
    a = mk(prompt)
    assert bm.allocate(a)
    assert a.block_table == [0, 1, 2]
    bm.cache_full_blocks(a, len(a))
    b = mk(prompt)
    assert bm.allocate(b)
    assert b.block_table == [0, 1, 3]
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    bm.free(a)
    # only a's private block 2 is free; 0 and 1 are still held by b
    assert bm.ref_counts[:4] == [1, 1, 0, 1]
    assert free_list(bm) == [2, 4, 5, 6, 7]
    bm.free(b)
    assert bm.ref_counts == [0] * 8
    # empty blocks lowest first, then the cached ones least recently freed first (b's table backwards)
    assert free_list(bm) == [2, 3, 4, 5, 6, 7, 1, 0]


def test_copy_on_write_example_three_requests_share_prompt():
    # seed ch.04 section 6: three requests with the same prompt share its
    # blocks (ref count 3); each one's own token lands in a private block.
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(8))
    reqs = []
    for i in range(3):
        s = mk(prompt + [100 + i])  # different last token per request
        assert bm.allocate(s)
        bm.cache_full_blocks(s, len(s))
        reqs.append(s)
    assert [r.block_table for r in reqs] == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    assert bm.ref_counts[0] == bm.ref_counts[1] == 3
    assert bm.ref_counts[2] == bm.ref_counts[3] == bm.ref_counts[4] == 1
    assert bm.num_used_blocks == 5  # not 9
    assert [r.num_cached_tokens for r in reqs] == [0, 8, 8]


# --- prefix caching --------------------------------------------------------------------
def test_cache_full_blocks_publishes_only_full_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = mk(range(10))  # [0..3] [4..7] [8, 9]
    bm.allocate(a)
    bm.cache_full_blocks(a, 5)  # only block 0 is full among the first 5 tokens
    assert set(bm.hash_to_block.values()) == {0}
    bm.cache_full_blocks(a, 10)
    assert set(bm.hash_to_block.values()) == {0, 1}
    assert bm.block_hash[2] is None
    assert bm.block_token_ids[0] == (0, 1, 2, 3)
    assert bm.block_token_ids[1] == (4, 5, 6, 7)
    # chained: block 1's hash depends on block 0's
    h0 = hash_block(0, [0, 1, 2, 3])
    assert bm.block_hash[0] == h0
    assert bm.block_hash[1] == hash_block(h0, [4, 5, 6, 7])
    assert bm.block_hash[1] != hash_block(0, [4, 5, 6, 7])
    # num_tokens larger than the sequence is clamped
    bm.cache_full_blocks(a, 100)
    assert len(bm.hash_to_block) == 2


def test_second_sequence_hits_first_ones_full_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = mk(range(10))
    assert bm.allocate(a)
    bm.cache_full_blocks(a, len(a))
    b = mk(list(range(8)) + [100, 101])  # same 2-block prefix, own tail
    assert bm.allocate(b)
    assert b.block_table == [0, 1, 3]
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    assert b.num_cached_tokens == 2 * BS
    assert b.num_computed_tokens == 2 * BS
    assert bm.num_free_blocks == 8 - 4


def test_partial_prefix_hit():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = mk(range(12))
    bm.allocate(a)
    bm.cache_full_blocks(a, len(a))
    # first block equal, second differs in its last token
    b = mk([0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11, 12])
    assert bm.allocate(b)
    assert b.num_cached_tokens == BS
    assert b.block_table[0] == 0
    assert b.block_table[1:] == [3, 4, 5]
    assert bm.ref_counts[0] == 2 and bm.ref_counts[1] == 1


def test_unpublished_blocks_do_not_hit():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = mk(range(10))
    bm.allocate(a)  # no cache_full_blocks: nothing was written yet
    b = mk(range(10))
    assert bm.allocate(b)
    assert b.num_cached_tokens == 0
    assert b.block_table == [3, 4, 5]


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = mk(range(8))  # exactly 2 full blocks
    bm.allocate(a)
    bm.cache_full_blocks(a, len(a))
    assert len(bm.hash_to_block) == 2
    b = mk(range(8))
    assert bm.allocate(b)
    # block 1 holds the last token, whose logits are needed: only 1 hit
    assert b.num_cached_tokens == BS
    assert b.num_computed_tokens == BS
    assert b.block_table == [0, 2]
    assert bm.ref_counts[:3] == [2, 1, 1]
    # one more token and both full blocks may hit
    c = mk(list(range(8)) + [42])
    assert bm.allocate(c)
    assert c.num_cached_tokens == 2 * BS
    assert c.block_table == [0, 1, 3]
    # a one-block prompt never hits at all
    d = mk(range(4))
    assert bm.allocate(d)
    assert d.num_cached_tokens == 0
    assert d.block_table == [4]


def test_chained_hash_same_block_after_different_prefix_does_not_hit():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = mk([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(a)
    bm.cache_full_blocks(a, len(a))
    # block 1 has the same content as a's block 1 but a different block 0
    b = mk([9, 9, 9, 9, 5, 6, 7, 8, 0])
    assert bm.allocate(b)
    assert b.num_cached_tokens == 0
    assert b.block_table == [3, 4, 5]
    # a's block 1 content as the *first* block: the parent differs too
    c = mk([5, 6, 7, 8, 0])
    assert bm.allocate(c)
    assert c.num_cached_tokens == 0
    assert bm.ref_counts[1] == 1


def test_hit_stops_at_first_miss():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = mk(range(13))
    bm.allocate(a)
    bm.cache_full_blocks(a, len(a))  # blocks 0, 1, 2 published
    # drop block 1 from the cache: block 2 must not hit either, though its
    # own hash is still cached (the prefix up to it is not)
    bm._uncache(1)
    b = mk(range(13))
    assert bm.allocate(b)
    assert b.num_cached_tokens == BS
    assert b.block_table[0] == 0
    assert 1 not in b.block_table and 2 not in b.block_table


def test_hash_collision_is_caught_by_token_check():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = mk([1, 2, 3, 4, 5])
    bm.allocate(a)
    bm.cache_full_blocks(a, len(a))
    assert bm.hash_to_block  # block 0 published
    # simulate a collision: b's first-block hash points at a's block 0
    b_tokens = [7, 7, 7, 7, 8]
    bm.hash_to_block[hash_block(0, b_tokens[:4])] = a.block_table[0]
    b = mk(b_tokens)
    assert bm.can_allocate(b)
    assert bm.allocate(b)
    assert b.num_cached_tokens == 0
    assert a.block_table[0] not in b.block_table
    assert bm.ref_counts[a.block_table[0]] == 1


def test_tampered_block_tokens_are_not_served():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = mk([1, 2, 3, 4, 5])
    bm.allocate(a)
    bm.cache_full_blocks(a, len(a))
    # the block's stored tokens no longer match the hash's content
    bm.block_token_ids[a.block_table[0]] = (1, 2, 3, 5)
    b = mk([1, 2, 3, 4, 6])
    assert bm.allocate(b)
    assert b.num_cached_tokens == 0
    assert a.block_table[0] not in b.block_table


def test_free_cached_blocks_keep_hash_and_count_as_free():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = mk(range(9))  # [0, 1, 2]; 0 and 1 full
    bm.allocate(a)
    bm.cache_full_blocks(a, len(a))
    hashes = dict(bm.hash_to_block)
    bm.free(a)
    assert bm.num_free_blocks == 8
    assert free_list(bm) == [2, 3, 4, 5, 6, 7, 1, 0]
    assert bm.hash_to_block == hashes
    assert bm.block_hash[0] is not None and bm.block_hash[1] is not None
    # a later prompt with the prefix takes them back out of the free list
    b = mk(list(range(8)) + [50])
    assert bm.can_allocate(b)
    assert bm.allocate(b)
    assert b.block_table == [0, 1, 2]  # two hits, then the lowest empty block
    assert b.num_cached_tokens == 8
    assert bm.ref_counts[:4] == [1, 1, 1, 0]
    assert free_list(bm) == [3, 4, 5, 6, 7]
    assert bm.num_free_blocks == 5


def _two_cached_prompts(bm):
    """P holds [0, 1] (block 0 cached), Q holds [2, 3] (block 2 cached)."""
    p = mk([0, 1, 2, 3, 99])
    q = mk([10, 11, 12, 13, 98])
    assert bm.allocate(p) and bm.allocate(q)
    bm.cache_full_blocks(p, len(p))
    bm.cache_full_blocks(q, len(q))
    assert p.block_table == [0, 1] and q.block_table == [2, 3]
    return p, q


def test_eviction_is_least_recently_freed_first():
    bm = BlockManager(num_blocks=4, block_size=BS)
    p, q = _two_cached_prompts(bm)
    hp = bm.block_hash[0]
    hq = bm.block_hash[2]
    bm.free(p)
    bm.free(q)
    assert free_list(bm) == [1, 3, 0, 2]
    # a 3-block newcomer takes the empty 1 and 3, then evicts P's cached block 0 (freed first)
    r = mk(range(50, 62))
    assert bm.allocate(r)
    assert r.block_table == [1, 3, 0]
    assert r.num_cached_tokens == 0
    assert hp not in bm.hash_to_block
    assert bm.block_hash[0] is None and bm.block_token_ids[0] is None
    # Q's block (freed later) is still cached and hits
    assert bm.hash_to_block[hq] == 2
    bm.free(r)
    q2 = mk([10, 11, 12, 13, 97])
    assert bm.allocate(q2)
    assert q2.num_cached_tokens == BS
    assert q2.block_table == [2, 0]


def test_eviction_order_follows_free_order():
    bm = BlockManager(num_blocks=4, block_size=BS)
    p, q = _two_cached_prompts(bm)
    hp = bm.block_hash[0]
    hq = bm.block_hash[2]
    bm.free(q)  # Q first this time
    bm.free(p)
    assert free_list(bm) == [1, 3, 2, 0]
    r = mk(range(50, 62))
    assert bm.allocate(r)
    assert r.block_table == [1, 3, 2]
    assert hq not in bm.hash_to_block
    assert bm.hash_to_block[hp] == 0
    bm.free(r)
    p2 = mk([0, 1, 2, 3, 96])
    assert bm.allocate(p2)
    assert p2.num_cached_tokens == BS
    assert p2.block_table == [0, 1]


def test_freed_sequence_evicts_its_last_blocks_first():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = mk(range(13))  # [0, 1, 2, 3], blocks 0-2 full
    bm.allocate(a)
    bm.cache_full_blocks(a, len(a))
    bm.free(a)
    assert free_list(bm) == [3, 2, 1, 0]
    # one block needed: the uncached block 3 goes; then block 2 (a's deepest)
    r = mk([77, 78])
    bm.allocate(r)
    assert r.block_table == [3]
    s = mk([79, 80])
    bm.allocate(s)
    assert s.block_table == [2]
    # a's first two blocks survive: a re-run of a hits them
    a2 = mk(range(13))
    assert bm.can_allocate(a2) is False  # needs 4 blocks: 2 hits + 2 new, 2 free
    bm.free(r)
    bm.free(s)
    assert bm.allocate(a2)
    assert a2.num_cached_tokens == 2 * BS
    assert a2.block_table[:2] == [0, 1]


def test_reusing_a_cached_block_refreshes_its_lru_position():
    bm = BlockManager(num_blocks=4, block_size=BS)
    p, q = _two_cached_prompts(bm)
    hp = bm.block_hash[0]
    bm.free(p)
    bm.free(q)
    assert free_list(bm) == [1, 3, 0, 2]
    # touch P's cached block: it leaves the free list and comes back at the tail
    p2 = mk([0, 1, 2, 3, 95])
    assert bm.allocate(p2)
    assert p2.block_table == [0, 1]  # hit 0, then the lowest empty block: 1
    bm.free(p2)
    assert free_list(bm) == [1, 3, 2, 0]
    # a 3-block newcomer evicts Q's block 2, not P's refreshed 0
    r = mk(range(50, 62))
    assert bm.allocate(r)
    assert r.block_table == [1, 3, 2]
    assert bm.hash_to_block[hp] == 0


def test_same_content_twice_is_cached_once():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = mk(range(5))
    b = mk(range(5))
    # both allocated before either is published: separate blocks
    bm.allocate(a)
    bm.allocate(b)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    bm.cache_full_blocks(a, len(a))
    bm.cache_full_blocks(b, len(b))
    assert len(bm.hash_to_block) == 1
    assert list(bm.hash_to_block.values()) == [0]
    assert bm.block_hash[2] is None


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = mk(range(9))
    bm.allocate(a)
    bm.cache_full_blocks(a, len(a))
    assert bm.hash_to_block == {}
    assert all(h is None for h in bm.block_hash)
    b = mk(range(9))
    assert bm.allocate(b)
    assert b.num_cached_tokens == 0
    assert b.block_table == [3, 4, 5]
    assert bm.ref_counts[:6] == [1] * 6
    bm.record_prefix_lookup(b)
    assert bm.num_prefix_queries == 0 and bm.num_prefix_hits == 0


def test_record_prefix_lookup_counts_tokens():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = mk(range(10))
    bm.allocate(a)
    bm.record_prefix_lookup(a)
    bm.cache_full_blocks(a, len(a))
    b = mk(range(10))
    bm.allocate(b)
    bm.record_prefix_lookup(b)
    assert bm.num_prefix_queries == 20
    assert bm.num_prefix_hits == 8


def test_unpublish_unconfirmed_forgets_only_the_last_plans_blocks():
    """A failed step's blocks leave the prefix cache; blocks confirmed by an earlier step stay."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = mk(range(9))  # 2 full blocks of 4
    assert bm.allocate(a)
    bm.cache_full_blocks(a, len(a))
    bm.confirm_published()  # its step ran
    b = mk(range(100, 109))
    assert bm.allocate(b)
    bm.cache_full_blocks(b, len(b))  # planned, never run
    bm.unpublish_unconfirmed()
    assert sorted(bm.hash_to_block.values()) == a.block_table[:2]
    assert bm.block_hash[b.block_table[0]] is None and bm.block_hash[b.block_table[1]] is None
    assert bm.ref_counts[:6] == [1] * 6  # nothing freed: the blocks stay with their sequences
    assert bm.num_cached_prefix_tokens(mk(range(9))) == 8
    assert bm.num_cached_prefix_tokens(mk(range(100, 109))) == 0
    bm.unpublish_unconfirmed()  # nothing left to forget
    assert sorted(bm.hash_to_block.values()) == a.block_table[:2]


def test_reset_prefix_cache():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = mk(range(9))
    bm.allocate(a)
    bm.cache_full_blocks(a, len(a))
    bm.reset_prefix_cache()
    assert bm.hash_to_block == {}
    assert a.block_table == [0, 1, 2]
    assert bm.ref_counts[:3] == [1, 1, 1]
    b = mk(range(9))
    assert bm.allocate(b)
    assert b.num_cached_tokens == 0


# --- can_allocate agrees with allocate ----------------------------------------------
def test_can_allocate_counts_free_hits_against_the_pool():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = mk(range(9))  # [0, 1, 2]
    bm.allocate(a)
    bm.cache_full_blocks(a, len(a))
    bm.free(a)
    assert bm.num_free_blocks == 3
    # 4 blocks: 2 hits that are themselves free + 2 new; only 1 other block free
    b = mk(list(range(8)) + [60, 61, 62, 63, 64])
    assert bm.can_allocate(b) is False
    before = snapshot(bm)
    assert bm.allocate(b) is False
    assert snapshot(bm) == before
    # 3 blocks: 2 free hits + 1 new fits exactly
    c = mk(list(range(8)) + [60, 61, 62, 63])
    assert bm.can_allocate(c) is True
    assert bm.allocate(c)
    assert c.block_table == [0, 1, 2]
    assert c.num_cached_tokens == 8
    assert bm.num_free_blocks == 0


def test_can_allocate_hits_on_held_blocks_cost_nothing():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = mk(range(9))  # [0, 1, 2]
    bm.allocate(a)
    bm.cache_full_blocks(a, len(a))
    assert bm.num_free_blocks == 1
    b = mk(list(range(8)) + [70])  # 3 blocks: 2 shared hits + 1 new
    assert bm.can_allocate(b) is True
    assert bm.allocate(b)
    assert b.block_table == [0, 1, 3]
    c = mk(list(range(8)) + [71])  # 2 hits + 1 new, but the pool is empty
    assert bm.can_allocate(c) is False
    assert bm.allocate(c) is False
    assert bm.ref_counts == [2, 2, 1, 1]


def test_can_allocate_has_no_side_effects():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = mk(range(9))
    bm.allocate(a)
    bm.cache_full_blocks(a, len(a))
    bm.free(a)
    before = snapshot(bm)
    for s in (mk(range(9)), mk(range(20)), mk([5])):
        bm.can_allocate(s)
        assert snapshot(bm) == before


def test_chunk_arguments_are_validated():
    from pagedllm.engine.contiguous_allocator import ContiguousAllocator

    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    seq = Sequence(list(range(10)), block_size=4)
    for bad in (0, -3):
        with pytest.raises(ValueError, match="max_num_new_tokens"):
            bm.can_allocate(seq, bad)
        with pytest.raises(ValueError, match="max_num_new_tokens"):
            bm.allocate(seq, bad)
        with pytest.raises(ValueError, match="max_num_new_tokens"):
            ContiguousAllocator(8, 4).allocate(seq, bad)
    assert bm.allocate(seq, 5) and seq.block_table == [0, 1]
    seq.num_computed_tokens = 5
    for bad in (0, 6):  # 5 tokens are left to compute
        with pytest.raises(ValueError, match="num_new_tokens must be 1..5"):
            bm.append_slot(seq, bad)
    assert bm.append_slot(seq, 5) and len(seq.block_table) == 3


# --- pages the runner may give back ---------------------------------------------------
def test_take_releasable_coalesces_freed_empty_blocks_and_keeps_cached_ones():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = mk(range(9))  # [0, 1, 2]; 0 and 1 full
    b = mk(range(100, 112))  # [3, 4, 5]
    c = mk(range(200, 204))  # [6]
    assert bm.allocate(a) and bm.allocate(b) and bm.allocate(c)
    bm.cache_full_blocks(a, len(a))
    assert bm.num_touched_blocks == 7
    assert bm.take_releasable() == []  # all in use
    bm.free(a)
    bm.free(b)
    # a's cached 0 and 1 stay (a later prompt may hit them); 2-5 hold nothing: one range
    assert bm.take_releasable() == [(2, 6)]
    assert bm.num_touched_blocks == 3
    assert bm.take_releasable() == []  # given back once
    bm.free(c)
    assert bm.take_releasable() == [(6, 7)]
    # evicting a cached block makes it touched again, and releasable once free
    bm.reset_prefix_cache()
    assert bm.take_releasable() == [(0, 2)]
    assert bm.num_touched_blocks == 0
    d = mk(range(300, 305))  # 2 blocks: the lowest ids again
    assert bm.allocate(d)
    assert d.block_table == [0, 1]
    assert bm.num_touched_blocks == 2
