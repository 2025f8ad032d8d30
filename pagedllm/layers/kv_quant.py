"""The quantized KV caches' rows (``kv_cache_dtype="int8"``, ``"int4"``, ``"fp8"``), in torch ops.

Each token's K (and V) is stored per KV head as ``head_dim`` int8 values
followed by the four bytes of one float32 scale, symmetric (llama.cpp's
q8_0 idea at head granularity)::

    cache [num_blocks, block_size, num_kv_heads, head_dim + 4]  int8
    head  [q_0 .. q_{head_dim-1} | scale (float32 bytes)]   value_i = q_i * scale

    x      saturated to +-65504 first (float16's largest finite value;
           +-inf becomes +-65504, as a float16 cache does)
    scale  max|x| / 127 in float32
    q      x / scale rounded to nearest, ties to even, in [-127, 127];
           all 0 where the scale is 0 (an all-zero head)

A NaN anywhere in a head is not refused (the write happens inside a step,
and a float cache keeps a NaN as well): the head's scale is stored as NaN
and its values as 0, so the whole head row reads back NaN and the attention
that reads it is NaN, as it would be with a float cache.

The native write (``kernels/attention/kv_rows.h``) computes the same bits; these
functions serve the torch attention paths (the reference and SDPA backends,
softcapped layers) and ``as_stored``. Per block the scales take 4 bytes per
head per token next to head_dim bytes of values: the same bytes hold
2 * head_dim / (head_dim + 4) times the blocks of a float16 cache (1.88x at
head_dim 64, 1.94x at 128) and twice that of a float32 one.

An int4 cache (``torch.uint8``; the cache's dtype names its format) stores
each head row rotated, then as 4-bit values with one float32 scale::

    cache [num_blocks, block_size, num_kv_heads, head_dim / 2 + 4]  uint8
    head  [nibbles (byte i: value 2i low, value 2i + 1 high) | scale (float32 bytes)]

    x      saturated to +-65504 first (+-inf too), as for int8
    r      H x: a Walsh-Hadamard rotation of the head dimension, in blocks
           of b values, b the largest power of two dividing head_dim (all
           of it for 64 or 128; 32-value blocks for 96), normalised by
           1 / sqrt(b), in float32 (``hadamard``)
    scale  max|r| / 7 (float32) for V rows; for K rows max|r| * c / 7, c the
           clip ratio of ``INT4_KEY_CLIPS`` whose levels reconstruct r with
           the least squared error (``keys=True``)
    q      r / scale rounded to nearest, ties to even, in [-7, 7], stored
           as the nibble q + 8; all 8 (zero) where the scale is 0

and reads back as H (q * scale) (H is symmetric and orthogonal: its own
inverse), so ``dequantize_int4_heads`` returns un-rotated values. Why a
rotation: one scale over a head's raw values spends the 15 levels on its
largest channels; H spreads every channel over the whole block, so the
rotated row's max is a few of its typical sizes. Measured on SmolLM2-135M
(docs/configuration.md): perplexity +38% over float16 without the
rotation, +12% with it, +2.6% with the layer's change of variables
(``layers/kv_transform.py``, outside these functions) and the keys'
searched clip. Scores are unchanged
(q . k = Hq . Hk) and so is the weighted sum of values up to one H on the
output, so the native kernel rotates the query, reads the rotated rows
in place and rotates its output back; per-channel scales (the other way
to tame outlier channels) would make a token's stored bits depend on the
other tokens of its block, which batch invariance forbids. A NaN in a
head stores a NaN scale (and zeros), as int8 does. Per block the scale
takes 4 bytes next to head_dim / 2: 4 * head_dim / (head_dim + 8) times
the blocks of float16 (3.56x at head_dim 64, 3.76x at 128).

The fp8 caches (``"fp8_e4m3"``, ``"fp8_e5m2"``; ``"fp8"`` is ``"fp8_e4m3"``,
as in vLLM) have the same layout and rules with fp8 values, the cache tensor
typed ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` (its dtype names the
format; the scale's four bytes are stored in four of its elements)::

    scale  max|x| / FMAX in float32 (FMAX: 448 for E4M3, 57344 for E5M2), so
           the head's largest value lands on the format's largest
    q      x / scale rounded to the format (nearest, ties to even, subnormals
           kept), clamped to +-FMAX: never NaN or inf in the values

A per-token scale, not a plain cast with scale 1: E4M3 saturates at 448 and
flushes below 2^-9, E5M2 keeps 2 mantissa bits over any range; with the
head's amax on FMAX each head uses the whole range whatever its magnitude,
and no calibrated per-tensor scale is needed. The 4 scale bytes per head
cost the same as int8's.
"""

from __future__ import annotations

import math

import torch

INT8_SCALE_BYTES = 4  # one float32 scale after each head's values
INT4_SCALE_BYTES = 4  # one float32 scale after each head's nibbles
_SATURATE = 65504.0
_INT4_MAX = 7  # symmetric levels -7 .. 7
# the clip ratios a key row's int4 scale is chosen from (kernels/attention/kv_rows.h has the same list)
INT4_KEY_CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)
# the fp8 formats' largest finite values
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# the cache dtypes holding quantized head rows (values or int4 nibbles, then a float32 scale's bytes)
QUANTIZED_CACHE_DTYPES = (torch.int8, torch.uint8, *FP8_MAX)


def quantize_int8_heads(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., head_dim]`` as int8 head rows ``[..., head_dim + 4]`` (values, then the float32 scale's bytes)."""
    x32 = x.float().clamp(-_SATURATE, _SATURATE)  # NaN stays NaN
    amax = x32.abs().amax(dim=-1, keepdim=True)  # [..., 1]; NaN where the head holds one
    scale = amax / 127.0
    nonzero = scale > 0  # False for 0 and NaN
    q = torch.round(x32 / torch.where(nonzero, scale, torch.ones_like(scale))).clamp_(-127.0, 127.0)
    q = torch.where(nonzero, q, torch.zeros_like(q)).to(torch.int8)
    scale = torch.where(torch.isnan(scale), torch.full_like(scale, float("nan")), scale).contiguous()
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_int8_heads(rows: torch.Tensor) -> torch.Tensor:
    """int8 head rows ``[..., head_dim + 4]`` back to float32 ``[..., head_dim]`` (value = q * scale)."""
    head_dim = rows.shape[-1] - INT8_SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    return rows[..., :head_dim].float() * scale


def hadamard_block(head_dim: int) -> int:
    """The rotation's block: the largest power of two dividing ``head_dim`` (an int4 cache needs it even)."""
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"an int4 KV cache packs two values a byte: head_dim must be even, got {head_dim}")
    return head_dim & -head_dim


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., head_dim]`` float32 times the normalised Walsh-Hadamard matrix, block by block.

    The fast transform: log2(b) stages of (a + c, a - c) butterflies on pairs
    h apart (h = 1, 2, 4, ...), then one multiply by 1 / sqrt(b) rounded to
    float32; ``kernels/attention/kv_rows.h`` runs the same float32 operations in the
    same order, so both give the same bits. Self-inverse.
    """
    head_dim = x.shape[-1]
    b = hadamard_block(head_dim)
    lead = x.shape[:-1]
    y = x.reshape(*lead, head_dim // b, b)
    h = 1
    while h < b:
        y = y.reshape(*lead, head_dim // b, b // (2 * h), 2, h)
        a, c = y[..., 0, :], y[..., 1, :]
        y = torch.stack([a + c, a - c], dim=-2)
        h *= 2
    return y.reshape(x.shape) * torch.tensor(1.0 / math.sqrt(b), dtype=torch.float32)


def _int4_levels(r: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``r / scale`` rounded to nearest even in [-7, 7] (``scale`` > 0)."""
    return torch.round(r / scale).clamp_(-_INT4_MAX, _INT4_MAX)


def _int4_key_scale(r: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """A key row's scale: ``amax * c / 7`` for the clip ratio ``c`` of ``INT4_KEY_CLIPS`` whose levels
    reconstruct ``r`` with the least squared error (float64 sums; the first, largest, ``c`` on a tie)."""
    def error(scale: torch.Tensor) -> torch.Tensor:  # [..., 1] float64
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        back = _int4_levels(r, safe) * safe  # the values as they read back, float32
        return (r.double() - back.double()).square().sum(dim=-1, keepdim=True)

    best = amax / float(_INT4_MAX)
    best_error = error(best)
    for clip in INT4_KEY_CLIPS[1:]:
        # c / 7 rounded to float32 first, then one multiply: the native kernel's order (kv_rows.h)
        scale = amax * (torch.tensor(clip, dtype=torch.float32) / float(_INT4_MAX))
        e = error(scale)
        better = e < best_error  # False for NaN: a NaN row keeps its NaN scale
        best, best_error = torch.where(better, scale, best), torch.where(better, e, best_error)
    return best


def quantize_int4_heads(x: torch.Tensor, keys: bool = False) -> torch.Tensor:
    """``x`` ``[..., head_dim]`` as int4 head rows ``[..., head_dim / 2 + 4]`` uint8 (nibbles, then the scale);
    ``keys``: the scale searched for the least error (``INT4_KEY_CLIPS``), not the row's max / 7."""
    r = hadamard(x.float().clamp(-_SATURATE, _SATURATE))  # NaN stays NaN
    amax = r.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    scale = _int4_key_scale(r, amax) if keys else amax / float(_INT4_MAX)
    nonzero = scale > 0  # False for 0 and NaN
    q = _int4_levels(r, torch.where(nonzero, scale, torch.ones_like(scale)))
    q = (torch.where(nonzero, q, torch.zeros_like(q)) + 8).to(torch.uint8)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return torch.cat([packed, scale.contiguous().view(torch.uint8)], dim=-1)


def dequantize_int4_heads(rows: torch.Tensor) -> torch.Tensor:
    """int4 head rows ``[..., head_dim / 2 + 4]`` back to float32 ``[..., head_dim]``, un-rotated."""
    half = rows.shape[-1] - INT4_SCALE_BYTES
    scale = rows[..., half:].contiguous().view(torch.float32)  # [..., 1]
    packed = rows[..., :half]
    q = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).float() - 8.0
    return hadamard(q * scale)


def quantize_fp8_heads(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[..., head_dim]`` as fp8 head rows ``[..., head_dim + 4]`` of ``dtype`` (values, then the scale)."""
    fmax = FP8_MAX[dtype]
    x32 = x.float().clamp(-_SATURATE, _SATURATE)  # NaN stays NaN
    amax = x32.abs().amax(dim=-1, keepdim=True)
    scale = amax / fmax
    nonzero = scale > 0  # False for 0 and NaN
    q = (x32 / torch.where(nonzero, scale, torch.ones_like(scale))).clamp_(-fmax, fmax)
    q = torch.where(nonzero, q, torch.zeros_like(q)).to(dtype)  # torch rounds to nearest even
    scale = torch.where(torch.isnan(scale), torch.full_like(scale, float("nan")), scale).contiguous()
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1).view(dtype)


def dequantize_fp8_heads(rows: torch.Tensor) -> torch.Tensor:
    """fp8 head rows ``[..., head_dim + 4]`` back to float32 ``[..., head_dim]`` (value = q * scale)."""
    head_dim = rows.shape[-1] - INT8_SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.uint8).view(torch.float32)  # [..., 1]
    return rows[..., :head_dim].float() * scale


def indexable(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` as a tensor torch's index ops take: an fp8 cache as its bytes (torch has no CPU
    ``index_copy_`` for float8), any other as it is. Copies of bytes move fp8 values and scales alike."""
    return cache.view(torch.uint8) if cache.dtype in FP8_MAX else cache


def quantize_heads(x: torch.Tensor, dtype: torch.dtype, keys: bool = False) -> torch.Tensor:
    """``x`` ``[..., head_dim]`` as a quantized cache of ``dtype`` (one of ``QUANTIZED_CACHE_DTYPES``) stores it:
    int8 (``torch.int8``), int4 (``torch.uint8``) or fp8 rows; ``keys``: K rows (int4 searches their scale)."""
    if dtype == torch.int8:
        return quantize_int8_heads(x)
    return quantize_int4_heads(x, keys) if dtype == torch.uint8 else quantize_fp8_heads(x, dtype)


def is_quantized(cache_dtype: torch.dtype) -> bool:
    """Whether a cache of ``cache_dtype`` holds quantized rows (int8, int4, fp8) rather than floats."""
    return cache_dtype in QUANTIZED_CACHE_DTYPES


_FORMAT_NAMES = {torch.uint8: "int4", torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


def kv_format_name(cache_dtype: torch.dtype) -> str:
    """The ``kv_cache_dtype`` a cache tensor of ``cache_dtype`` stores ("int4" for uint8, "fp8_e4m3" for
    float8_e4m3fn...), else the dtype's name."""
    return _FORMAT_NAMES.get(cache_dtype, str(cache_dtype).removeprefix("torch."))


def stored_values(cache_rows: torch.Tensor) -> torch.Tensor:
    """Rows read from a cache as values: a quantized cache's dequantized, any other as they are."""
    if cache_rows.dtype == torch.int8:
        return dequantize_int8_heads(cache_rows)
    if cache_rows.dtype == torch.uint8:
        return dequantize_int4_heads(cache_rows)
    return dequantize_fp8_heads(cache_rows) if cache_rows.dtype in FP8_MAX else cache_rows
