"""The int8 KV cache (``kv_cache_dtype="int8"``): its rows, and attention read in place over them.

A head row is ``head_dim`` int8 values and the four bytes of one float32
scale (``layers/kv_quant.py``). The native write (``write_kv``) must store
what a float64 reference of the scheme stores (to the one rounding step a
float32 division can move) and exactly what the torch quantizer stores;
decode and prefill attention over int8 blocks must equal float64 attention
over the dequantized K/V. The attention tests run the int4 cache too
(``FORMATS``; its rows' own tests: ``test_kv_int4.py``).
``tests/kernels/test_kernel_variants.py`` runs this file under every ISA
variant this CPU executes.
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
    INT4_SCALE_BYTES,
    INT8_SCALE_BYTES,
    dequantize_int4_heads,
    dequantize_int8_heads,
    quantize_int4_heads,
    quantize_int8_heads,
)
from pagedllm.loader.model_config import ModelArchConfig
from pagedllm.runner.kv_cache import kv_bytes_per_block


@pytest.fixture(scope="module")
def ops():  # noqa: ANN201
    lib = load_kernels()
    assert lib is not None, "the native kernels must build on the test machine"
    return lib


# each quantized cache format: its tensor dtype, quantizer, dequantizer and a head row's width for a head_dim
FORMATS = {
    "int8": (torch.int8, quantize_int8_heads, dequantize_int8_heads, lambda d: d + INT8_SCALE_BYTES),
    "int4": (torch.uint8, quantize_int4_heads, dequantize_int4_heads, lambda d: d // 2 + INT4_SCALE_BYTES),
}


def _native_rows(ops, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """``x`` [tokens, kv_heads, head_dim] written by the native write_kv into scattered slots, read back raw."""
    tokens, heads, head_dim = x.shape
    block_size = 4
    num_blocks = tokens // block_size + 3
    caches = [torch.full((num_blocks, block_size, heads, head_dim + INT8_SCALE_BYTES), 99, dtype=torch.int8)
              for _ in range(2)]
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(tokens))[:tokens]
    ops.write_kv(x, x.flip(0), caches[0], caches[1], slots)
    flat = caches[0].view(-1, heads, head_dim + INT8_SCALE_BYTES)
    assert torch.equal(caches[1].view(-1, heads, head_dim + INT8_SCALE_BYTES)[slots], flat[slots].flip(0))
    return flat[slots]


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
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 1, 128, 5),
                                                                        (6, 2, 96, 8), (4, 2, 20, 3)])
def test_decode_over_int8_blocks_matches_float64(ops, num_heads, num_kv_heads, head_dim, block_size, fmt) -> None:  # noqa: ANN001
    """Scattered block tables, partial last blocks, sequences sharing their first blocks (int8 and int4 blocks:
    an int4 cache's kernel rotates the queries and its output, the reference is over un-rotated values)."""
    _, quantize, dequantize, _ = FORMATS[fmt]
    gen = torch.Generator().manual_seed(head_dim)
    rng = random.Random(head_dim)
    num_blocks = 400
    raw_k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * 3
    raw_v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    k_cache, v_cache = quantize(raw_k), quantize(raw_v)
    keys, values = dequantize(k_cache), dequantize(v_cache)
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


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("head_dim", [64, 32])
def test_prefill_whole_and_chunked_over_int8_blocks_matches_float64(head_dim: int, fmt: str) -> None:
    """Fresh prompts (the prefill kernel over the step's rows, as stored) and their continuation in chunks
    (each token a decode query reading the cached int8 / int4 blocks in place) equal float64 attention over the
    dequantized K/V, and each other."""
    cache_dtype, quantize, dequantize, row_width = FORMATS[fmt]
    gen = torch.Generator().manual_seed(head_dim)
    num_heads, num_kv_heads, block_size, num_blocks = 6, 2, 16, 40
    lens = [37, 70, 16]
    tables = [[5, 30, 2], [11, 3, 25, 7, 19], [33]]
    total = sum(lens)
    q = torch.randn(total, num_heads, head_dim, generator=gen)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen) * 2
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    width = row_width(head_dim)

    def caches() -> list[torch.Tensor]:
        return [torch.zeros(num_blocks, block_size, num_kv_heads, width, dtype=cache_dtype) for _ in range(2)]

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
    assert torch.equal(whole_caches[0], chunk_caches[0]) and torch.equal(whole_caches[1], chunk_caches[1])
    held_k, held_v = dequantize(quantize(k)), dequantize(quantize(v))
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
        assert torch.equal(other[0], whole_caches[0])
        torch.testing.assert_close(got, whole, rtol=2e-5, atol=2e-5)


def test_int8_caches_of_a_wrong_shape_are_refused(ops) -> None:  # noqa: ANN001
    q = torch.randn(1, 4, 16)
    table, lens, out = torch.tensor([[0]]), torch.tensor([3]), torch.empty(1, 4, 16)
    plain = torch.zeros(2, 4, 2, 16, dtype=torch.int8)  # no room for the scales: head_dim 12 to the kernel
    with pytest.raises(ValueError, match="do not fit"):
        ops.paged_decode(q, plain, plain, table, lens, 0.25, out, 0)
    tiny = torch.zeros(2, 4, 2, INT8_SCALE_BYTES, dtype=torch.int8)
    with pytest.raises(ValueError, match="head_dim \\+ 4"):
        ops.paged_decode(q, tiny, tiny, table, lens, 0.25, out, 0)
    with pytest.raises(ValueError, match=r"k must be \[num_tokens, 2, 12\]"):  # 16 - 4 scale bytes
        ops.write_kv(torch.randn(3, 2, 16), torch.randn(3, 2, 16), plain, plain, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="of one dtype"):
        ops.paged_decode(q, torch.zeros(2, 4, 2, 20, dtype=torch.int8), torch.zeros(2, 4, 2, 20), table, lens, 0.25,
                         out, 0)


def test_int8_cache_is_refused_off_the_cpu() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' is a CPU cache"):
        EngineConfig(model="model.gguf", kv_cache_dtype="int8", device="cuda")
    EngineConfig(model="model.gguf", kv_cache_dtype="int8")  # the CPU: fine


def test_block_bytes_count_the_scales() -> None:
    """One block: 2 (K, V) x layers x block_size x kv_heads x (head_dim + 4) bytes; the same budget holds
    2 * head_dim / (head_dim + 4) times the blocks of float16."""
    mc = ModelArchConfig(architecture="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                         max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                         tie_word_embeddings=True)
    assert kv_bytes_per_block(mc, 16, torch.int8) == 2 * 30 * 16 * 3 * 68
    assert kv_bytes_per_block(mc, 16, torch.float16) == 2 * 30 * 16 * 3 * 64 * 2
    budget = 64 << 20
    assert budget // kv_bytes_per_block(mc, 16, torch.int8) == 342
    assert budget // kv_bytes_per_block(mc, 16, torch.float16) == 182
