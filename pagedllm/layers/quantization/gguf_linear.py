"""Linear layers and embeddings over GGUF's quantized blocks, kept as the file stores them.

A GGUF tensor of type Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K to Q6_K, IQ4_NL, IQ4_XS,
MXFP4, F16 or BF16 is
held as its bytes, ``qweight`` ``[rows, in_features / block weights * block
bytes]`` uint8 (one row per output channel, its blocks back to back), and
multiplied by
``kernels/gguf/gguf_linear.cpp``, which dequantizes in registers and a
cache-sized strip at a time: nothing float32 of the weight is kept. The
bundled SmolLM2 (Q4_1 layers, a Q8_0 embedding tied to the LM head) holds
~98 MB of weights this way against 538 MB dequantized.

The quantization config (``layers/quantization/quant_config.py``) gives a layer whose
checkpoint tensors all have a type with a kernel ``gguf_method``'s answer
when it is built: ``GGUFLinearMethod`` (one type), ``GGUFPartsLinearMethod``
(a fused layer of mixed types) or, for the token embedding,
``GGUFEmbeddingMethod``; each makes a ``qweight`` buffer of the right size in
place of the float weight, the file's bytes are loaded into it, and with
``gguf_activations="int8"`` it is interleaved after loading. A tied LM head
shares the embedding's bytes.
"""

from __future__ import annotations

from collections.abc import Mapping

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
from pagedllm.layers.weights import FusedMap, fused_part

# ggml's type numbers -> (name, weights per block, bytes per block): the types kernels/gguf/gguf_blocks.h reads
GGUF_KERNEL_TYPES: dict[int, tuple[str, int, int]] = {
    1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 30: ("BF16", 1, 2),
    # the non-linear 4-bit types: nibbles indexing a table of 16 int8 values (kernels/gguf/gguf_blocks.h)
    20: ("IQ4_NL", 32, 18), 23: ("IQ4_XS", 256, 136), 39: ("MXFP4", 32, 17),
}
GGUF_BLOCK = 32  # every row the kernels take is whole runs of 32 weights (vector loads)
# Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the k-quants Q2_K to Q6_K, IQ4_NL, IQ4_XS and MXFP4 interleaved 16 rows at a time
# (kernels/gguf/gguf_x16.h): ggml type -> the kernels' number for it
GGUF_INTERLEAVED: dict[int, int] = {t: 512 + t for t in (2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23, 39)}
GGUF_KERNEL_TYPES.update({x16: GGUF_KERNEL_TYPES[t] for t, x16 in GGUF_INTERLEAVED.items()})  # the same blocks
INTERLEAVE_ROWS = 16


def gguf_row_bytes(ggml_type: int, in_features: int) -> int:
    """Bytes of one row of ``in_features`` weights in ``ggml_type``; ValueError for a type with no kernel."""
    if ggml_type not in GGUF_KERNEL_TYPES:
        raise ValueError(f"no GGUF kernel for tensor type {ggml_type}; kernels exist for "
                         f"{sorted(name for name, _, _ in GGUF_KERNEL_TYPES.values())}")
    name, block_weights, block_bytes = GGUF_KERNEL_TYPES[ggml_type]
    if in_features % max(block_weights, GGUF_BLOCK):
        raise ValueError(f"a {name} row of {in_features} weights is not whole runs of {max(block_weights, GGUF_BLOCK)}")
    return in_features // block_weights * block_bytes


def gguf_kernel_takes(ggml_type: int, in_features: int) -> bool:
    """Whether the kernels multiply rows of ``in_features`` weights stored in ``ggml_type``."""
    try:
        gguf_row_bytes(ggml_type, in_features)
    except ValueError:
        return False
    return True


def _type_name(ggml_type: int) -> str:
    """"q4_1", or "q4_1-x16" for the interleaved layout."""
    return GGUF_KERNEL_TYPES[ggml_type][0].lower() + ("-x16" if ggml_type in GGUF_INTERLEAVED.values() else "")


def _interleave_table(qweight: torch.Tensor, ggml_type: int, in_features: int) -> int:
    """Interleave ``qweight`` ``[rows, row bytes]`` 16 rows at a time in place where its type and rows allow;
    returns the type it now holds (the same bytes in ``kernels/gguf/gguf_x16.h``'s order: 2-3x the file order's
    speed for one row on activations rounded to int8 per block of 32, as llama.cpp does)."""
    if ggml_type not in GGUF_INTERLEAVED or qweight.shape[0] % INTERLEAVE_ROWS:
        return ggml_type
    torch.ops.pagedllm.gguf_interleave_(qweight, ggml_type, in_features)
    return GGUF_INTERLEAVED[ggml_type]


class _GGUFTable(QuantMethod):
    """A layer's weight as GGUF blocks of one ``ggml_type``, ``layer.qweight`` ``[rows, row bytes]`` uint8.

    ``interleave``: interleave the blocks after loading (``gguf_activations="int8"``); ``stored_names``: the
    checkpoint tensors it takes as their bytes.
    """

    def __init__(self, ggml_type: int, interleave: bool = False, stored_names: tuple[str, ...] = ()) -> None:
        if ggml_type not in GGUF_KERNEL_TYPES:
            gguf_row_bytes(ggml_type, GGUF_BLOCK)  # raises, naming the types with a kernel
        self.ggml_type, self.interleave, self.stored_names = ggml_type, interleave, stored_names

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"gguf-{_type_name(self.ggml_type)}"

    def create_weights(self, layer: nn.Module) -> None:
        rows, in_features = layer_shape(layer)
        device = layer.weight.device
        replace_parameter(layer, "weight", None)
        shape = (rows, gguf_row_bytes(self.ggml_type, in_features))  # [rows, row bytes]
        layer.register_buffer("qweight", torch.empty(shape, dtype=torch.uint8, device=device))

    def weight_loader(self, layer: nn.Module, name: str, tensor: torch.Tensor, offset: int, rows: int | None) -> None:
        load_rows(layer, "qweight" if name == "weight" else name, tensor, offset, rows)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.interleave:  # an embedding's before a tied head takes the table: it reads the new order too
            self.ggml_type = _interleave_table(layer.qweight, self.ggml_type, layer_shape(layer)[1])


class GGUFLinearMethod(_GGUFTable, LinearMethod):
    """``layer.qweight`` in GGUF blocks of ``ggml_type``, multiplied by the native GGUF kernel (float32 in and out)."""

    def tie_weights(self, layer: Linear, embedding: nn.Module) -> None:
        replace_parameter(layer, "weight", None)
        layer.register_buffer("qweight", embedding.qweight)
        self.ggml_type = embedding.quant_method.ggml_type  # interleaved by the embedding already, or not

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise ValueError(f"GGUF linear layers compute in float32, got {x.dtype}")
        rows = x.reshape(-1, layer.in_features).contiguous()  # [num_rows, in_features]
        out = torch.ops.pagedllm.gguf_linear(rows, layer.qweight, self.ggml_type, layer.in_features, layer.bias)
        return out.view(*x.shape[:-1], layer.out_features)


class GGUFPartsLinearMethod(LinearMethod):
    """A fused layer (q/k/v, gate/up) whose checkpoint parts a GGUF file stores in different types.

    A Q4_K_M file keeps some layers' v_proj in Q6_K beside Q4_K q/k: each
    part's rows stay in its own type, one part after another in one flat
    buffer, ``layer.qweight`` uint8 ``[sum of the parts' bytes]``::

        qweight   [ q rows (Q4_K) | k rows (Q4_K) | v rows (Q6_K) ]
        y         [ y_q           | y_k           | y_v           ]   one gguf_linear each, joined

    ``parts``: ``(row offset, rows, ggml type)`` of each part, by offset, covering the layer's rows;
    ``interleave`` and ``stored_names`` as ``GGUFLinearMethod``'s.
    """

    def __init__(
        self, parts: list[tuple[int, int, int]], in_features: int, interleave: bool = False,
        stored_names: tuple[str, ...] = (),
    ) -> None:
        self.in_features, self.interleave_after_loading, self.stored_names = in_features, interleave, stored_names
        self.parts: list[tuple[int, int, int]] = []
        self.byte_offsets: list[int] = []
        start = 0
        for offset, rows, ggml_type in sorted(parts):
            if offset != (self.parts[-1][0] + self.parts[-1][1] if self.parts else 0):
                raise ValueError(f"the parts of a fused GGUF layer must cover its rows in turn, got {sorted(parts)}")
            self.parts.append((offset, rows, ggml_type))
            self.byte_offsets.append(start)
            start += rows * gguf_row_bytes(ggml_type, in_features)
        self.num_bytes = start

    @property
    def name(self) -> str:  # type: ignore[override]
        return "gguf-" + "+".join(_type_name(t) for _, _, t in self.parts)

    def create_weights(self, layer: Linear) -> None:
        device = layer.weight.device
        replace_parameter(layer, "weight", None)
        layer.register_buffer("qweight", torch.empty(self.num_bytes, dtype=torch.uint8, device=device))  # [bytes]

    def weight_loader(self, layer: nn.Module, name: str, tensor: torch.Tensor, offset: int, rows: int | None) -> None:
        if name != "weight":
            load_rows(layer, name, tensor, offset, rows)
            return
        dest = self.qweight_rows(layer, offset, layer.out_features if rows is None else rows)
        check_shape(tensor, dest.shape)
        dest.copy_(tensor)

    def process_weights_after_loading(self, layer: Linear) -> None:
        if self.interleave_after_loading:
            self.interleave(layer)

    def part_weight(self, layer: Linear, index: int) -> torch.Tensor:
        """Part ``index``'s blocks: a uint8 ``[rows, row bytes]`` view of ``layer.qweight``."""
        _, rows, ggml_type = self.parts[index]
        row_bytes = gguf_row_bytes(ggml_type, self.in_features)
        return layer.qweight.narrow(0, self.byte_offsets[index], rows * row_bytes).view(rows, row_bytes)

    def qweight_rows(self, layer: Linear, offset: int, rows: int) -> torch.Tensor:
        """Where the checkpoint part for rows ``[offset, offset + rows)`` is loaded (layers/weights.py)."""
        for i, (start, size, _) in enumerate(self.parts):
            if (start, size) == (offset, rows):
                return self.part_weight(layer, i)
        raise ValueError(f"no part of rows {offset}..{offset + rows} in {self.parts}")

    def interleave(self, layer: Linear) -> int:
        """Interleave each part whose type has an x16 layout and whose rows are a multiple of 16; returns how many."""
        count = 0
        for i, (offset, rows, ggml_type) in enumerate(self.parts):
            new_type = _interleave_table(self.part_weight(layer, i), ggml_type, self.in_features)
            self.parts[i] = (offset, rows, new_type)
            count += new_type != ggml_type
        return count

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise ValueError(f"GGUF linear layers compute in float32, got {x.dtype}")
        rows = x.reshape(-1, layer.in_features).contiguous()  # [num_rows, in_features]
        outs = []
        for i, (offset, size, ggml_type) in enumerate(self.parts):
            bias = None if layer.bias is None else layer.bias.narrow(0, offset, size)
            outs.append(torch.ops.pagedllm.gguf_linear(rows, self.part_weight(layer, i), ggml_type,
                                                       layer.in_features, bias))  # [num_rows, size]
        return torch.cat(outs, dim=-1).view(*x.shape[:-1], layer.out_features)


class GGUFEmbeddingMethod(_GGUFTable, EmbeddingMethod):
    """A token embedding's table kept in GGUF blocks (``layer.qweight`` ``[vocab rows, row bytes]``); rows come
    out float32."""

    def tied_head_method(self) -> LinearMethod:
        return GGUFLinearMethod(self.ggml_type, self.interleave)

    def embedding(self, layer: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).contiguous()  # [num_tokens]
        out = torch.ops.pagedllm.gguf_embedding(layer.qweight, self.ggml_type, layer.embedding_dim, flat)
        return out.view(*ids.shape, layer.embedding_dim)


def gguf_spans(types: Mapping[str, int], fused: FusedMap) -> dict[str, list[tuple[str, int, int | None, int]]]:
    """The checkpoint's quantized tensors by the parameter they load into: name -> ``(checkpoint name, row
    offset, rows or None for all, ggml type)`` of each part."""
    spans: dict[str, list[tuple[str, int, int | None, int]]] = {}
    for name, ggml_type in types.items():
        target, offset, size, _ = fused_part(name, fused) or (name, 0, None, None)
        spans.setdefault(target, []).append((name, offset, size, ggml_type))
    return spans


def gguf_method(
    layer: nn.Module, parts: list[tuple[str, int, int | None, int]], interleave: bool
) -> LinearMethod | EmbeddingMethod | None:
    """The GGUF method for ``layer`` (a ``Linear`` or an embedding) whose weight's checkpoint parts are
    ``parts`` (``gguf_spans``); None where the kernels cannot take them as stored (a type with no kernel
    for its rows, a row-parallel shard not starting on a block boundary, a fused layer with a part left
    in float, or an embedding of mixed types)."""
    embedding = isinstance(layer, nn.Embedding)
    out_features, in_features = layer_shape(layer)
    kinds = {kind for *_, kind in parts}
    start = getattr(layer, "input_start", 0)
    if not all(gguf_kernel_takes(kind, in_features) and (not start or gguf_kernel_takes(kind, start)) for kind in kinds):
        return None
    spans = sorted((offset, out_features if size is None else size, kind) for _, offset, size, kind in parts)
    if sum(rows for _, rows, _ in spans) != out_features:
        return None
    names = tuple(name for name, *_ in parts)
    if embedding:
        return GGUFEmbeddingMethod(kinds.pop(), interleave, names) if len(kinds) == 1 else None
    if len(kinds) > 1:
        return GGUFPartsLinearMethod(spans, in_features, interleave, names)
    return GGUFLinearMethod(kinds.pop(), interleave, names)


def gguf_types_held(model: nn.Module) -> set[int]:
    """The kernel type numbers of every GGUF tensor ``model`` holds (embedding, linear layers, their parts)."""
    held: set[int] = set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, (GGUFLinearMethod, GGUFEmbeddingMethod)):
            held.add(method.ggml_type)
        elif isinstance(method, GGUFPartsLinearMethod):
            held.update(t for _, _, t in method.parts)
    return held
