"""Layers that choose their implementation once (``layers/custom_op.py``), and the attention's cache check."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.kernels import load_kernels
from pagedllm.layers import attention
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import AttentionMetadata, CpuPagedAttention, ReferenceAttention
from pagedllm.layers.custom_op import CustomOp, NativeOpsMixin, select_impls
from pagedllm.layers.native_ops import NativeOps
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.qk_rotary import QKNormRotary
from pagedllm.layers.rotary import RotaryEmbedding


@pytest.fixture(scope="module")
def ops() -> NativeOps:
    lib = load_kernels()
    assert lib is not None, "the native kernels must build on the test machine"
    return NativeOps(lib)


def _norms(head_dim: int, unit_offset: bool, gen: torch.Generator) -> tuple[RMSNorm, RMSNorm]:
    q_norm, k_norm = RMSNorm(head_dim, 1e-6, unit_offset), RMSNorm(head_dim, 1e-6, unit_offset)
    with torch.no_grad():
        for norm in (q_norm, k_norm):
            norm.weight.copy_(torch.rand(head_dim, generator=gen) + (0.0 if unit_offset else 0.5))
    return q_norm, k_norm


@pytest.mark.parametrize("norms", ["none", "llama", "gemma"])  # no q/k norms; Qwen3's; Gemma 3's (1 + w)
def test_qk_norm_rotary_native_matches_torch(ops: NativeOps, norms: str) -> None:
    gen = torch.Generator().manual_seed(7)
    num_heads, num_kv_heads, head_dim, rows = 6, 2, 32, 9
    q_norm, k_norm = (None, None) if norms == "none" else _norms(head_dim, norms == "gemma", gen)
    layer = QKNormRotary(num_heads, num_kv_heads, head_dim, q_norm, k_norm)
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None)
    cos_sin = rotary.cos_sin(torch.randint(0, 512, (rows,), generator=gen), torch.float32)
    qkv = torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)

    before = qkv.clone()
    q_torch, k_torch = layer(qkv, cos_sin)
    assert layer.native is None and torch.equal(qkv, before)  # the torch path makes new tensors
    assert q_torch.shape == (rows, num_heads, head_dim) and k_torch.shape == (rows, num_kv_heads, head_dim)

    layer.select_impl(ops)
    assert layer.native is ops
    if q_norm is not None:  # the layer selected the norms it uses: their native weights exist
        assert q_norm.native is ops and k_norm.native_weight is not None
    q, k = layer(qkv, cos_sin)
    # in place: q and k are views of qkv; v is left alone
    assert q.data_ptr() == qkv.data_ptr() and k.data_ptr() == qkv[:, num_heads * head_dim :].data_ptr()
    qk_width = (num_heads + num_kv_heads) * head_dim
    assert torch.equal(qkv[:, qk_width:], before[:, qk_width:])
    torch.testing.assert_close(q, q_torch, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, k_torch, rtol=1e-5, atol=1e-5)

    layer.select_impl(None)  # back to torch, the norms too
    assert layer.native is None and (q_norm is None or q_norm.native is None)
    torch.testing.assert_close(layer(before.clone(), cos_sin)[0], q_torch, rtol=0, atol=0)


def test_qk_norm_rotary_takes_both_norms_or_neither() -> None:
    with pytest.raises(ValueError, match="both"):
        QKNormRotary(2, 1, 8, RMSNorm(8, 1e-6), None)


def test_qk_norm_rotary_does_not_register_the_attentions_norms() -> None:
    """The norms keep one name each (the checkpoint's), on the module that owns them."""

    class Owner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_norm, self.k_norm = RMSNorm(8, 1e-6), RMSNorm(8, 1e-6)
            self.rope = QKNormRotary(2, 1, 8, self.q_norm, self.k_norm)

    owner = Owner()
    assert [name for name, _ in owner.named_parameters(remove_duplicate=False)] == ["q_norm.weight", "k_norm.weight"]
    assert list(owner.rope.parameters()) == []


def test_select_impls_binds_every_custom_op_once(ops: NativeOps) -> None:
    class Model(NativeOpsMixin, nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = RMSNorm(16, 1e-5, unit_offset=True)
            self.act = SiluAndMul()
            self.plain = nn.Linear(4, 4)

    model = Model()
    custom = [m for m in model.modules() if isinstance(m, CustomOp)]
    assert len(custom) == 2 and all(m.native is None for m in custom)
    x = torch.randn(3, 16)
    want_norm, want_act = model.norm(x), model.act(x)

    select_impls(model, ops)
    assert all(m.native is ops for m in custom)
    torch.testing.assert_close(model.norm.native_weight, 1.0 + model.norm.weight.detach())
    torch.testing.assert_close(model.norm(x), want_norm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.act(x), want_act, rtol=1e-5, atol=1e-6)

    model.use_native_ops(None)  # the models' public switch is the same walk
    assert all(m.native is None for m in custom) and model.norm.native_weight is None
    assert torch.equal(model.norm(x), want_norm) and torch.equal(model.act(x), want_act)


def _prefill_meta(num_tokens: int, block_size: int) -> AttentionMetadata:
    num_blocks = (num_tokens + block_size - 1) // block_size
    return AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64),
        block_tables=torch.arange(num_blocks, dtype=torch.int64).unsqueeze(0),
        seq_lens_tensor=torch.tensor([num_tokens], dtype=torch.int64),
        query_start_loc=[0, num_tokens], seq_lens=[num_tokens], num_computed=[0], num_prefills=1,
        block_size=block_size,
    )


def test_cpu_paged_decides_on_a_cache_pair_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.dtype] = []
    real = attention.native_caches

    def counted(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        calls.append(k_cache.dtype)
        return real(k_cache, v_cache)

    monkeypatch.setattr(attention, "native_caches", counted)
    backend = CpuPagedAttention()
    heads, kv_heads, head_dim, block_size, tokens = 4, 2, 16, 4, 7
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(tokens, heads, head_dim, generator=gen)
    k, v = torch.randn(tokens, kv_heads, head_dim, generator=gen), torch.randn(tokens, kv_heads, head_dim, generator=gen)
    meta = _prefill_meta(tokens, block_size)
    want = ReferenceAttention().forward(q, k, v, *[torch.zeros(2, block_size, kv_heads, head_dim) for _ in range(2)],
                                        meta, head_dim**-0.5)
    # float16: native; float64: not a native cache dtype, so written the torch way (a fresh prompt reads no cache)
    for dtype in (torch.float16, torch.float64):
        caches = [torch.zeros(2, block_size, kv_heads, head_dim, dtype=dtype) for _ in range(2)]
        for _ in range(3):
            out = backend.forward(q, k, v, *caches, meta, head_dim**-0.5)
        torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)  # float16 rounds K/V
        torch.testing.assert_close(caches[0].flatten(0, 1)[:tokens].float(), k, rtol=1e-3, atol=1e-3)
    assert calls == [torch.float16, torch.float64]  # once per pair, not per call


def test_cpu_paged_does_not_take_a_new_cache_for_a_freed_one() -> None:
    """A verdict is kept for the cache objects it was made for, even if a later tensor gets a freed one's id."""
    backend = CpuPagedAttention()
    caches = [torch.zeros(2, 4, 2, 16) for _ in range(2)]
    assert backend._native_caches(*caches)
    key = (id(caches[0]), id(caches[1]))
    others = [torch.zeros(2, 4, 2, 16, dtype=torch.float64) for _ in range(2)]
    # as if ``others`` had been allocated at the freed caches' addresses
    backend._cache_verdicts[(id(others[0]), id(others[1]))] = backend._cache_verdicts.pop(key)
    assert not backend._native_caches(*others)
