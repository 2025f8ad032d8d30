"""Attention sinks (gpt-oss): every backend and kernel against a float64 softmax with the sink column.

A sink is one learned logit per query head, one more term of the softmax's
denominator that weights no value (transformers' gpt-oss concatenates it to
the scores, takes the softmax and drops its column). The reference here is
written from that definition in float64; each backend runs the paths it has
(the native decode, ``paged_prefill`` and ``prefill_attention`` kernels, the
explicit torch softmax for windowed prompts), over every KV cache format,
with and without a sliding window, at head sizes that take the kernels'
vector, tiled and scalar code.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.block_table import slot_mapping
from pagedllm.layers.attention import AttentionMetadata, CpuPagedAttention, make_backend
from pagedllm.layers.kv_quant import indexable, is_quantized, quantize_heads, stored_values
from pagedllm.runner.kv_cache import cache_head_width

NUM_HEADS, NUM_KV_HEADS, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 4, 48
KV_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8,  # uint8: int4
             torch.float8_e4m3fn, torch.float8_e5m2]
# fresh prompts, a prompt over a cached prefix, decodes; long enough for a window of 5 to cut
STEP = [(0, 11), (9, 6), (0, 1), (6, 1), (21, 1)]
# sinks above, near and below the scores' scale: each head's denominator changes differently
SINKS = torch.tensor([2.5, 0.0, -1.0, 6.0])


def _stored(x: torch.Tensor, kv_dtype: torch.dtype, keys: bool = False) -> torch.Tensor:
    """``x`` as a cache of ``kv_dtype`` stores it (values and scales for the quantized formats)."""
    return quantize_heads(x, kv_dtype, keys) if is_quantized(kv_dtype) else x.to(kv_dtype)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float,
               sinks: torch.Tensor | None, window: int | None) -> torch.Tensor:
    """float64 attention of queries at positions ``q_start ..`` over a contiguous context, the sink as a column."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(q_start, q_start + q.shape[0]).unsqueeze(1)
    k_pos = torch.arange(k.shape[0]).unsqueeze(0)
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        column = sinks.double().view(-1, 1, 1).expand(-1, q.shape[0], 1)
        scores = torch.cat([scores, column], dim=-1)
    probs = scores.softmax(-1)[..., : k.shape[0]]
    return torch.einsum("hqk,khd->qhd", probs, v)


def _build_step(head_dim: int, kv_dtype: torch.dtype, seed: int):  # noqa: ANN202
    """STEP's sequences on scattered blocks, cached parts written first; returns the step's inputs, its
    metadata and each sequence's whole K/V as the cache holds it (float32)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    width = cache_head_width(head_dim, kv_dtype)
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, width, dtype=kv_dtype)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    qs, ks, vs, slots, tables, full, starts, lens, computed_list = [], [], [], [], [], [], [0], [], []
    for computed, new in STEP:
        total = computed + new
        table = [free.pop() for _ in range((total + BLOCK_SIZE - 1) // BLOCK_SIZE)]
        k_all = torch.randn(total, NUM_KV_HEADS, head_dim, generator=gen)
        v_all = torch.randn(total, NUM_KV_HEADS, head_dim, generator=gen)
        old = torch.tensor(slot_mapping(table, BLOCK_SIZE, 0, computed), dtype=torch.int64)
        indexable(k_cache).view(-1, NUM_KV_HEADS, width)[old] = indexable(_stored(k_all[:computed], kv_dtype, True))
        indexable(v_cache).view(-1, NUM_KV_HEADS, width)[old] = indexable(_stored(v_all[:computed], kv_dtype))
        qs.append(torch.randn(new, NUM_HEADS, head_dim, generator=gen))
        ks.append(k_all[computed:])
        vs.append(v_all[computed:])
        slots.extend(slot_mapping(table, BLOCK_SIZE, computed, total))
        tables.append(table)
        full.append((stored_values(_stored(k_all, kv_dtype, True)).float(),
                     stored_values(_stored(v_all, kv_dtype)).float()))
        starts.append(starts[-1] + new)
        lens.append(total)
        computed_list.append(computed)
    widest = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (widest - len(t)) for t in tables], dtype=torch.int64),
        seq_lens_tensor=torch.tensor(lens, dtype=torch.int64), query_start_loc=starts, seq_lens=lens,
        num_computed=computed_list, num_prefills=sum(1 for _, n in STEP if n > 1), block_size=BLOCK_SIZE,
    )
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta, full


def _check(backend, head_dim: int, kv_dtype: torch.dtype, window: int | None, sinks: torch.Tensor | None) -> None:  # noqa: ANN001
    q, k, v, k_cache, v_cache, meta, full = _build_step(head_dim, kv_dtype, seed=head_dim)
    scale = head_dim**-0.5
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window=window, sinks=sinks)
    for i, (computed, _new) in enumerate(STEP):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        want = _reference(q[start:end], full[i][0], full[i][1], computed, scale, sinks, window)
        torch.testing.assert_close(out[start:end].double(), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("backend_name", ["reference", "sdpa", "cpu_paged", "cpu_paged_invariant"])
def test_every_backend_puts_the_sink_in_the_denominator(backend_name: str, window: int | None,
                                                        kv_dtype: torch.dtype) -> None:
    """Fresh prompts (prefill_attention), a prompt over a cached prefix and, batch invariant, every prompt
    (paged_prefill), decodes (paged_decode), windowed prompts (the explicit torch softmax)."""
    if backend_name == "cpu_paged_invariant":
        backend = CpuPagedAttention(batch_invariant=True)
    else:
        backend = make_backend(backend_name)
    _check(backend, 64, kv_dtype, window, SINKS)


@pytest.mark.parametrize("head_dim", [8, 12, 32, 128])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_native_kernels_at_head_sizes_off_the_tiles(head_dim: int, batch_invariant: bool) -> None:
    """8 and 12: the per-token and scalar code; 32: prefill_attention's tiles but not paged_prefill's; 128:
    both tiled, as gpt-oss's 64."""
    _check(CpuPagedAttention(batch_invariant), head_dim, torch.float32, None, SINKS)
    _check(CpuPagedAttention(batch_invariant), head_dim, torch.float16, 5, SINKS)


def test_sinks_change_the_result_and_minus_infinity_is_no_sink() -> None:
    """The check above could pass with sinks ignored only if they did nothing: they do, and a sink of
    -inf gives the kernels' sink-less bits exactly."""
    backend = CpuPagedAttention(batch_invariant=True)
    outs = []
    for sinks in (None, torch.full((NUM_HEADS,), float("-inf")), SINKS):
        q, k, v, k_cache, v_cache, meta, _ = _build_step(64, torch.float32, seed=3)
        outs.append(backend.forward(q, k, v, k_cache, v_cache, meta, 0.125, sinks=sinks))
    assert torch.equal(outs[0], outs[1])
    assert (outs[0] - outs[2]).abs().max() > 0.05


def test_a_prompt_token_gets_the_decode_kernels_bits_with_sinks() -> None:
    """paged_prefill's rows and paged_decode's query of the same length: the same operations, sink included."""
    q, k, v, k_cache, v_cache, meta, _ = _build_step(64, torch.float32, seed=5)
    backend = CpuPagedAttention(batch_invariant=True)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125, sinks=SINKS)
    ops = backend._ops
    # the second prompt's last token as a decode of its sequence's whole length
    row = meta.query_start_loc[2] - 1
    single = torch.empty(1, NUM_HEADS, 64)
    ops.paged_decode(q[row : row + 1].contiguous(), k_cache, v_cache, meta.block_tables[1:2].contiguous(),
                     meta.seq_lens_tensor[1:2].contiguous(), 0.125, single, 0, SINKS)
    assert torch.equal(single[0], out[row])


@pytest.mark.parametrize("sinks", [torch.zeros(NUM_HEADS + 1), torch.zeros(NUM_HEADS, dtype=torch.float64),
                                   torch.zeros(NUM_HEADS * 2)[::2]])
def test_bad_sinks_are_value_errors(sinks: torch.Tensor) -> None:
    backend = CpuPagedAttention()
    for kind in ("decode", "fresh", "paged"):
        step = [(0, 1) if kind == "decode" else (0 if kind == "fresh" else 4, 3)]
        q = torch.randn(step[0][1], NUM_HEADS, 64)
        cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, 64)
        k = torch.randn(step[0][1], NUM_KV_HEADS, 64)
        total = sum(step[0])
        meta = AttentionMetadata(
            slot_mapping=torch.arange(step[0][0], total), block_tables=torch.tensor([[0, 1]]),
            seq_lens_tensor=torch.tensor([total]), query_start_loc=[0, step[0][1]], seq_lens=[total],
            num_computed=[step[0][0]], num_prefills=0 if kind == "decode" else 1, block_size=BLOCK_SIZE,
        )
        with pytest.raises(ValueError, match="sinks"):
            backend.forward(q, k, k.clone(), cache, cache.clone(), meta, 0.125, sinks=sinks)
