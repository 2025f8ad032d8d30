"""The int4 KV cache's rows (``kv_cache_dtype="int4"``): the rotation, the quantizer, refusals, block bytes.

A head row is ``head_dim / 2`` bytes of nibbles and the four bytes of one
float32 scale, over the head's values rotated by a normalised
Walsh-Hadamard transform (``layers/kv_quant.py``). The native write
(``write_kv``) must store exactly what the torch quantizer stores, and both
what a float64 reference of the scheme (with an independently built
Hadamard matrix) stores to the one rounding step float32 can move.
Attention over int4 blocks is tested with int8's (``test_kv_int8.py``,
``FORMATS``). ``tests/kernels/test_kernel_variants.py`` runs this file
under every ISA variant this CPU executes.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import EngineConfig
from pagedllm.kernels import load_kernels
from pagedllm.layers.kv_quant import (
    INT4_KEY_CLIPS,
    INT4_SCALE_BYTES,
    dequantize_int4_heads,
    hadamard,
    hadamard_block,
    quantize_int4_heads,
)
from pagedllm.loader.model_config import ModelArchConfig
from pagedllm.runner.kv_cache import cache_head_width, kv_bytes_per_block


@pytest.fixture(scope="module")
def ops():  # noqa: ANN201
    lib = load_kernels()
    assert lib is not None, "the native kernels must build on the test machine"
    return lib


def _hadamard64(n: int) -> torch.Tensor:
    """The n x n Hadamard matrix (n a power of two) in float64, normalised: scipy's, else Sylvester's doubling."""
    try:
        from scipy.linalg import hadamard as scipy_hadamard

        h = torch.from_numpy(scipy_hadamard(n)).double()
    except ImportError:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def _rotation64(head_dim: int) -> torch.Tensor:
    """The whole head's rotation as a float64 matrix: Hadamard blocks on the diagonal."""
    b = head_dim & -head_dim
    return torch.block_diag(*[_hadamard64(b)] * (head_dim // b))


def _native_rows(ops, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """``x`` [tokens, kv_heads, head_dim] written by the native write_kv as K and as V into scattered slots, read
    back raw: (the K rows, the V rows)."""
    tokens, heads, head_dim = x.shape
    block_size, width = 4, cache_head_width(head_dim, torch.uint8)
    num_blocks = tokens // block_size + 3
    caches = [torch.full((num_blocks, block_size, heads, width), 99, dtype=torch.uint8) for _ in range(2)]
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(tokens))[:tokens]
    ops.write_kv(x, x, caches[0], caches[1], slots)
    return caches[0].view(-1, heads, width)[slots], caches[1].view(-1, heads, width)[slots]


def _split(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 head rows -> (the values q in [-7, 7] as int64, in element order; scales float32 [..., 1])."""
    half = rows.shape[-1] - INT4_SCALE_BYTES
    packed = rows[..., :half].long()
    q = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2) - 8
    return q, rows[..., half:].contiguous().view(torch.float32)


@pytest.mark.parametrize("head_dim", [64, 128, 96, 20, 2])
def test_the_rotation_is_an_orthogonal_hadamard_and_its_own_inverse(head_dim: int) -> None:
    x = torch.randn(50, 3, head_dim, generator=torch.Generator().manual_seed(head_dim)) * 10
    r = hadamard(x)
    want = x.double() @ _rotation64(head_dim).T
    torch.testing.assert_close(r.double(), want, rtol=0, atol=1e-5 * want.abs().max().item())
    torch.testing.assert_close(hadamard(r).double(), x.double(), rtol=0, atol=1e-6 * x.abs().max().item())
    assert hadamard_block(head_dim) == head_dim & -head_dim
    with pytest.raises(ValueError, match="head_dim must be even"):
        hadamard_block(63)


def _rows_to_check() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 2, 64, generator=gen) * torch.tensor([0.01, 1.0, 30.0, 1e4] * 3).view(12, 1, 1)
    x[0, 0] = 0.0  # a zeros row: scale 0, values 0
    x[1, 0] = 0.0
    x[1, 0, 17] = -250.0  # a single outlier: rotated, every value is +-250/8, stored exactly as +-7 steps
    x[3, 1] = torch.linspace(-1e-30, 1e-30, 64)  # tiny but normal values
    x[4, 1, :4] = 1e3  # a few large channels among small ones
    return x


def test_native_write_quantizes_like_a_float64_reference(ops) -> None:  # noqa: ANN001
    """V rows: the scale is the rotated row's max / 7 (K rows: the next test)."""
    x = _rows_to_check()
    _, native = _native_rows(ops, x)
    # the torch quantizer (the SDPA / reference paths, as_stored) stores the same bits
    assert torch.equal(native, quantize_int4_heads(x))
    values, scales = _split(native)
    rot = _rotation64(64)
    r64 = x.double() @ rot.T
    amax = r64.abs().amax(-1, keepdim=True)
    # the scale is max|H x| / 7 up to float32's rotation (a few ulp)
    torch.testing.assert_close(scales.double(), amax / 7, rtol=1e-6, atol=0)
    want = torch.where(amax > 0, torch.round(r64 / torch.where(amax > 0, scales.double(), 1.0)), 0.0).long()
    # float32's rotation and division may land across a .5 boundary from float64's: at most one step, rarely
    assert (values - want).abs().max().item() <= 1
    assert (values != want).float().mean().item() < 0.01
    assert values.abs().max().item() <= 7 and (values.abs().amax(-1) == 7).sum() == (amax > 0).sum()
    # round trip: un-rotated values within half a step of every rotated value, in the rotated basis
    back = dequantize_int4_heads(native).double()
    err = (back - x.double()) @ rot.T
    assert (err.abs() <= scales.double() * 0.5 * (1 + 1e-4) + 1e-6 * amax).all()
    # the special rows
    assert (values[0, 0] == 0).all() and scales[0, 0].item() == 0.0 and (back[0, 0] == 0).all()
    assert (values[1, 0].abs() == 7).all() and scales[1, 0].item() == pytest.approx(250 / 8 / 7, rel=1e-6)
    assert back[1, 0, 17].item() == pytest.approx(-250.0, rel=1e-5)
    assert back[1, 0].abs().sort().values[-2].item() < 1e-4


def test_key_rows_take_the_clip_with_the_least_error(ops) -> None:  # noqa: ANN001
    """K rows: of the scales max|H x| * c / 7, c in INT4_KEY_CLIPS, the one whose levels reconstruct the
    rotated row best (float64 here, independently of the kernel); the torch quantizer stores the same bits.
    On Gaussian rows a clip below 1 wins for most rows (a largest value clipped buys finer steps for the
    rest), so the search is not vacuous; a row with one outlier (all rotated values equal) keeps c = 1."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(64, 2, 64, generator=gen, dtype=torch.float64) * 3.0
    x[0, 0] = 0.0
    x[0, 0, 9] = 40.0  # rotated: every value +-5, exact at c = 1
    x = x.float()
    native, _ = _native_rows(ops, x)
    assert torch.equal(native, quantize_int4_heads(x, keys=True))
    values, scales = _split(native)
    r64 = hadamard(x).double()  # the kernel's float32 rotation, widened
    amax = r64.abs().amax(-1, keepdim=True)
    candidates = torch.cat([amax * c / 7 for c in INT4_KEY_CLIPS], dim=-1)  # [tokens, heads, clips]
    q = torch.round(r64.unsqueeze(-2) / candidates.unsqueeze(-1)).clamp(-7, 7)
    errors = (r64.unsqueeze(-2) - q * candidates.unsqueeze(-1)).square().sum(-1)  # [tokens, heads, clips]
    chosen = (scales.double() - candidates).abs().argmin(-1)
    torch.testing.assert_close(scales.double().squeeze(-1), candidates.gather(-1, chosen.unsqueeze(-1)).squeeze(-1),
                               rtol=1e-6, atol=0)
    # the chosen scale's error is the least, up to float32's rounding of the candidates
    assert (errors.gather(-1, chosen.unsqueeze(-1)).squeeze(-1) <= errors.amin(-1) * (1 + 1e-4) + 1e-9).all()
    assert (chosen > 0).float().mean().item() > 0.5
    assert chosen[0, 0].item() == 0 and (values[0, 0].abs() == 7).all()
    # and the searched rows reconstruct better than the max / 7 ones on the whole
    plain = dequantize_int4_heads(quantize_int4_heads(x)).double()
    searched = dequantize_int4_heads(native).double()
    assert (searched - x.double()).square().sum() < 0.9 * (plain - x.double()).square().sum()


def test_inf_saturates_and_nan_makes_its_head_nan(ops) -> None:  # noqa: ANN001
    """+-inf is stored as +-65504 (saturated before the rotation); a NaN makes its whole head row read NaN,
    and only attention that reads that head is NaN."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2, 16, generator=gen)
    x[0, 0, 3] = float("inf")
    x[0, 1, 5] = float("-inf")
    x[1, 0, 2] = 1e6
    x[2, 1, 7] = float("nan")
    native_k, native = _native_rows(ops, x)
    torched = quantize_int4_heads(x)
    assert torch.equal(native, torched)  # the NaN scale's bits too
    assert torch.equal(native_k, quantize_int4_heads(x, keys=True))
    back_k = dequantize_int4_heads(native_k)
    assert back_k[2, 1].isnan().all() and torch.isfinite(back_k[[0, 1, 3]]).all()
    back = dequantize_int4_heads(native)
    assert torch.equal(back[:2], dequantize_int4_heads(quantize_int4_heads(x[:2].clamp(-65504, 65504))))
    assert back[0, 0, 3].item() == pytest.approx(65504.0, rel=1e-3)
    assert back[0, 1, 5].item() == pytest.approx(-65504.0, rel=1e-3)
    assert back[1, 0, 2].item() == pytest.approx(65504.0, rel=1e-3)
    assert back[2, 1].isnan().all() and not back[2, 0].isnan().any()
    assert torch.isfinite(back[[0, 1, 3]]).all()
    # attention: the NaN head poisons the query heads that read it (kv head 1: query heads 2, 3), nothing else
    k_cache = torch.zeros(2, 4, 2, cache_head_width(16, torch.uint8), dtype=torch.uint8)
    v_cache = torch.zeros_like(k_cache)
    ops.write_kv(x, torch.randn(4, 2, 16, generator=gen), k_cache, v_cache, torch.tensor([4, 5, 6, 7]))
    q = torch.randn(1, 4, 16, generator=gen) * 1e-3
    out = torch.empty_like(q)
    ops.paged_decode(q, k_cache, v_cache, torch.tensor([[1]]), torch.tensor([4]), 0.25, out, 0)
    assert out[0, 2:].isnan().all() and torch.isfinite(out[0, :2]).all()


def test_int4_caches_of_a_wrong_shape_are_refused(ops) -> None:  # noqa: ANN001
    q = torch.randn(1, 4, 16)
    table, lens, out = torch.tensor([[0]]), torch.tensor([3]), torch.empty(1, 4, 16)
    plain = torch.zeros(2, 4, 2, 16, dtype=torch.uint8)  # 16 - 4 scale bytes: head_dim 24 to the kernel
    with pytest.raises(ValueError, match="do not fit"):
        ops.paged_decode(q, plain, plain, table, lens, 0.25, out, 0)
    tiny = torch.zeros(2, 4, 2, INT4_SCALE_BYTES, dtype=torch.uint8)
    with pytest.raises(ValueError, match="head_dim / 2 \\+ 4"):
        ops.paged_decode(q, tiny, tiny, table, lens, 0.25, out, 0)
    huge = torch.zeros(1, 1, 1, 1024 // 2 + 1 + INT4_SCALE_BYTES, dtype=torch.uint8)  # head_dim 1026
    with pytest.raises(ValueError, match="at most 1024"):
        ops.paged_decode(torch.randn(1, 1, 1026), huge, huge, table, torch.tensor([1]), 0.25,
                         torch.empty(1, 1, 1026), 0)
    with pytest.raises(ValueError, match=r"k must be \[num_tokens, 2, 24\]"):
        ops.write_kv(torch.randn(3, 2, 16), torch.randn(3, 2, 16), plain, plain, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="of one dtype"):
        ops.paged_decode(q, torch.zeros(2, 4, 2, 12, dtype=torch.uint8), torch.zeros(2, 4, 2, 12, dtype=torch.int8),
                         table, lens, 0.25, out, 0)
    with pytest.raises(ValueError, match="head_dim must be even"):
        cache_head_width(63, torch.uint8)


def test_int4_cache_is_refused_off_the_cpu() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype='int4' is a CPU cache"):
        EngineConfig(model="model.gguf", kv_cache_dtype="int4", device="cuda")
    EngineConfig(model="model.gguf", kv_cache_dtype="int4")  # the CPU: fine


def test_block_bytes_count_the_scales() -> None:
    """One block: 2 (K, V) x layers x block_size x kv_heads x (head_dim / 2 + 4) bytes; the same budget holds
    at least 3.5x the blocks of float16 at SmolLM2's head_dim 64."""
    mc = ModelArchConfig(architecture="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                         max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                         tie_word_embeddings=True)
    assert kv_bytes_per_block(mc, 16, torch.uint8) == 2 * 30 * 16 * 3 * 36
    budget = 64 << 20
    int4_blocks = budget // kv_bytes_per_block(mc, 16, torch.uint8)
    fp16_blocks = budget // kv_bytes_per_block(mc, 16, torch.float16)
    assert (int4_blocks, fp16_blocks) == (647, 182) and int4_blocks >= 3.5 * fp16_blocks
