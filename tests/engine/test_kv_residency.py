"""The KV pool is resident only where blocks were written, and a drained pool gives its empty blocks' pages back.

Resident bytes are the OS's own count (``mincore`` on the cache's mapping),
not the bookkeeping's; outputs after pages went back must equal a fresh
engine's, since a released page reads as zeros and is written before read.
"""

from __future__ import annotations

import mmap

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.runner.kv_cache import lazy_zeros, release_kv_blocks, resident_kv_bytes

GREEDY = SamplingParams(max_tokens=12, temperature=0)


def test_lazy_pool_is_resident_where_written_and_released_pages_read_zero() -> None:
    # [2, layers, blocks, block_size, heads, head_dim]: one block of one slice is 4 pages of floats
    kv = lazy_zeros((2, 3, 64, 16, 4, 16), torch.float32)
    block_bytes = 16 * 4 * 16 * 4
    assert block_bytes % mmap.PAGESIZE == 0
    assert resident_kv_bytes(kv) == 0
    kv[:, :, 0:5].fill_(1.5)
    assert resident_kv_bytes(kv) == 2 * 3 * 5 * block_bytes
    released = release_kv_blocks(kv, [(1, 3), (4, 5)])
    assert released == 2 * 3 * 3 * block_bytes
    assert resident_kv_bytes(kv) == 2 * 3 * 2 * block_bytes
    assert torch.all(kv[:, :, 1:3] == 0) and torch.all(kv[:, :, 4] == 0)
    assert torch.all(kv[:, :, 0] == 1.5) and torch.all(kv[:, :, 3] == 1.5)  # live blocks untouched


def test_release_keeps_pages_shared_with_live_blocks() -> None:
    # a block of 1 KiB: 4 blocks to a page, so releasing one block frees no page
    kv = lazy_zeros((2, 1, 64, 4, 1, 64), torch.float32)
    kv[:, :, 0:4].fill_(2.0)
    assert release_kv_blocks(kv, [(1, 2)]) == 0
    assert torch.all(kv[:, :, 0:4] == 2.0)
    assert release_kv_blocks(kv, [(0, 4)]) == 2 * mmap.PAGESIZE


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_an_int8_pool_reserves_releases_and_counts_its_scales_with_its_values(fmt: str) -> None:
    """int8 blocks hold each head's float32 scale after its values (head_dim + 4 bytes), int4 ones after its
    nibbles (head_dim / 2 + 4): the lazy reservation, the release and the block bytes all cover them."""
    from pagedllm.layers import kv_quant
    from pagedllm.loader.model_config import ModelArchConfig
    from pagedllm.runner.kv_cache import allocate_kv_cache, kv_bytes_per_block

    # head_dim 60 (int8) / 120 (int4): a head row of 64 bytes, a block of 16 tokens x 4 heads one page per slice
    head_dim, dtype = (60, torch.int8) if fmt == "int8" else (120, torch.uint8)
    quantize = getattr(kv_quant, f"quantize_{fmt}_heads")
    dequantize = getattr(kv_quant, f"dequantize_{fmt}_heads")
    mc = ModelArchConfig(architecture="llama", vocab_size=100, hidden_size=4 * head_dim, intermediate_size=64,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, head_dim=head_dim,
                         rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=True)
    kv, layers = allocate_kv_cache(mc, 64, 16, dtype, torch.device("cpu"))
    block_bytes = 16 * 4 * 64
    assert kv.shape == (2, 3, 64, 16, 4, 64) and block_bytes == mmap.PAGESIZE
    assert kv_bytes_per_block(mc, 16, dtype) == 2 * 3 * block_bytes
    assert resident_kv_bytes(kv) == 0
    rows = quantize(torch.randn(5, 16, 4, head_dim) + 1)  # blocks 0-4 of every layer
    for k_cache, v_cache in layers:
        k_cache[0:5] = rows
        v_cache[0:5] = rows
    assert resident_kv_bytes(kv) == 2 * 3 * 5 * block_bytes
    assert release_kv_blocks(kv, [(1, 3)]) == 2 * 3 * 2 * block_bytes
    assert torch.all(kv[:, :, 1:3] == 0)  # values and scales: a released block reads as zeros
    assert torch.all(dequantize(kv[:, :, 1:3]) == 0)
    assert torch.equal(kv[0, 2, 3], rows[3]) and torch.equal(kv[1, 0, 4], rows[4])


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=2048, max_model_len=512, max_num_seqs=8)


def test_a_large_pool_costs_only_the_blocks_written(llm: LLM) -> None:
    runner = llm.llm_engine.model_runner
    bm = llm.llm_engine.block_manager
    per_block = runner.kv_bytes_per_block
    prompts = [f"Request {i}: tell me about the number {i * 7919}." for i in range(8)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) > 0 for o in outs)
    # drained: only the cached prefixes' blocks (and pages they share) stay resident
    num_cached = len(bm.hash_to_block)
    assert bm.num_used_blocks == 0 and num_cached > 0
    assert runner.kv_resident_bytes <= (num_cached + 2) * per_block
    assert runner.kv_resident_bytes < runner.kv_cache_bytes / 50
    assert runner.kv_bytes_released > 0
    assert bm.take_releasable() == []  # nothing left to give back


def test_outputs_after_pages_went_back_equal_a_fresh_engine(llm: LLM) -> None:
    prompts = ["The capital of France is", "Write one line about the sea.", "List three colors:"]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    llm.reset_prefix_cache()
    # the cache forgot them: their blocks' pages are given back at the next drain
    other = llm.generate(["Something else entirely, please."], GREEDY, use_tqdm=False)
    assert other[0].outputs[0].token_ids
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    fresh = LLM(num_kv_blocks=64, max_model_len=512, max_num_seqs=8)
    expected = [o.outputs[0].token_ids for o in fresh.generate(prompts, GREEDY, use_tqdm=False)]
    assert first == again == expected
