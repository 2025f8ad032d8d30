"""Per-kernel batch invariance (docs/batch-invariance.md): a row's bits do not depend on the rows around it.

Linear kernels: every row of a call of 1..97 rows equals the same row computed alone, bitwise (float32
panels, bf16 panels, GGUF blocks on 8-bit and on float activations). Attention: with ``batch_invariant`` a prompt
computed from scratch and the same prompt continuing cached context (a chunk, a prefix-cache hit) give
each token the same bits, because both go through the decode kernel's one reduction order.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import load_kernels
from pagedllm.layers.attention import AttentionMetadata, CpuPagedAttention
from pagedllm.layers.quantization.packed_linear import (
    pack_weight_panels,
    pack_weight_panels_bf16,
    packed_linear,
    packed_linear_bf16,
)

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="the kernels need the native build")

OUT, IN = 160, 576  # SmolLM2-135M's hidden size
MAX_ROWS = 97


def rows_alone_and_together(linear) -> None:  # noqa: ANN001 (x [rows, IN] -> [rows, OUT])
    """Every row of every call of 1..MAX_ROWS rows equals that row computed alone."""
    x = torch.randn(MAX_ROWS, IN, generator=torch.Generator().manual_seed(0)) * 2
    alone = torch.cat([linear(x[r : r + 1].contiguous()) for r in range(MAX_ROWS)])
    for m in range(1, MAX_ROWS + 1):
        assert torch.equal(linear(x[:m].contiguous()), alone[:m]), f"{m} rows"


def test_float32_panels_compute_a_row_alike_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    packed, bias = pack_weight_panels(torch.randn(OUT, IN, generator=gen)), torch.randn(OUT, generator=gen)
    rows_alone_and_together(lambda x: packed_linear(x, packed, bias, OUT))


def test_bf16_panels_compute_a_row_alike_in_any_batch() -> None:
    packed = pack_weight_panels_bf16(torch.randn(OUT, IN, generator=torch.Generator().manual_seed(2)))
    rows_alone_and_together(lambda x: packed_linear_bf16(x, packed, None, OUT, IN))


@pytest.mark.parametrize("ggml_type", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_gguf_blocks_on_8bit_activations_compute_a_row_alike_in_any_batch(ggml_type: str) -> None:
    from gguf import GGMLQuantizationType
    from test_gguf_quantized import X16, interleaved, random_blocks

    t = GGMLQuantizationType[ggml_type]
    weight = interleaved(random_blocks(t, OUT, 768, seed=4), t)
    x = torch.randn(MAX_ROWS, 768, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([torch.ops.pagedllm.gguf_linear(x[r : r + 1].contiguous(), weight, X16[t], 768, None)
                       for r in range(MAX_ROWS)])
    for m in range(1, MAX_ROWS + 1):
        together = torch.ops.pagedllm.gguf_linear(x[:m].contiguous(), weight, X16[t], 768, None)
        assert torch.equal(together, alone[:m]), f"{m} rows"


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_gguf_blocks_on_float_activations_compute_a_row_alike_in_any_batch(ggml_type: str) -> None:
    """The file's own blocks with float32 activations (gguf_activations="float32"): one row alone runs
    gguf_linear.cpp's direct_row (Q4_0 / Q4_1 / Q8_0 on vector builds), a batch the strip path."""
    from gguf import GGMLQuantizationType
    from test_gguf_quantized import random_blocks

    t = GGMLQuantizationType[ggml_type]
    weight = torch.from_numpy(random_blocks(t, OUT, 768, seed=6))
    bias = torch.randn(OUT, generator=torch.Generator().manual_seed(7))
    x = torch.randn(MAX_ROWS, 768, generator=torch.Generator().manual_seed(8))
    alone = torch.cat([torch.ops.pagedllm.gguf_linear(x[r : r + 1].contiguous(), weight, int(t), 768, bias)
                       for r in range(MAX_ROWS)])
    for m in range(1, MAX_ROWS + 1):
        together = torch.ops.pagedllm.gguf_linear(x[:m].contiguous(), weight, int(t), 768, bias)
        assert torch.equal(together, alone[:m]), f"{m} rows"


def attend(backend: CpuPagedAttention, q, k, v, k_cache, v_cache, cached: int, chunk: int):  # noqa: ANN001, ANN201
    """One prompt (rows ``cached .. cached + chunk``) through ``backend``, its K/V rows written to slots 0..;
    the rows before ``cached`` must already be in the cache."""
    block_size, num_blocks = k_cache.shape[1], k_cache.shape[0]
    seq_len = cached + chunk
    meta = AttentionMetadata(
        slot_mapping=torch.arange(cached, seq_len, dtype=torch.int64),
        block_tables=torch.arange(num_blocks, dtype=torch.int64).unsqueeze(0),
        seq_lens_tensor=torch.tensor([seq_len], dtype=torch.int64),
        query_start_loc=[0, chunk], seq_lens=[seq_len], num_computed=[cached], num_prefills=1,
        block_size=block_size,
    )
    rows = slice(cached, seq_len)
    return backend.forward(q[rows].contiguous(), k[rows].contiguous(), v[rows].contiguous(), k_cache, v_cache,
                           meta, 0.125)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["f32-cache", "f16-cache"])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_prefill_and_decode_attention_give_a_token_the_same_bits(head_dim: int, cache_dtype: torch.dtype) -> None:
    """batch_invariant: a prompt whole, and the same prompt in chunks over its cached part, bit for bit (on a
    float32 cache, and the float16 one GGUF files default to)."""
    heads, kv_heads, length, block_size = 9, 3, 70, 16
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(length, heads, head_dim, generator=gen)
    k, v = (torch.randn(length, kv_heads, head_dim, generator=gen) for _ in range(2))

    def cache() -> torch.Tensor:
        return torch.zeros(8, block_size, kv_heads, head_dim, dtype=cache_dtype)

    backend = CpuPagedAttention(batch_invariant=True)
    k_cache, v_cache = cache(), cache()
    whole = attend(backend, q, k, v, k_cache, v_cache, 0, length)
    k_cache, v_cache = cache(), cache()
    parts = [attend(backend, q, k, v, k_cache, v_cache, start, min(16, length - start))
             for start in range(0, length, 16)]
    assert torch.equal(torch.cat(parts), whole)
    if head_dim % 16:
        return  # (head sizes off the prefill kernel's tiles share more of the decode kernel's order)
    # the default routes the whole prompt through the prefill kernel's tiles, which sum in another order
    default = CpuPagedAttention()
    assert not torch.equal(attend(default, q, k, v, cache(), cache(), 0, length), whole)
