"""The data-parallel router: block hashes as the block manager keys them, longest prefix, then least load."""

from __future__ import annotations

import pytest

from pagedllm.clients.data_parallel.prefix_router import PrefixRouter
from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.sequence import Sequence


def test_prompt_hashes_are_the_block_managers_keys():
    ids = list(range(100, 150))  # 50 tokens, block 16: 3 full blocks, all inside the first 49
    bm = BlockManager(16, 16)
    seq = Sequence(list(ids), block_size=16)
    assert bm.allocate(seq)
    bm.cache_full_blocks(seq, len(ids))
    hashes = PrefixRouter(2, 16).prompt_hashes(ids)
    assert len(hashes) == 3
    assert set(hashes) == set(bm.hash_to_block)
    # a hit never covers the last token: 48 tokens give 2 lookup blocks
    assert PrefixRouter(2, 16).prompt_hashes(ids[:48]) == hashes[:2]
    assert PrefixRouter(2, 16, prefix_caching=False).prompt_hashes(ids) == []


def test_longest_cached_prefix_wins_then_least_load_then_turns():
    router = PrefixRouter(3, 4)
    a = router.prompt_hashes(list(range(20)))  # 4 blocks
    router.report(1, frozenset(a[:2]))
    router.record(2, [a[:3]])  # routed there a moment ago
    assert router.scores([a]) == [0, 2, 3]
    assert router.choose([a], [0, 0, 5]) == 2  # longest prefix beats load
    assert router.choose([a], [0, 0, None]) == 1  # a replica that does not serve is skipped
    miss = router.prompt_hashes(list(range(500, 520)))
    assert router.choose([miss], [3, 1, 2]) == 1  # a miss goes to the least loaded
    turns = {router.choose([miss], [0, 0, 0]) for _ in range(6)}
    assert turns == {0, 1, 2}  # equal loads take turns
    router.forget(2)
    assert router.scores([a]) == [0, 2, 0]
    with pytest.raises(ValueError):
        router.choose([a], [None, None, None])
    with pytest.raises(ValueError):
        PrefixRouter(0, 16)
