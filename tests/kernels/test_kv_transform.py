"""The int4 cache's change of variables (``layers/kv_transform.py``): attention is unchanged by it."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.kv_transform import KvTransform

KV_HEADS, GROUP, HEAD_DIM, TOKENS = 2, 3, 16, 40


def _qkv(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[T, heads, d]``, k/v ``[T, kv_heads, d]`` float64 with channel means and uneven channel sizes, as
    real keys have."""
    gen = torch.Generator().manual_seed(seed)
    spread = torch.rand(KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64) * 4 + 0.1
    k = torch.randn(TOKENS, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64) * spread + 3.0 * spread.flip(-1)
    v = torch.randn(TOKENS, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64) + 2.0
    q = torch.randn(TOKENS, KV_HEADS * GROUP, HEAD_DIM, generator=gen, dtype=torch.float64)
    return q, k, v


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    """Causal softmax attention in float64, K/V heads shared by ``GROUP`` query heads: ``[T, heads, d]``."""
    keys, values = k.repeat_interleave(GROUP, dim=1), v.repeat_interleave(GROUP, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) / HEAD_DIM**0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = torch.ones(TOKENS, TOKENS, dtype=torch.bool).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, values)


def _fitted(q: torch.Tensor, k: torch.Tensor, shift_keys: bool = True) -> KvTransform:
    transform = KvTransform(KV_HEADS, HEAD_DIM, shift_keys=shift_keys)
    transform.dtype = torch.float64  # the fitted buffers' dtype (float32 in a model)
    transform.record()
    transform.encode(q, k)
    transform.fit()
    return transform


def test_the_transform_leaves_attention_unchanged() -> None:
    """q'.k' differs from q.k by a constant per query: the same output."""
    q, k, v = _qkv(0)
    transform = _fitted(q, k)
    qt, kt = transform.encode(q.clone(), k.clone())
    assert not torch.allclose(kt, k) and not torch.allclose(qt, q)
    torch.testing.assert_close(_attention(qt, kt, v), _attention(q, k, v), rtol=1e-9, atol=1e-9)


def test_the_stored_keys_are_centred_and_rebalanced() -> None:
    """On the calibration data itself the stored keys have mean 0 per channel; each channel is divided by
    s_c = sqrt(std(k_c) / rms(q_c)) (geometric mean 1 per head) and the queries multiplied by it."""
    q, k, _ = _qkv(1)
    transform = _fitted(q, k)
    qt, kt = transform.encode(q.clone(), k.clone())
    torch.testing.assert_close(kt.mean(0), torch.zeros(KV_HEADS, HEAD_DIM, dtype=torch.float64), atol=1e-9, rtol=0)
    k_std = k.std(0, unbiased=False)
    q_rms = q.reshape(TOKENS, KV_HEADS, GROUP, HEAD_DIM).square().mean(dim=(0, 2)).sqrt()
    s = (k_std / q_rms).sqrt()
    s = s / s.log().mean(-1, keepdim=True).exp()
    torch.testing.assert_close(kt * s, k - k.mean(0), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(qt, q * s.repeat_interleave(GROUP, dim=0), rtol=1e-12, atol=0)


def test_softcapped_scores_keep_the_keys_mean() -> None:
    """tanh does not ignore a constant added to every score: with shift_keys=False only the exact rescaling
    is applied, and a softcapped attention is unchanged too."""
    q, k, v = _qkv(2)
    transform = _fitted(q, k, shift_keys=False)
    assert torch.equal(transform.k_add, torch.zeros_like(transform.k_add))
    qt, kt = transform.encode(q.clone(), k.clone())
    torch.testing.assert_close(_attention(qt, kt, v, softcap=5.0), _attention(q, k, v, softcap=5.0), rtol=1e-9, atol=1e-9)


def test_the_native_op_changes_the_rows_as_torch_does() -> None:
    """``row_affine_`` (one step-program node) in place on strided views of qkv rows, as the layer calls it."""
    from pagedllm.kernels import load_kernels
    from pagedllm.layers.native_ops import NativeOps

    ops = load_kernels()
    if ops is None:
        pytest.fail("the native kernels did not build")
    q, k, v = (t.float() for t in _qkv(4))
    torched = _fitted(q.double(), k.double()).float()
    native = _fitted(q.double(), k.double()).float()
    native.select_impl(NativeOps(ops))
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)  # [T, (heads + 2 kv_heads) * d]
    nq, nk = q.shape[1] * HEAD_DIM, k.shape[1] * HEAD_DIM
    views = (qkv[:, :nq].view(q.shape), qkv[:, nq : nq + nk].view(k.shape))
    got = native.encode(*views)
    want = torched.encode(q.clone(), k.clone())
    assert all(g.data_ptr() == w.data_ptr() for g, w in zip(got, views))  # in place
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, nq + nk :], v.flatten(1))  # the values are left alone
    rows = torch.randn(TOKENS, 8)
    with pytest.raises(ValueError, match="row_affine_"):
        ops.row_affine_(rows, torch.ones(3), None)
    want_rows = rows * 2.0 + 1.0
    ops.row_affine_(rows, torch.full((8,), 2.0), torch.ones(8))
    torch.testing.assert_close(rows, want_rows, rtol=0, atol=1e-6)


def test_an_unfitted_transform_is_the_identity_and_misuse_is_refused() -> None:
    """Unfitted: no op and no buffer (a model whose cache is not int4 holds none); fitted: float32 buffers."""
    q, k, _ = _qkv(3)
    transform = KvTransform(KV_HEADS, HEAD_DIM)
    assert all(a is b for a, b in zip(transform.encode(q, k), (q, k)))
    assert not list(transform.buffers())
    with pytest.raises(ValueError, match="record"):
        transform.fit()
    transform.record()
    with pytest.raises(ValueError, match="record"):
        transform.fit()  # nothing seen yet
    transform.encode(q.float(), k.float())
    transform.fit()
    assert {n: b.dtype for n, b in transform.named_buffers()} == dict.fromkeys(
        ["k_mul", "k_add", "q_mul_row", "k_mul_row", "k_add_row"], torch.float32)
    with pytest.raises(ValueError, match="fitted already"):
        transform.record()
