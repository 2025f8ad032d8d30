"""The ``torch.ops.pagedllm`` ops trace: fake (meta) shapes, schemas, in-place declarations.

Every op that returns a tensor is called on meta tensors (its fake
implementation, ``kernels/meta.py``) and must give the shapes and dtypes the
CPU kernel gives; ``torch.library.opcheck`` then checks a few against the
real kernels (the schema's mutation declarations, FakeTensor, AOT dispatch).
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import load_kernels
from pagedllm.layers.quantization.quantized_linear import pack_groups, quantize_groups

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="native kernels unavailable")

ops = torch.ops.pagedllm


def _same_meta(real: torch.Tensor, fake: torch.Tensor) -> None:
    assert fake.device.type == "meta"
    assert (fake.shape, fake.dtype) == (real.shape, real.dtype)


def test_fake_shapes_match_the_kernels() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 24, generator=gen), torch.randn(40, 24, generator=gen)

    def both(fn, *args):  # noqa: ANN001, ANN202
        real = fn(*args)
        fake = fn(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])
        return real, fake

    _same_meta(*both(ops.add_rms_norm, x.clone(), None, torch.ones(24), 1e-6))
    _same_meta(*both(ops.silu_mul, x))
    x64 = torch.randn(5, 64, generator=gen)
    for bits in (8, 4):
        blocks = pack_groups(*quantize_groups(torch.randn(40, 64, generator=gen), bits, 32), bits)
        _same_meta(*both(ops.quantized_linear, x64, blocks, bits, 32, 64, None))
        _same_meta(*both(ops.quantized_embedding, blocks, bits, 32, 64, torch.tensor([3, 0, 39])))
    for pack, linear in ((ops.pack_panels, ops.packed_linear), (ops.pack_panels_bf16, ops.packed_linear_bf16)):
        real_packed, fake_packed = both(pack, w)
        _same_meta(real_packed, fake_packed)
        _same_meta(linear(x, real_packed, None, 40), linear(x.to("meta"), fake_packed, None, 40))
    real_stats, fake_stats = both(ops.logit_stats, torch.randn(3, 100, generator=gen))
    for real, fake in zip(real_stats, fake_stats, strict=True):
        _same_meta(real, fake)
    for logits in (torch.randn(3, 16, generator=gen), torch.randn(3, 16, generator=gen).to(torch.bfloat16)):
        for real, fake in zip(*both(ops.moe_route, logits, 4, 0, True, None, 1.0), strict=True):
            _same_meta(real, fake)
    ids = torch.tensor([[3, 1], [0, 3], [2, 1]])
    for real, fake in zip(*both(ops.moe_group, ids, 4), strict=True):
        _same_meta(real, fake)
    _same_meta(*both(ops.gated_rms_norm, torch.randn(3, 4, 8, generator=gen), torch.randn(3, 4, 8, generator=gen),
                     torch.ones(8), 1e-6, 2))
    _same_meta(*both(ops.moe_slot_sum, torch.randn(3, 2, 8, generator=gen), torch.rand(3, 2, generator=gen),
                     torch.randn(3, 8, generator=gen), torch.randn(3, 1, generator=gen)))


def test_in_place_ops_run_on_meta_tensors() -> None:
    # nothing is returned; the fake kernel must accept what the CPU kernel accepts
    meta = torch.device("meta")
    qkv = torch.empty(3, 4 * 8, device=meta)  # [tokens, (2 q + 1 k + 1 v heads) * head_dim]
    ops.qk_norm_rope(qkv, 2, 1, 8, torch.empty(3, 8, device=meta), torch.empty(3, 8, device=meta), None, None, 1e-6)
    cache = torch.empty(4, 2, 1, 8, device=meta)  # [blocks, block_size, kv_heads, head_dim]
    kv = torch.empty(3, 1, 8, device=meta)
    ops.write_kv(kv, kv, cache, cache.clone(), torch.empty(3, dtype=torch.int64, device=meta))
    q = torch.empty(3, 2, 8, device=meta)
    tables, lens = torch.empty(3, 2, dtype=torch.int64, device=meta), torch.empty(3, dtype=torch.int64, device=meta)
    ops.paged_decode(q, cache, cache, tables, lens, 0.5, torch.empty_like(q))
    ops.prefill_attention(q, kv, kv, torch.empty_like(q), torch.empty(2, dtype=torch.int64, device=meta), 0.5)


@pytest.mark.parametrize("case", ["add_rms_norm", "silu_mul", "packed_linear", "quantized_linear", "logit_stats",
                                  "moe_route", "moe_group", "moe_slot_sum", "gated_rms_norm",
                                  "write_kv"])
def test_opcheck(case: str) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 16, generator=gen)
    if case == "add_rms_norm":
        op, args = ops.add_rms_norm.default, (x.clone(), torch.randn(4, 16, generator=gen), torch.rand(16), 1e-6)
    elif case == "silu_mul":
        op, args = ops.silu_mul.default, (x,)
    elif case == "packed_linear":
        op, args = ops.packed_linear.default, (x, ops.pack_panels(torch.randn(20, 16, generator=gen)), None, 20)
    elif case == "quantized_linear":
        blocks = pack_groups(*quantize_groups(torch.randn(20, 32, generator=gen), 4, 32), 4)
        op, args = ops.quantized_linear.default, (torch.randn(4, 32, generator=gen), blocks, 4, 32, 32, None)
    elif case == "logit_stats":
        op, args = ops.logit_stats.default, (x,)
    elif case == "moe_route":  # sigmoid scores, a correction bias, renormalised and scaled
        op, args = ops.moe_route.default, (x, 4, 2, True, torch.randn(16, generator=gen), 2.5)
    elif case == "moe_group":
        op, args = ops.moe_group.default, (torch.tensor([[3, 1], [0, 3], [2, 1]]), 4)
    elif case == "gated_rms_norm":  # tiled over 2 key heads
        op, args = ops.gated_rms_norm.default, (x.view(4, 2, 8), torch.randn(4, 2, 8, generator=gen), torch.rand(8),
                                                1e-6, 2)
    elif case == "moe_slot_sum":  # a shared expert with its gate
        op, args = ops.moe_slot_sum.default, (x.view(4, 2, 8), torch.rand(4, 2, generator=gen),
                                              torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen))
    else:
        cache = torch.zeros(4, 2, 2, 8)  # [blocks, block_size, kv_heads, head_dim]
        kv = x.view(4, 2, 8)
        op, args = ops.write_kv.default, (kv, kv, cache, cache.clone(), torch.tensor([0, 3, 5, 6]))
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
