"""The int8 and int4 KV caches' rows (``kv_cache_dtype="int8"`` / ``"int4"``), in torch ops.

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

The native write (``kernels/kv_rows.h``) computes the same bits; these
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
    scale  max|r| / 7 (float32)
    q      r / scale rounded to nearest, ties to even, in [-7, 7], stored
           as the nibble q + 8; all 8 (zero) where the scale is 0

and reads back as H (q * scale) (H is symmetric and orthogonal: its own
inverse), so ``dequantize_int4_heads`` returns un-rotated values. Why a
rotation: one scale over a head's raw values spends the 15 levels on its
largest channels; H spreads every channel over the whole block, so the
rotated row's max is a few of its typical sizes. Measured on SmolLM2-135M
(docs/configuration.md): perplexity +38% over float16 without the
rotation, +12% with it. Scores are unchanged
(q . k = Hq . Hk) and so is the weighted sum of values up to one H on the
output, so the native kernel rotates the query, reads the rotated rows
in place and rotates its output back; per-channel scales (the other way
to tame outlier channels) would make a token's stored bits depend on the
other tokens of its block, which batch invariance forbids. A NaN in a
head stores a NaN scale (and zeros), as int8 does. Per block the scale
takes 4 bytes next to head_dim / 2: 4 * head_dim / (head_dim + 8) times
the blocks of float16 (3.56x at head_dim 64, 3.76x at 128).
"""

from __future__ import annotations

import math

import torch

INT8_SCALE_BYTES = 4  # one float32 scale after each head's values
INT4_SCALE_BYTES = 4  # one float32 scale after each head's nibbles
_SATURATE = 65504.0
_INT4_MAX = 7  # symmetric levels -7 .. 7


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
    float32; ``kernels/kv_rows.h`` runs the same float32 operations in the
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


def quantize_int4_heads(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., head_dim]`` as int4 head rows ``[..., head_dim / 2 + 4]`` uint8 (nibbles, then the scale)."""
    r = hadamard(x.float().clamp(-_SATURATE, _SATURATE))  # NaN stays NaN
    scale = r.abs().amax(dim=-1, keepdim=True) / float(_INT4_MAX)  # [..., 1]
    nonzero = scale > 0  # False for 0 and NaN
    q = torch.round(r / torch.where(nonzero, scale, torch.ones_like(scale))).clamp_(-_INT4_MAX, _INT4_MAX)
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


def quantize_heads(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a quantized cache of ``cache_dtype`` stores it: int8 (``torch.int8``) or int4 (``torch.uint8``) rows."""
    return quantize_int4_heads(x) if cache_dtype == torch.uint8 else quantize_int8_heads(x)


def is_quantized(cache_dtype: torch.dtype) -> bool:
    """Whether a cache of ``cache_dtype`` holds quantized rows (int8, int4) rather than floats."""
    return cache_dtype in (torch.int8, torch.uint8)


def kv_format_name(cache_dtype: torch.dtype) -> str:
    """The ``kv_cache_dtype`` a cache tensor of ``cache_dtype`` stores: "int4" for uint8, else the dtype's name."""
    return "int4" if cache_dtype == torch.uint8 else str(cache_dtype).removeprefix("torch.")


def stored_values(cache_rows: torch.Tensor) -> torch.Tensor:
    """Rows read from a cache as values: an int8 / int4 cache's dequantized, any other as they are."""
    if cache_rows.dtype == torch.int8:
        return dequantize_int8_heads(cache_rows)
    if cache_rows.dtype == torch.uint8:
        return dequantize_int4_heads(cache_rows)
    return cache_rows
