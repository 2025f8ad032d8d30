"""Attention backends agree with each other and with dense attention, on scattered blocks."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pagedllm.block_table import slot_mapping
from pagedllm.layers.attention import (
    AttentionMetadata,
    CpuPagedAttention,
    ReferenceAttention,
    SdpaAttention,
    gather_context,
    make_backend,
)
from pagedllm.layers.kv_quant import indexable, is_quantized, quantize_heads, stored_values
from pagedllm.runner.kv_cache import cache_head_width

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 8, 4, 64


def _dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
    """Textbook attention over a contiguous context; queries sit at positions q_start..."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    q_pos = torch.arange(q_start, q_start + q.shape[0]).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _to_cache(x: torch.Tensor, kv_dtype: torch.dtype, keys: bool = False) -> torch.Tensor:
    """K (``keys``) or V ``[..., head_dim]`` as a cache of ``kv_dtype`` stores it (int8 / int4 (uint8) / fp8: values
    and scales; int4 searches a K row's scale)."""
    return quantize_heads(x, kv_dtype, keys) if is_quantized(kv_dtype) else x.to(kv_dtype)


def _as_held(x: torch.Tensor, kv_dtype: torch.dtype, keys: bool = False) -> torch.Tensor:
    """K (``keys``) or V ``[..., head_dim]`` in float32 as a cache of ``kv_dtype`` holds it."""
    return stored_values(_to_cache(x, kv_dtype, keys)).float()


def _width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """A cache's last dimension: head_dim, plus an int8 / fp8 cache's scale bytes (int4: head_dim / 2 + 4)."""
    return cache_head_width(head_dim, kv_dtype)


def _build_step(seqs: list[tuple[int, int]], seed: int, kv_dtype: torch.dtype = torch.float32):  # noqa: ANN202
    """A step over sequences given as (num_computed, num_new), prefills first.

    Each sequence gets a random, non-contiguous set of physical blocks; its
    cached part is written into the cache beforehand, its new part is fed as
    the step's K/V. Returns inputs, metadata and each sequence's full K/V
    (in float32, as a cache of ``kv_dtype`` holds it).
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, _width(HEAD_DIM, kv_dtype), dtype=kv_dtype)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    qs, ks, vs, slots, tables, full = [], [], [], [], [], []
    query_start_loc, seq_lens, num_computed = [0], [], []
    for computed, new in seqs:
        total = computed + new
        table = [free.pop() for _ in range((total + BLOCK_SIZE - 1) // BLOCK_SIZE)]
        k_all = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        v_all = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        q = torch.randn(new, NUM_HEADS, HEAD_DIM, generator=gen)
        old = torch.tensor(slot_mapping(table, BLOCK_SIZE, 0, computed), dtype=torch.int64)
        # fp8 as bytes: torch cannot index_put float8 on the CPU
        indexable(k_cache).view(-1, NUM_KV_HEADS, k_cache.shape[-1])[old] = indexable(_to_cache(k_all[:computed], kv_dtype, keys=True))
        indexable(v_cache).view(-1, NUM_KV_HEADS, v_cache.shape[-1])[old] = indexable(_to_cache(v_all[:computed], kv_dtype))
        qs.append(q)
        ks.append(k_all[computed:])
        vs.append(v_all[computed:])
        slots.extend(slot_mapping(table, BLOCK_SIZE, computed, total))
        tables.append(table)
        full.append((_as_held(k_all, kv_dtype, keys=True), _as_held(v_all, kv_dtype)))
        query_start_loc.append(query_start_loc[-1] + new)
        seq_lens.append(total)
        num_computed.append(computed)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int64),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        num_computed=num_computed,
        num_prefills=sum(1 for _, n in seqs if n > 1),
        block_size=BLOCK_SIZE,
    )
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta, full


# prefills (fresh and with a cached prefix), then decodes of various lengths
STEPS = [
    [(0, 7), (8, 5), (0, 1)],
    [(0, 13), (5, 9), (3, 1), (17, 1), (31, 1)],
    [(4, 1), (9, 1), (16, 1)],
    [(0, 32)],
    # chunks of several blocks over longer cached context, two of them in one step
    [(0, 9), (37, 20), (50, 7), (12, 1)],
]


KV_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8,  # uint8: int4
             torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("seqs", STEPS)
@pytest.mark.parametrize("backend_name", ["reference", "sdpa", "cpu_paged"])
def test_backend_matches_dense_attention(seqs: list[tuple[int, int]], backend_name: str, kv_dtype: torch.dtype) -> None:
    """With a 2-byte cache, every token's K/V (new ones too) is seen as the cache holds it."""
    # built here, not at collection: cpu_paged compiles its kernel on first use
    backend = make_backend(backend_name)
    q, k, v, k_cache, v_cache, meta, full = _build_step(seqs, seed=len(seqs), kv_dtype=kv_dtype)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5)
    for i, (computed, _new) in enumerate(seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        want = _dense_causal(q[start:end], full[i][0], full[i][1], computed)
        torch.testing.assert_close(out[start:end], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("seqs", STEPS)
def test_backends_agree(seqs: list[tuple[int, int]], kv_dtype: torch.dtype) -> None:
    q, k, v, k_cache, v_cache, meta, _ = _build_step(seqs, seed=99, kv_dtype=kv_dtype)
    ref = ReferenceAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, HEAD_DIM**-0.5)
    for backend in (SdpaAttention(), CpuPagedAttention()):
        fast = backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, HEAD_DIM**-0.5)
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


# head_dim 20 and 6 take the scalar path (not a multiple of 8), 96 the vector path with a 32-float tail
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (8, 8, 32, 5), (4, 1, 128, 1), (6, 2, 20, 4), (2, 2, 6, 3), (4, 2, 96, 8)],
)
def test_cpu_paged_decode_on_model_sized_heads(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, kv_dtype: torch.dtype
) -> None:
    """Long decodes over shuffled blocks, some shared between sequences, at SmolLM2-like sizes, with and without windows.

    2-byte caches are widened as they are read, int8 / int4 ones dequantized in
    registers: the result equals float32 attention over the widened cache.
    """
    gen = torch.Generator().manual_seed(7)
    rng = random.Random(7)
    num_blocks = 1000
    k_cache = _to_cache(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen), kv_dtype)
    v_cache = _to_cache(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen), kv_dtype)
    seq_lens = [1, block_size, block_size + 1, 97, 300]
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    shared = ids[:2]  # the first two blocks of every sequence long enough: a shared prefix
    tables = []
    for n in seq_lens:
        need = (n + block_size - 1) // block_size
        tables.append((shared + [ids.pop() for _ in range(need)])[:need])
    width = max(len(t) for t in tables) + 3  # padding past the longest table
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int64),
        query_start_loc=list(range(len(seq_lens) + 1)),
        seq_lens=seq_lens,
        num_computed=[n - 1 for n in seq_lens],
        num_prefills=0,
        block_size=block_size,
    )
    scale = head_dim**-0.5
    got = CpuPagedAttention().attend(q, None, None, k_cache, v_cache, meta, scale)
    # what the kernel would read past a too-short table or in a wrong dtype is refused
    with pytest.raises(ValueError, match="longer than its block table"):
        AttentionMetadata(**{**meta.__dict__, "seq_lens": [n + width * block_size for n in seq_lens]})
    with pytest.raises(ValueError, match="int64"):
        AttentionMetadata(**{**meta.__dict__, "block_tables": meta.block_tables.int()})
    with pytest.raises(ValueError, match="float32, float16, bfloat16, int8, int4 .uint8. or float8"):
        CpuPagedAttention().attend(q, None, None, k_cache.double(), v_cache.double(), meta, scale)
    with pytest.raises(ValueError, match="of one dtype"):
        other = torch.float16 if kv_dtype != torch.float16 else torch.bfloat16
        CpuPagedAttention().attend(q, None, None, k_cache, v_cache.to(other), meta, scale)
    with pytest.raises(ValueError, match="float32"):
        CpuPagedAttention().attend(q.half(), None, None, k_cache, v_cache, meta, scale)
    with pytest.raises(ValueError, match="do not fit"):
        CpuPagedAttention().attend(q[..., :-1].contiguous(), None, None, k_cache, v_cache, meta, scale)
    with pytest.raises(ValueError, match="window must be"):
        torch.ops.pagedllm.paged_decode(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens_tensor, scale, torch.empty_like(q), -1
        )
    # sliding windows (the last w keys): starting mid-block, on a block edge, one key, past the start
    windows = [None, 1, block_size, block_size + 3, 96, 1000]
    for window in windows:
        out = got if window is None else CpuPagedAttention().attend(
            q, None, None, k_cache, v_cache, meta, scale, sliding_window=window
        )
        for i, n in enumerate(seq_lens):
            start = 0 if window is None else max(0, n - window)
            keys = gather_context(k_cache, meta.block_tables[i], n, block_size).float()[start:]
            values = gather_context(v_cache, meta.block_tables[i], n, block_size).float()[start:]
            group = num_heads // num_kv_heads
            want = torch.einsum(
                "hk,khd->hd",
                (torch.einsum("hd,khd->hk", q[i], keys.repeat_interleave(group, 1)) * scale).softmax(-1),
                values.repeat_interleave(group, 1),
            )
            torch.testing.assert_close(out[i], want, rtol=1e-5, atol=1e-5)


def test_auto_backend_choice() -> None:
    from pagedllm.config import EngineConfig
    from pagedllm.resolved_config import resolve_config

    # "auto" is resolved by the config's resolver (bf16 on the CPU computes attention in float32), never here
    assert resolve_config(EngineConfig(model="m")).attention_backend == "cpu_paged"
    assert resolve_config(EngineConfig(model="m", dtype="bfloat16")).attention_backend == "cpu_paged"
    assert resolve_config(EngineConfig(model="m", dtype="float16")).attention_backend == "sdpa"
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_backend("auto", "cpu", torch.float32)
    with pytest.raises(ValueError, match="float32 on the CPU"):
        make_backend("cpu_paged", "cpu", torch.float16)
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_backend("flash", "cpu", torch.float32)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("backend_name", ["sdpa", "cpu_paged"])
def test_forward_writes_new_kv_through_the_slot_mapping(backend_name: str, kv_dtype: torch.dtype) -> None:
    seqs = [(0, 6), (5, 1)]
    q, k, v, k_cache, v_cache, meta, full = _build_step(seqs, seed=3, kv_dtype=kv_dtype)
    # K and V as the model hands them over: strided views into one fused qkv row
    fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)  # [tokens, (H + 2 KVH) * D]
    q_width, kv_width = q[0].numel(), k[0].numel()
    k = fused[:, q_width : q_width + kv_width].view(-1, NUM_KV_HEADS, HEAD_DIM)
    v = fused[:, q_width + kv_width :].view(-1, NUM_KV_HEADS, HEAD_DIM)
    assert not k.is_contiguous()
    make_backend(backend_name).forward(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5)
    for i, (computed, new) in enumerate(seqs):
        k_seq = gather_context(k_cache, meta.block_tables[i], computed + new, BLOCK_SIZE)
        v_seq = gather_context(v_cache, meta.block_tables[i], computed + new, BLOCK_SIZE)
        # exact: the cache holds each value rounded once, as torch's .to(kv_dtype) rounds it
        assert torch.equal(k_seq.float(), full[i][0]) and torch.equal(v_seq.float(), full[i][1])


def test_cpu_paged_refuses_a_slot_outside_the_cache_before_writing() -> None:
    q, k, v, k_cache, v_cache, meta, _ = _build_step([(0, 6), (5, 1)], seed=4)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    bad = meta.slot_mapping.clone()
    bad[-1] = NUM_BLOCKS * BLOCK_SIZE  # one past the last slot
    meta = dataclasses.replace(meta, slot_mapping=bad)
    with pytest.raises(ValueError, match="outside the KV cache"):
        make_backend("cpu_paged").forward(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5)
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)


def test_without_a_compiler_auto_falls_back_and_int8_is_refused(monkeypatch, tmp_path, tiny_model_dirs) -> None:  # noqa: ANN001
    from pagedllm import kernels

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))  # what cpp_extension compiles with
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    kernels._load.cache_clear()
    try:
        assert kernels.load_kernels() is None
        assert "no-such-compiler" in kernels.kernels_failure()
        from pagedllm.config import EngineConfig
        from pagedllm.resolved_config import resolve_config

        assert resolve_config(EngineConfig(model="m")).attention_backend == "sdpa"
        with pytest.raises(ValueError, match="cannot be built here"):
            make_backend("cpu_paged", "cpu", torch.float32)
        from pagedllm import LLM

        for quantization in ("int8", "int4"):
            with pytest.raises(ValueError, match=f"quantization='{quantization}' needs the native CPU kernels"):
                LLM(tiny_model_dirs["llama"], num_kv_blocks=32, max_model_len=128, quantization=quantization)
        assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.so"))
    finally:
        monkeypatch.undo()
        kernels._load.cache_clear()
    assert kernels.load_kernels() is not None  # the real compiler again, for the tests after this one


def test_cpu_paged_decode_propagates_nan_like_the_reference() -> None:
    """A NaN key poisons its head's output (as in torch), in the vector softmax too; other heads are finite."""
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, num_kv_heads, head_dim, seq_len = 8, 16, 2, 64, 40
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    k_cache[5, 3, 0, 7] = float("nan")  # token 3 of the sequence's first block, kv head 0
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        block_tables=torch.tensor([[5, 1, 6]], dtype=torch.int64),
        seq_lens_tensor=torch.tensor([seq_len], dtype=torch.int64),
        query_start_loc=[0, 1], seq_lens=[seq_len], num_computed=[seq_len - 1], num_prefills=0,
        block_size=block_size,
    )
    q = torch.randn(1, 4, head_dim, generator=gen)  # query heads 0-1 read kv head 0, 2-3 kv head 1
    got = CpuPagedAttention().attend(q, None, None, k_cache, v_cache, meta, head_dim**-0.5)
    want = make_backend("reference").attend(q, None, None, k_cache, v_cache, meta, head_dim**-0.5)
    assert got[0, :2].isnan().all() and want[0, :2].isnan().all()
    torch.testing.assert_close(got[0, 2:], want[0, 2:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_native_kv_write_rounds_like_torch(kv_dtype: torch.dtype) -> None:
    """The native write rounds each value as ``.to(kv_dtype)`` does, bit for bit, edge values included."""
    info = torch.finfo(kv_dtype)
    # exact ties between two neighbours (to even), one ulp either side, overflow, subnormals, signed zeros, inf, NaN
    one_ulp = 2.0 ** -(info.bits - 6 if kv_dtype == torch.float16 else 7)
    special = torch.tensor(
        [1 + one_ulp / 2, 1 + 3 * one_ulp / 2, -(1 + one_ulp / 2), 1 + one_ulp * 0.49, 1 + one_ulp * 0.51,
         info.max * 1.01, -info.max * 1.01, info.tiny / 3, -info.tiny / 5, 0.0, -0.0,
         float("inf"), float("-inf"), float("nan"), 3.14159, -2.71828],
        dtype=torch.float32,
    )
    q, k, v, _, _, meta, _ = _build_step([(0, 6), (5, 1)], seed=5)
    k = k.clone()
    k.view(-1)[: special.numel()] = special
    v = v.clone()
    v.view(-1)[-special.numel() :] = special
    native = [torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=kv_dtype) for _ in range(2)]
    plain = [c.clone() for c in native]
    make_backend("cpu_paged").forward(q, k, v, *native, meta, HEAD_DIM**-0.5)
    SdpaAttention().forward(q, k, v, *plain, meta, HEAD_DIM**-0.5)  # torch's index_copy_ of k.to(kv_dtype)
    for a, b in zip(native, plain):
        nan = torch.isnan(b.float())
        # a NaN stays a NaN (its payload bits are not compared: torch's vector and scalar paths differ there)
        assert nan.any() and torch.equal(torch.isnan(a.float()), nan)
        assert torch.equal(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan])


def test_float16_cache_saturates_instead_of_storing_inf() -> None:
    """A K/V beyond float16's range is stored as +-65504 by every backend, so no inf lingers in a freed slot
    for SDPA's padded gather to turn into NaN."""
    q, k, v, _, _, meta, _ = _build_step([(0, 6), (5, 1)], seed=6)
    k, v = k.clone(), v.clone()
    k.view(-1)[:3] = torch.tensor([1e6, -7e4, float("inf")])
    v.view(-1)[:2] = torch.tensor([2e5, -float("inf")])
    for backend in (make_backend("cpu_paged"), SdpaAttention(), ReferenceAttention()):
        caches = [torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float16) for _ in range(2)]
        out = backend.forward(q, k, v, *caches, meta, HEAD_DIM**-0.5)
        assert torch.isfinite(out).all(), backend.name
        for cache in caches:
            assert torch.isfinite(cache).all() and cache.abs().max().item() == 65504.0


@pytest.mark.parametrize("head_dim", [3, 6, 12])
def test_cpu_paged_prefill_with_head_sizes_off_the_vector_width(head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    num_tokens, num_blocks = 11, 8
    q = torch.randn(num_tokens, 4, head_dim, generator=gen)
    k, v = (torch.randn(num_tokens, 2, head_dim, generator=gen) for _ in range(2))
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64),
        block_tables=torch.tensor([[0, 1, 2]], dtype=torch.int64),
        seq_lens_tensor=torch.tensor([num_tokens]),
        query_start_loc=[0, num_tokens],
        seq_lens=[num_tokens],
        num_computed=[0],
        num_prefills=1,
        block_size=4,
    )
    caches = [torch.zeros(num_blocks, 4, 2, head_dim) for _ in range(4)]
    got = CpuPagedAttention().forward(q, k, v, caches[0], caches[1], meta, head_dim**-0.5)
    want = ReferenceAttention().forward(q, k, v, caches[2], caches[3], meta, head_dim**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [32, 48, 64, 128])
@pytest.mark.parametrize("lens", [[7, 8, 9, 33, 100, 257, 1], [203]])
def test_cpu_paged_prefill_of_long_prompts_matches_reference(head_dim: int, lens: list[int]) -> None:
    """Fresh prompts whose lengths cross the tiled kernel's query tiles (4 or 8) and key tiles
    (16 or 32) and its zero-padded transposed keys; 48 takes the one-query path with AVX-512.
    Many prompts: a task per (prompt, kv head); one prompt: a task per query head."""
    gen = torch.Generator().manual_seed(head_dim)
    num_tokens, num_heads, num_kv_heads, block_size = sum(lens), 9, 3, 16
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 2
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)  # views into qkv, as the model passes them
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    starts, tables, next_block = [0], [], 0
    for n in lens:
        starts.append(starts[-1] + n)
        per_seq = (n + block_size - 1) // block_size
        tables.append(list(range(next_block, next_block + per_seq)))
        next_block += per_seq
    width = max(len(t) for t in tables)
    slots = [b * block_size + i % block_size for t, n in zip(tables, lens) for i, b in enumerate(t[j // block_size] for j in range(n))]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        seq_lens_tensor=torch.tensor(lens),
        query_start_loc=starts,
        seq_lens=lens,
        num_computed=[0] * len(lens),
        num_prefills=sum(1 for n in lens if n > 1),  # a 1-token prompt sits last, where decodes go
        block_size=block_size,
    )
    caches = [torch.zeros(next_block, block_size, num_kv_heads, head_dim) for _ in range(4)]
    got = CpuPagedAttention().forward(q, k, v, caches[0], caches[1], meta, head_dim**-0.5)
    want = ReferenceAttention().forward(q, k, v, caches[2], caches[3], meta, head_dim**-0.5)
    # rows of up to 257 keys, summed in other orders than torch's: a little above float32's 1e-5
    torch.testing.assert_close(got, want, rtol=3e-5, atol=3e-5)
