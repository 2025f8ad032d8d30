"""Weight-only int8 and int4 for float checkpoints (``EngineConfig.quantization="int8"`` / ``"int4"``).

Every linear layer's float weight is rounded once, at load, to integers in
groups of ``group`` consecutive inputs of one output channel, each group
with its own float32 scale, and only those blocks are kept (no float32
copy)::

    int8, symmetric:    scale = max |w| / 127            q = round(w / scale) in [-127, 127]
                        w' = scale * q
    int4, asymmetric:   scale = (max w - min w) / 15     q = round((w - min w) / scale) in [0, 15]
                        w' = q * scale + min w  (one rounding: an fma)

int4 keeps the group's minimum because 16 levels are few: the grid spans
the group's actual range instead of one symmetric around zero. Measured on
SmolLM2-135M's float weights (groups of 128, or 96 where 128 does not
divide): the rounding error's RMS is 9.96% of the weights' RMS, against
11.21% for the best symmetric grid (GGUF Q4_0's: the extreme maps to -8),
for 4 more bytes a group. int8 per channel is at 0.89% already (a minimum
would take it to 0.83%, groups of 128 to 0.68%), so it keeps one scale a
group, the scheme of the earlier int8 path and of torch's
``_weight_int8pack_mm``.

The blocks are ``kernels/gguf/gguf_blocks.h``'s ``GROUP_I8`` / ``GROUP_I4``, one
row of groups per output channel, ``qweight`` ``[out_features, row bytes]``
uint8::

    GROUP_I8 group:  [scale f32][q int8 x group]                               4 + group bytes
    GROUP_I4 group:  [scale f32][min f32][group / 32 runs of 16 bytes]         8 + group / 2 bytes
                     a run holds 32 q: byte j = q[j] | q[j + 16] << 4 (as GGUF's Q4_0)

and the matmul is ``kernels/gguf/gguf_linear.cpp``'s, the GGUF kernel: strips of
a few channels dequantized into an L1 buffer and multiplied by every row of
the call (prefills), one row dequantized in registers (decode), the same
bits either way. ``group`` is a multiple of 32 dividing ``in_features``: a
layer whose ``in_features`` the asked group size does not divide takes the
largest multiple of 32 below it that does (``layer_group_size``; the loader
warns, naming the layers). The token embedding is held the same way
(``QuantizedEmbeddingMethod``); a tied LM head and the embedding share one set of
blocks.

A load gives each layer, as it is built on the meta device,
``QuantizedLinearMethod`` / ``QuantizedEmbeddingMethod`` (the quantization
config's answer, ``layers/quantization/quant_config.py``): empty blocks and no float
weight, and the method's ``weight_loader`` quantizes each float tensor into
its rows as it is handed over (``quantize_rows_into``), so the float32
model never exists. Every group lies within one output row, so quantizing a
fused q/k/v or gate/up part by part, or a tensor a few rows at a time, gives
the very bytes that quantizing the whole fused weight gives: no part waits
for the others. The load's peak is then the blocks plus the one checkpoint
tensor being read and the temporaries of a chunk of ``LOAD_CHUNK_BYTES``.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.linear import (
    Linear,
    LinearMethod,
    QuantMethod,
    check_shape,
    layer_shape,
    load_rows,
    replace_parameter,
)
from pagedllm.layers.parallel import EmbeddingMethod
from pagedllm.layers.quantization.gguf_linear import (
    INTERLEAVE_ROWS,  # rows of a tile of kernels/gguf/gguf_x16.h
)

GROUP_RUN = 32  # the kernels read groups in runs of 32 weights (vector loads)
BITS = (4, 8)
# float32 bytes of the rows quantized at once while loading: quantize_groups' float temporaries
# take 4-5x its input at their peak (measured: a load peaks 2.5 MiB above the blocks plus the
# checkpoint tensor with 1 MiB chunks, 13-18 MiB above with 4 MiB, 68 MiB above with 16 MiB)
LOAD_CHUNK_BYTES = 1 << 20


def group_block_bytes(bits: int, group: int) -> int:
    """Bytes of one group of ``group`` weights: the float32 scale (and int4's min), then the quants."""
    return 4 + group if bits == 8 else 8 + group // 2


def layer_group_size(in_features: int, group_size: int | None) -> int:
    """The group a layer of ``in_features`` inputs is quantized in.

    ``group_size`` (a multiple of 32) when it divides ``in_features``, else
    the largest multiple of 32 below it that does; None (per channel): all
    of ``in_features``. ValueError when ``in_features`` is not a multiple
    of 32 (no group fits the kernels' runs).
    """
    if in_features % GROUP_RUN:
        raise ValueError(f"in_features={in_features} is not a multiple of {GROUP_RUN}: "
                         "the int8/int4 kernels take groups of whole runs of 32 weights")
    if group_size is None:
        return in_features
    group = min(group_size, in_features) // GROUP_RUN * GROUP_RUN
    while in_features % group:
        group -= GROUP_RUN
    return group


def quantize_groups(
    weight: torch.Tensor, bits: int, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round ``weight`` ``[N, K]`` in groups of ``group`` inputs: (q, scales, mins).

    q ``[N, K]`` (int8 in [-127, 127] for 8 bits, uint8 in [0, 15] for 4),
    scales and mins ``[N, K / group]`` float32 (mins None for 8 bits).
    """
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group, group)  # [N, groups, group]
    if bits == 8:
        scales = w.abs().amax(dim=2).clamp(min=1e-30) / 127.0  # [N, groups]
        q = torch.round(w / scales.unsqueeze(2)).clamp(-127, 127).to(torch.int8)
        return q.reshape(n, k), scales, None
    mins = w.amin(dim=2)  # [N, groups]
    scales = ((w.amax(dim=2) - mins) / 15.0).clamp(min=1e-30)  # a constant group: q = 0, w' = min
    q = torch.round((w - mins.unsqueeze(2)) / scales.unsqueeze(2)).clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), scales, mins


def pack_groups(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int) -> torch.Tensor:
    """The ``GROUP_I8`` / ``GROUP_I4`` blocks of ``quantize_groups``' output: uint8 ``[N, row bytes]``."""
    n, num_groups = scales.shape
    group = q.shape[1] // num_groups
    header = scales if mins is None else torch.stack([scales, mins], dim=2)  # [N, groups(, 2)] float32
    header = header.contiguous().view(torch.uint8).reshape(n, num_groups, -1)  # [N, groups, 4 or 8]
    if bits == 8:
        quants = q.view(torch.uint8).reshape(n, num_groups, group)
    else:
        runs = q.reshape(n, num_groups, group // GROUP_RUN, GROUP_RUN)
        quants = (runs[..., :16] | (runs[..., 16:] << 4)).reshape(n, num_groups, group // 2)
    return torch.cat([header, quants], dim=2).reshape(n, -1).contiguous()


def quantize_rows_into(blocks: torch.Tensor, weight: torch.Tensor, bits: int, group: int) -> None:
    """Write the blocks of float ``weight`` ``[rows, K]`` (any float dtype, any strides) into ``blocks``
    ``[rows, row bytes]``, ``LOAD_CHUNK_BYTES`` of float32 rows at a time.

    Byte for byte ``pack_groups(*quantize_groups(weight, bits, group), bits)``: a group never spans rows,
    and a checkpoint's bf16 / f16 values widen to float32 exactly, as a copy into a float32 parameter would.
    ValueError when the shapes do not agree.
    """
    rows, k = weight.shape
    if k % group or tuple(blocks.shape) != (rows, k // group * group_block_bytes(bits, group)):
        raise ValueError(f"a [{rows}, {k}] weight in int{bits} groups of {group} does not fit blocks "
                         f"{tuple(blocks.shape)}")
    step = max(1, LOAD_CHUNK_BYTES // (4 * k))
    for start in range(0, rows, step):
        part = weight[start : start + step]
        blocks[start : start + part.shape[0]] = pack_groups(*quantize_groups(part, bits, group), bits)


class _GroupedBlocks(QuantMethod):
    """Grouped int8 / int4 blocks ``qweight`` ``[rows, row bytes]`` in place of a layer's float weight, the
    checkpoint's float rows quantized into them as they arrive.

    ``group_size``: weights per group, a multiple of 32 (None: one group per
    row); each layer uses ``layer_group_size`` of it, kept as ``layer.group_size``.
    """

    def __init__(self, bits: int, group_size: int | None) -> None:
        if bits not in BITS:
            raise ValueError(f"bits must be 4 or 8, got {bits!r}")
        if group_size is not None and (group_size < GROUP_RUN or group_size % GROUP_RUN):
            raise ValueError(f"group_size must be a positive multiple of {GROUP_RUN} or None, got {group_size!r}")
        self.bits, self.group_size = bits, group_size
        self.name = f"int{bits}"

    def create_weights(self, layer: nn.Module) -> None:
        """Before loading (on the meta device): empty blocks in place of ``layer.weight``, on its device."""
        rows, in_features = layer_shape(layer)
        group = layer_group_size(in_features, self.group_size)
        blocks = torch.empty(rows, in_features // group * group_block_bytes(self.bits, group), dtype=torch.uint8,
                             device=layer.weight.device)
        replace_parameter(layer, "weight", None)
        replace_parameter(layer, "qweight", blocks)  # [rows, row bytes]
        layer.group_size, layer.interleaved = group, False  # the groups' own order until interleaved

    def weight_loader(self, layer: nn.Module, name: str, tensor: torch.Tensor, offset: int, rows: int | None) -> None:
        """A float checkpoint weight (or a fused part's rows) rounded into ``layer.qweight``; other tensors copied."""
        if name != "weight" or not tensor.is_floating_point():
            load_rows(layer, name, tensor, offset, rows)
            return
        dest = layer.qweight if rows is None else layer.qweight.narrow(0, offset, rows)
        check_shape(tensor, (dest.shape[0], layer_shape(layer)[1]))
        quantize_rows_into(dest, tensor, self.bits, layer.group_size)


class QuantizedLinearMethod(_GroupedBlocks, LinearMethod):
    """Grouped int8 / int4 blocks in ``layer.qweight``; the native kernel multiplies.

    ``interleave``: interleave the blocks 16 rows at a time after loading
    (``gguf_activations="int8"``: ``kernels/gguf/gguf_x16.h``'s integer dot products
    on activations rounded to int8 per block of 32; rows that are not tiles of
    16 keep the groups' order; a tied embedding then looks its rows up in the
    new order).
    """

    def __init__(self, bits: int, group_size: int | None, interleave: bool = False) -> None:
        super().__init__(bits, group_size)
        self.interleave = interleave

    def tie_weights(self, layer: Linear, embedding: nn.Module) -> None:
        """The head multiplies by the embedding's blocks (held once): both have ``embedding_dim`` inputs, so the
        one table is what quantizing either would make."""
        if embedding.qweight.shape[1:] != (layer.in_features // embedding.group_size
                                           * group_block_bytes(self.bits, embedding.group_size),):
            raise ValueError(f"a tied LM head of {layer.in_features} inputs cannot share the embedding's blocks "
                             f"{tuple(embedding.qweight.shape)} (group {embedding.group_size})")
        replace_parameter(layer, "weight", None)
        layer.register_buffer("qweight", embedding.qweight)
        layer.group_size, layer.interleaved = embedding.group_size, embedding.interleaved

    def process_weights_after_loading(self, layer: Linear) -> None:
        replace_parameter(layer, "bias", None if layer.bias is None else layer.bias.detach().float().contiguous())
        if self.interleave and layer.out_features % INTERLEAVE_ROWS == 0:
            torch.ops.pagedllm.quantized_interleave_(layer.qweight, self.bits, layer.group_size, layer.in_features)
            layer.interleaved = True
            tied = layer.__dict__.get("tied_embedding")
            if tied is not None:  # the table is the embedding's too (a tied head): it reads the new order
                tied.interleaved = True

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise ValueError(f"int{self.bits} linear layers compute in float32, got {x.dtype}")
        rows = x.reshape(-1, layer.in_features).contiguous()  # [num_rows, in_features]
        out = torch.ops.pagedllm.quantized_linear(rows, layer.qweight, self.bits, layer.group_size,
                                                  layer.in_features, layer.bias, layer.interleaved)
        return out.view(*x.shape[:-1], layer.out_features)


class QuantizedEmbeddingMethod(_GroupedBlocks, EmbeddingMethod):
    """A token embedding held as grouped int8 / int4 blocks (``qweight`` ``[vocab rows, row bytes]``, grouped as a
    linear layer of ``embedding_dim`` inputs would be); rows come out float32."""

    def embedding(self, layer: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).contiguous()  # [num_tokens]
        out = torch.ops.pagedllm.quantized_embedding(layer.qweight, self.bits, layer.group_size, layer.embedding_dim,
                                                     flat, layer.interleaved)
        return out.view(*ids.shape, layer.embedding_dim)


def group_fallbacks(model: nn.Module, group_size: int | None) -> dict[int, list[str]]:
    """Layers whose ``in_features`` ``group_size`` does not divide: the group each takes -> their names.

    ValueError naming the layer when one cannot be quantized at all
    (``in_features`` not a multiple of 32).
    """
    found: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        try:
            group = layer_group_size(layer_shape(module)[1], group_size)
        except ValueError as e:
            raise ValueError(f"{name} cannot be quantized: {e}") from None
        if group_size is not None and group != group_size:
            found.setdefault(group, []).append(name)
    return found
