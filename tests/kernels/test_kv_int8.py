"""The int8 and fp8 KV caches (``kv_cache_dtype="int8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``): their rows, and
attention read in place over them.

A head row is ``head_dim`` int8 values and the four bytes of one float32
scale (``layers/kv_quant.py``). The native write (``write_kv``) must store
what a float64 reference of the scheme stores (to the one rounding step a
float32 division can move) and exactly what the torch quantizer stores;
decode and prefill attention over int8 blocks must equal float64 attention
over the dequantized K/V. ``tests/kernels/test_kernel_variants.py`` runs
this file under every ISA variant this CPU executes. The fp8 caches have the
same layout with fp8 values; their rows are checked against a float64
reference and against torch's own ``.to(float8_*)`` rounding. The attention
tests run the int4 cache too (``ATTEND_DTYPES``; its rows' own tests:
``test_kv_int4.py``).
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.block_table import slot_mapping
from pagedllm.config import EngineConfig
from pagedllm.kernels import load_kernels
from pagedllm.layers.attention import (
    AttentionMetadata,
    CpuPagedAttention,
    ReferenceAttention,
    SdpaAttention,
)
from pagedllm.layers.kv_quant import (
    FP8_MAX,
    INT8_SCALE_BYTES,
    dequantize_int8_heads,
    quantize_heads,
    quantize_int8_heads,
    stored_values,
)
from pagedllm.loader.model_config import ModelArchConfig
from pagedllm.runner.kv_cache import cache_head_width, kv_bytes_per_block


@pytest.fixture(scope="module")
def ops():  # noqa: ANN201
    lib = load_kernels()
    assert lib is not None, "the native kernels must build on the test machine"
    return lib


# the quantized cache formats with int8's layout: int8, and fp8 E4M3 / E5M2 (kv_cache_dtype "fp8" is E4M3)
QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
# the formats the attention tests read: those and int4 (uint8: rotated nibbles, its kernel rotates the queries
# and its output; the reference is over un-rotated values)
ATTEND_DTYPES = [*QUANT_DTYPES, torch.uint8]


def _native_rows(ops, x: torch.Tensor, dtype: torch.dtype = torch.int8) -> torch.Tensor:  # noqa: ANN001
    """``x`` [tokens, kv_heads, head_dim] written by the native write_kv into scattered slots, read back raw."""
    tokens, heads, head_dim = x.shape
    block_size = 4
    num_blocks = tokens // block_size + 3
    caches = [torch.full((num_blocks, block_size, heads, head_dim + INT8_SCALE_BYTES), 99, dtype=torch.uint8)
              .view(dtype) for _ in range(2)]
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(tokens))[:tokens]
    ops.write_kv(x, x.flip(0), caches[0], caches[1], slots)
    flat = caches[0].view(-1, heads, head_dim + INT8_SCALE_BYTES)
    assert torch.equal(caches[1].view(torch.uint8).view(-1, heads, head_dim + INT8_SCALE_BYTES)[slots],
                       flat.view(torch.uint8)[slots].flip(0))
    return flat[slots]


def _bits(rows: torch.Tensor) -> torch.Tensor:
    """A cache's rows as their bytes (fp8 tensors compare as floats: NaN != NaN, and -0 == 0)."""
    return rows.view(torch.uint8)


def _split(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 head rows -> (values as int64, scales as float32 [..., 1])."""
    head_dim = rows.shape[-1] - INT8_SCALE_BYTES
    return rows[..., :head_dim].long(), rows[..., head_dim:].contiguous().view(torch.float32)


def _rows_to_check() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    head_dim = 64
    x = torch.randn(12, 2, head_dim, generator=gen) * torch.tensor([0.01, 1.0, 30.0, 1e4] * 3).view(12, 1, 1)
    x[0, 0] = 0.0  # a zeros row: scale 0, values 0
    x[1, 0] = 0.0
    x[1, 0, 17] = -250.0  # a single outlier: it gets -127, everything else 0
    x[2, 1, :8] = torch.tensor([1.0, 0.5, -0.5, 1.5, 2.5, -2.5, 127.0, 63.5])  # ties at scale 1
    x[3, 1] = torch.linspace(-1e-30, 1e-30, head_dim)  # tiny but normal values
    return x


def test_native_write_quantizes_like_a_float64_reference(ops) -> None:  # noqa: ANN001
    x = _rows_to_check()
    native = _native_rows(ops, x)
    # the torch quantizer (the SDPA / reference paths, as_stored) stores the same bits
    assert torch.equal(native, quantize_int8_heads(x))
    values, scales = _split(native)
    x64 = x.double()
    amax = x64.abs().amax(-1, keepdim=True)
    # the scale is max|x| / 127 rounded once to float32
    torch.testing.assert_close(scales.double(), (amax / 127).float().double(), rtol=0, atol=0)
    want = torch.where(amax > 0, torch.round(x64 / torch.where(amax > 0, amax / 127, 1.0)), 0.0).long()
    # float32's x / scale may land across a .5 boundary from float64's: at most one step, rarely
    assert (values - want).abs().max().item() <= 1
    assert (values != want).float().mean().item() < 0.01
    assert values.abs().max().item() <= 127 and (values.abs().amax(-1) == 127).sum() == (amax > 0).sum()
    # round trip: within half a step of every value
    back = dequantize_int8_heads(native).double()
    assert ((back - x64).abs() <= scales.double() * 0.5 * (1 + 1e-5) + 1e-45).all()
    # the special rows
    assert (values[0, 0] == 0).all() and scales[0, 0].item() == 0.0 and (back[0, 0] == 0).all()
    assert values[1, 0, 17].item() == -127 and (values[1, 0].count_nonzero().item() == 1)
    assert back[1, 0, 17].item() == pytest.approx(-250.0, rel=1e-6)
    assert values[2, 1, :8].tolist() == [1, 0, 0, 2, 2, -2, 127, 64]  # ties to even: 0.5->0, 1.5->2, 2.5->2, 63.5->64


def test_inf_saturates_and_nan_makes_its_head_nan(ops) -> None:  # noqa: ANN001
    """+-inf is stored as +-65504 (as the float16 cache saturates); a NaN makes its whole head row read NaN,
    and only attention that reads that head is NaN."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2, 16, generator=gen)
    x[0, 0, 3] = float("inf")
    x[0, 1, 5] = float("-inf")
    x[1, 0, 2] = 1e6
    x[2, 1, 7] = float("nan")
    native = _native_rows(ops, x)
    torched = quantize_int8_heads(x)
    back = dequantize_int8_heads(native)
    assert torch.equal(back.isnan(), dequantize_int8_heads(torched).isnan())
    finite = ~back.isnan()
    assert torch.equal(back[finite], dequantize_int8_heads(torched)[finite])
    assert back[0, 0, 3].item() == pytest.approx(65504.0, rel=1e-6) and back[0, 1, 5].item() == pytest.approx(-65504.0, rel=1e-6)
    assert back[1, 0, 2].item() == pytest.approx(65504.0, rel=1e-6)
    assert back[2, 1].isnan().all() and not back[2, 0].isnan().any()
    assert torch.isfinite(back[[0, 1, 3]]).all()
    # attention: the NaN head poisons the query heads that read it (kv head 1: query heads 2, 3), nothing else
    block_size = 4
    k_cache = torch.zeros(2, block_size, 2, 16 + INT8_SCALE_BYTES, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    ops.write_kv(x, torch.randn(4, 2, 16, generator=gen), k_cache, v_cache, torch.tensor([4, 5, 6, 7]))
    q = torch.randn(1, 4, 16, generator=gen) * 1e-3
    out = torch.empty_like(q)
    ops.paged_decode(q, k_cache, v_cache, torch.tensor([[1]]), torch.tensor([4]), 0.25, out, 0)
    assert out[0, 2:].isnan().all() and torch.isfinite(out[0, :2]).all()

def _fp8_grid(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite value of the format as float64, ascending, and whether its code's last bit is 0 (ties go
    there)."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(dtype).double()
    keep = torch.isfinite(values)
    grid = values[keep].unique()
    even = torch.zeros(len(grid), dtype=torch.bool)
    even[torch.searchsorted(grid, values[keep])] = (codes[keep] & 1) == 0  # +0 and -0 both even
    return grid, even


def _round_to_grid(x: torch.Tensor, grid: torch.Tensor, even: torch.Tensor) -> torch.Tensor:
    """float64 ``x`` rounded to the nearest grid value, ties to the one with an even code."""
    x = x.clamp(grid[0], grid[-1])
    idx = torch.searchsorted(grid, x).clamp(1, len(grid) - 1)
    lo, hi = grid[idx - 1], grid[idx]
    pick_hi = (hi - x < x - lo) | ((hi - x == x - lo) & even[idx])
    return torch.where(pick_hi, hi, lo)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_native_fp8_write_matches_torch_and_a_float64_reference(ops, dtype: torch.dtype) -> None:  # noqa: ANN001
    """The native write stores exactly the torch quantizer's bits (torch's own .to(float8) rounding); the
    values are x / scale rounded to the nearest fp8 value (ties to even) of a float64 grid, the scale
    max|x| / FMAX. Rows: random at four magnitudes, zeros, a single outlier, subnormals."""
    fmax = FP8_MAX[dtype]
    min_normal = 2.0**-6 if dtype == torch.float8_e4m3fn else 2.0**-14
    x = _rows_to_check()
    x[4, 0] = torch.linspace(-1, 1, 64) * 2 * min_normal / fmax  # scaled: half of them subnormal
    x[4, 0, 0] = 1.0  # amax: scale 1 / FMAX
    grid, even = _fp8_grid(dtype)
    native = _native_rows(ops, x, dtype)
    assert native.dtype == dtype
    assert torch.equal(_bits(native), _bits(quantize_heads(x, dtype)))
    head_dim = x.shape[-1]
    scales = native[..., head_dim:].contiguous().view(torch.uint8).view(torch.float32).double()
    x64 = x.double()
    amax = x64.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(scales, (amax / fmax).float().double(), rtol=0, atol=0)
    want = _round_to_grid(x64 / torch.where(amax > 0, scales, 1.0), grid, even)
    got = native[..., :head_dim].double()
    # float32's x / scale may cross a midpoint float64's does not: one fp8 step, rarely
    off = got != want
    assert off.float().mean().item() < 0.01
    assert got.abs().amax(-1).eq(torch.where(amax > 0, fmax, 0.0).squeeze(-1)).all()  # amax lands on FMAX
    # round trip: within half a step of the value's binade (relative 2^-(mbits+1)), or half a subnormal step
    back = stored_values(native).double()
    step = 2.0 ** -(3 if dtype == torch.float8_e4m3fn else 2)
    tiny = float(grid[grid > 0].min()) * scales
    assert ((back - x64).abs() <= x64.abs() * step * 0.5 * (1 + 1e-6) + tiny * 0.5 * (1 + 1e-6)).all()
    assert (back[0, 0] == 0).all() and scales[0, 0].item() == 0.0
    assert back[1, 0, 17].item() == pytest.approx(-250.0, rel=1e-6) and back[1, 0].count_nonzero().item() == 1
    sub = got[4, 0, 1:].abs()
    assert ((sub > 0) & (sub < min_normal)).sum().item() > 10 and back[4, 0, 0].item() == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_fp8_inf_saturates_and_nan_makes_its_head_nan(ops, dtype: torch.dtype) -> None:  # noqa: ANN001
    """The int8 rules: +-inf stored as +-65504, a NaN makes its head row read NaN; values never hold NaN / inf."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2, 16, generator=gen)
    x[0, 0, 3] = float("inf")
    x[0, 1, 5] = float("-inf")
    x[2, 1, 7] = float("nan")
    native = _native_rows(ops, x, dtype)
    assert torch.equal(_bits(native), _bits(quantize_heads(x, dtype)))
    assert torch.isfinite(native[..., :16].float()).all()
    back = stored_values(native)
    assert back[0, 0, 3].item() == pytest.approx(65504.0, rel=1e-6)
    assert back[0, 1, 5].item() == pytest.approx(-65504.0, rel=1e-6)
    assert back[2, 1].isnan().all() and not back[2, 0].isnan().any() and torch.isfinite(back[[0, 1, 3]]).all()
    k_cache = torch.zeros(2, 4, 2, 16 + INT8_SCALE_BYTES, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    ops.write_kv(x, torch.randn(4, 2, 16, generator=gen), k_cache, v_cache, torch.tensor([4, 5, 6, 7]))
    q = torch.randn(1, 4, 16, generator=gen) * 1e-3
    out = torch.empty_like(q)
    ops.paged_decode(q, k_cache, v_cache, torch.tensor([[1]]), torch.tensor([4]), 0.25, out, 0)
    assert out[0, 2:].isnan().all() and torch.isfinite(out[0, :2]).all()


@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64])  # 64: the vector loads (simd.h); 16: one value at a time
def test_every_fp8_value_reads_back_exactly(ops, dtype: torch.dtype, head_dim: int) -> None:  # noqa: ANN001
    """The decode kernel's in-register widening (E5M2: float16's top byte; E4M3: shifted into float16 bits,
    times 2^8) reads every finite byte as torch does: one sequence of one token per code, whose output is
    that token's value row."""
    codes = torch.arange(256, dtype=torch.uint8)
    finite = torch.isfinite(codes.view(dtype).float())
    codes = codes[finite]
    n = len(codes)
    k_cache = torch.zeros(n, 1, 1, head_dim + INT8_SCALE_BYTES, dtype=torch.uint8)
    v_cache = torch.zeros_like(k_cache)
    v_cache[:, 0, 0, :head_dim] = codes.view(-1, 1)  # token t's value row: code t in every lane
    one = torch.tensor([1.0], dtype=torch.float32).view(torch.uint8)
    k_cache[:, 0, 0, head_dim:] = one
    v_cache[:, 0, 0, head_dim:] = one
    q = torch.zeros(n, 1, head_dim)
    out = torch.empty_like(q)
    tables, lens = torch.arange(n).view(n, 1), torch.ones(n, dtype=torch.int64)
    ops.paged_decode(q, k_cache.view(dtype), v_cache.view(dtype), tables, lens, 1.0, out, 0)
    assert torch.equal(out[:, 0, :], codes.view(dtype).float().view(-1, 1).expand(n, head_dim))


def _dense64(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_start: int, scale: float) -> torch.Tensor:
    """float64 causal attention; queries at positions q_start..., keys [len, kv_heads, head_dim]."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1)
    v = values.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(q_start, q_start + q.shape[0]).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


# head_dim 64 / 128: the vector path's unrolled sizes; 96: a 32-float tail; 20: the scalar path
# (int4: 96 and 20 rotate in blocks of 32 and 4, the largest powers of two dividing them)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 1, 128, 5),
                                                                        (6, 2, 96, 8), (4, 2, 20, 3)])
@pytest.mark.parametrize("dtype", ATTEND_DTYPES)
def test_decode_over_quantized_blocks_matches_float64(  # noqa: ANN001
    ops, num_heads, num_kv_heads, head_dim, block_size, dtype: torch.dtype
) -> None:
    """Scattered block tables, partial last blocks, sequences sharing their first blocks."""
    gen = torch.Generator().manual_seed(head_dim)
    rng = random.Random(head_dim)
    num_blocks = 400
    raw_k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * 3
    raw_v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    k_cache, v_cache = quantize_heads(raw_k, dtype), quantize_heads(raw_v, dtype)
    keys, values = stored_values(k_cache), stored_values(v_cache)
    seq_lens = [1, block_size - 1, block_size + 1, 4 * block_size + 3, 203]
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    shared = ids[:2]
    tables = []
    for n in seq_lens:
        need = -(-n // block_size)
        tables.append((shared + [ids.pop() for _ in range(need)])[:need])
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    out = torch.empty_like(q)
    ops.paged_decode(q, k_cache, v_cache, block_tables, torch.tensor(seq_lens), scale, out, 0)
    for i, n in enumerate(seq_lens):
        idx = torch.tensor(tables[i])
        ki = keys[idx].flatten(0, 1)[:n]
        vi = values[idx].flatten(0, 1)[:n]
        want = _dense64(q[i : i + 1], ki, vi, n - 1, scale)[0]
        torch.testing.assert_close(out[i].double(), want, rtol=1e-5, atol=1e-5)


def _prefill_meta(lens: list[int], computed: list[int], tables: list[list[int]], block_size: int) -> AttentionMetadata:
    slots, starts = [], [0]
    for n, c, t in zip(lens, computed, tables):
        slots += slot_mapping(t, block_size, c, n)
        starts.append(starts[-1] + n - c)
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64),
        seq_lens_tensor=torch.tensor(lens, dtype=torch.int64),
        query_start_loc=starts, seq_lens=lens, num_computed=computed,
        num_prefills=len(lens), block_size=block_size,
    )


@pytest.mark.parametrize("head_dim", [64, 32])
@pytest.mark.parametrize("dtype", ATTEND_DTYPES)
def test_prefill_whole_and_chunked_over_quantized_blocks_matches_float64(head_dim: int, dtype: torch.dtype) -> None:
    """Fresh prompts (the prefill kernel over the step's rows, as stored) and their continuation in chunks
    (each token a decode query reading the cached int8 / int4 blocks in place) equal float64 attention over the
    dequantized K/V, and each other."""
    gen = torch.Generator().manual_seed(head_dim)
    num_heads, num_kv_heads, block_size, num_blocks = 6, 2, 16, 40
    lens = [37, 70, 16]
    tables = [[5, 30, 2], [11, 3, 25, 7, 19], [33]]
    total = sum(lens)
    q = torch.randn(total, num_heads, head_dim, generator=gen)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen) * 2
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    width = cache_head_width(head_dim, dtype)

    def caches() -> list[torch.Tensor]:
        return [torch.zeros(num_blocks, block_size, num_kv_heads, width, dtype=dtype) for _ in range(2)]

    whole_caches = caches()
    whole = CpuPagedAttention().forward(q, k, v, *whole_caches, _prefill_meta(lens, [0] * 3, tables, block_size), scale)
    # the same prompts in chunks: the first `cut` tokens, then the rest reading them from the cache
    cuts = [20, 33, 9]
    chunk_caches = caches()
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    first = [torch.cat([x[s : s + c] for s, c in zip(starts, cuts)]) for x in (q, k, v)]
    rest = [torch.cat([x[s + c : s + n] for s, c, n in zip(starts, cuts, lens)]) for x in (q, k, v)]
    out1 = CpuPagedAttention().forward(*first, *chunk_caches, _prefill_meta(cuts, [0] * 3, tables, block_size), scale)
    out2 = CpuPagedAttention().forward(*rest, *chunk_caches, _prefill_meta(lens, cuts, tables, block_size), scale)
    assert torch.equal(_bits(whole_caches[0]), _bits(chunk_caches[0]))
    assert torch.equal(_bits(whole_caches[1]), _bits(chunk_caches[1]))
    held_k, held_v = stored_values(quantize_heads(k, dtype, keys=True)), stored_values(quantize_heads(v, dtype))
    o1 = o2 = 0
    for s, c, n in zip(starts, cuts, lens):
        want = _dense64(q[s : s + n], held_k[s : s + n], held_v[s : s + n], 0, scale)
        torch.testing.assert_close(whole[s : s + n].double(), want, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(out1[o1 : o1 + c].double(), want[:c], rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(out2[o2 : o2 + n - c].double(), want[c:], rtol=2e-5, atol=2e-5)
        o1, o2 = o1 + c, o2 + n - c
    # the torch backends over the same quantized cache agree (SDPA and the reference dequantize what they gather)
    for backend in (SdpaAttention(), ReferenceAttention()):
        other = caches()
        got = backend.forward(q, k, v, *other, _prefill_meta(lens, [0] * 3, tables, block_size), scale)
        assert torch.equal(_bits(other[0]), _bits(whole_caches[0]))
        torch.testing.assert_close(got, whole, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_quantized_caches_of_a_wrong_shape_are_refused(ops, dtype: torch.dtype) -> None:  # noqa: ANN001
    q = torch.randn(1, 4, 16)
    table, lens, out = torch.tensor([[0]]), torch.tensor([3]), torch.empty(1, 4, 16)
    plain = torch.zeros(2, 4, 2, 16, dtype=dtype)  # no room for the scales: head_dim 12 to the kernel
    with pytest.raises(ValueError, match="do not fit"):
        ops.paged_decode(q, plain, plain, table, lens, 0.25, out, 0)
    tiny = torch.zeros(2, 4, 2, INT8_SCALE_BYTES, dtype=dtype)
    with pytest.raises(ValueError, match="head_dim \\+ 4"):
        ops.paged_decode(q, tiny, tiny, table, lens, 0.25, out, 0)
    with pytest.raises(ValueError, match=r"k must be \[num_tokens, 2, 12\]"):  # 16 - 4 scale bytes
        ops.write_kv(torch.randn(3, 2, 16), torch.randn(3, 2, 16), plain, plain, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="of one dtype"):
        ops.paged_decode(q, torch.zeros(2, 4, 2, 20, dtype=dtype), torch.zeros(2, 4, 2, 20), table, lens, 0.25,
                         out, 0)
    other = torch.float8_e5m2 if dtype != torch.float8_e5m2 else torch.int8
    with pytest.raises(ValueError, match="of one dtype"):
        ops.paged_decode(q, torch.zeros(2, 4, 2, 20, dtype=dtype), torch.zeros(2, 4, 2, 20, dtype=other), table, lens,
                         0.25, out, 0)


@pytest.mark.parametrize("name", ["int8", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_quantized_cache_is_refused_off_the_cpu(name: str) -> None:
    with pytest.raises(ValueError, match=f"kv_cache_dtype='{name}' is a CPU cache"):
        EngineConfig(model="model.gguf", kv_cache_dtype=name, device="cuda")
    EngineConfig(model="model.gguf", kv_cache_dtype=name)  # the CPU: fine


def test_block_bytes_count_the_scales() -> None:
    """One block: 2 (K, V) x layers x block_size x kv_heads x (head_dim + 4) bytes; the same budget holds
    2 * head_dim / (head_dim + 4) times the blocks of float16."""
    mc = ModelArchConfig(architecture="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                         max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                         tie_word_embeddings=True)
    assert kv_bytes_per_block(mc, 16, torch.int8) == 2 * 30 * 16 * 3 * 68
    for fp8 in FP8_DTYPES:  # the same layout: fp8 bytes, then the float32 scale
        assert kv_bytes_per_block(mc, 16, fp8) == kv_bytes_per_block(mc, 16, torch.int8)
    assert kv_bytes_per_block(mc, 16, torch.float16) == 2 * 30 * 16 * 3 * 64 * 2
    budget = 64 << 20
    assert budget // kv_bytes_per_block(mc, 16, torch.int8) == 342
    assert budget // kv_bytes_per_block(mc, 16, torch.float16) == 182
