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

The blocks are ``kernels/gguf_blocks.h``'s ``GROUP_I8`` / ``GROUP_I4``, one
row of groups per output channel, ``qweight`` ``[out_features, row bytes]``
uint8::

    GROUP_I8 group:  [scale f32][q int8 x group]                               4 + group bytes
    GROUP_I4 group:  [scale f32][min f32][group / 32 runs of 16 bytes]         8 + group / 2 bytes
                     a run holds 32 q: byte j = q[j] | q[j + 16] << 4 (as GGUF's Q4_0)

and the matmul is ``kernels/gguf_linear.cpp``'s, the GGUF kernel: strips of
a few channels dequantized into an L1 buffer and multiplied by every row of
the call (prefills), one row dequantized in registers (decode), the same
bits either way. ``group`` is a multiple of 32 dividing ``in_features``: a
layer whose ``in_features`` the asked group size does not divide takes the
largest multiple of 32 below it that does (``layer_group_size``; the loader
warns, naming the layers). The token embedding is held the same way
(``QuantizedEmbedding``); a tied LM head and the embedding share one set of
blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.linear import Linear, LinearMethod, apply_linear_method, replace_parameter
from pagedllm.layers.parallel import TensorParallelGroup, vocab_parallel_lookup

GROUP_RUN = 32  # the kernels read groups in runs of 32 weights (vector loads)
BITS = (4, 8)


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


def unpack_groups(
    blocks: torch.Tensor, bits: int, group: int, in_features: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``pack_groups`` undone: (q ``[N, K]``, scales ``[N, K / group]``, mins or None)."""
    n, num_groups = blocks.shape[0], in_features // group
    b = blocks.reshape(n, num_groups, group_block_bytes(bits, group))
    head = 4 if bits == 8 else 8
    header = b[..., :head].contiguous().view(torch.float32)  # [N, groups, 1 or 2]
    scales, mins = header[..., 0].contiguous(), None if bits == 8 else header[..., 1].contiguous()
    if bits == 8:
        return b[..., head:].contiguous().view(torch.int8).reshape(n, in_features), scales, mins
    packed = b[..., head:].reshape(n, num_groups, group // GROUP_RUN, 16)
    q = torch.cat([packed & 0x0F, packed >> 4], dim=3)  # [N, groups, runs, 32]
    return q.reshape(n, in_features), scales, mins


def dequantize_groups(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    """The weights the blocks hold, ``[N, K]`` float64 (the kernels round each to float32 once)."""
    n, k = q.shape
    groups = q.double().reshape(n, scales.shape[1], -1) * scales.double().unsqueeze(2)  # [N, groups, group]
    if mins is not None:
        groups = groups + mins.double().unsqueeze(2)
    return groups.reshape(n, k)


class QuantizedLinearMethod(LinearMethod):
    """Grouped int8 / int4 blocks in ``layer.qweight``, made from the loaded weight; the native kernel multiplies.

    ``group_size``: weights per group, a multiple of 32 (None: one group per
    output channel); each layer uses ``layer_group_size`` of it, kept as
    ``layer.group_size``.
    """

    def __init__(self, bits: int, group_size: int | None) -> None:
        if bits not in BITS:
            raise ValueError(f"bits must be 4 or 8, got {bits!r}")
        if group_size is not None and (group_size < GROUP_RUN or group_size % GROUP_RUN):
            raise ValueError(f"group_size must be a positive multiple of {GROUP_RUN} or None, got {group_size!r}")
        self.bits, self.group_size = bits, group_size
        self.name = f"int{bits}"

    def process_weights_after_loading(self, layer: Linear) -> None:
        group = layer_group_size(layer.in_features, self.group_size)
        q, scales, mins = quantize_groups(layer.weight, self.bits, group)
        layer.group_size = group
        replace_parameter(layer, "qweight", pack_groups(q, scales, mins, self.bits))  # [out_features, row bytes]
        replace_parameter(layer, "weight", None)
        replace_parameter(layer, "bias", None if layer.bias is None else layer.bias.detach().float().contiguous())

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise ValueError(f"int{self.bits} linear layers compute in float32, got {x.dtype}")
        rows = x.reshape(-1, layer.in_features).contiguous()  # [num_rows, in_features]
        out = torch.ops.pagedllm.quantized_linear(rows, layer.qweight, self.bits, layer.group_size,
                                                  layer.in_features, layer.bias)
        return out.view(*x.shape[:-1], layer.out_features)


class QuantizedEmbedding(nn.Module):
    """A token embedding held as grouped int8 / int4 blocks (``qweight`` ``[vocab, row bytes]``); rows come out float32.

    Under tensor parallelism (``tp``) it holds vocabulary rows ``[vocab_start,
    vocab_start + num_embeddings)`` and looks up as ``VocabParallelEmbedding`` does.
    """

    def __init__(
        self, qweight: torch.Tensor, embedding_dim: int, bits: int, group_size: int,
        tp: TensorParallelGroup | None = None, vocab_start: int = 0,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = qweight.shape[0], embedding_dim
        self.bits, self.group_size = bits, group_size
        self.tp, self.vocab_start = tp, vocab_start
        self.register_buffer("qweight", qweight)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, bits: int, group_size: int | None) -> QuantizedEmbedding:
        """``embedding``'s table quantized as a linear layer of ``embedding_dim`` inputs would be (its vocabulary
        slice, for a tensor-parallel rank's)."""
        group = layer_group_size(embedding.embedding_dim, group_size)
        q, scales, mins = quantize_groups(embedding.weight, bits, group)
        return cls(pack_groups(q, scales, mins, bits), embedding.embedding_dim, bits, group,
                   getattr(embedding, "tp", None), getattr(embedding, "vocab_start", 0))

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1).contiguous()  # [num_tokens]
        out = torch.ops.pagedllm.quantized_embedding(self.qweight, self.bits, self.group_size, self.embedding_dim, ids)
        return out.view(*input_ids.shape, self.embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None or self.tp.size == 1:
            return self._lookup(input_ids)
        return vocab_parallel_lookup(input_ids, self.vocab_start, self.num_embeddings, self.tp, self._lookup)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int{self.bits}, group={self.group_size}"


def quantize_model(model: nn.Module, bits: int, group_size: int | None) -> int:
    """Give every linear layer of ``model`` and its token embedding grouped int``bits`` blocks; returns the layers.

    A tied LM head and the embedding share one set of blocks (the head's),
    so no float32 table is left behind.
    """
    embedding: nn.Embedding = model.model.embed_tokens
    tied = model.lm_head.weight is embedding.weight
    num_layers = apply_linear_method(model, QuantizedLinearMethod(bits, group_size))
    head = model.lm_head
    if tied:
        model.model.embed_tokens = QuantizedEmbedding(head.qweight, embedding.embedding_dim, bits, head.group_size,
                                                      getattr(embedding, "tp", None), getattr(embedding, "vocab_start", 0))
    else:
        model.model.embed_tokens = QuantizedEmbedding.from_embedding(embedding, bits, group_size)
    return num_layers


def group_fallbacks(model: nn.Module, group_size: int | None) -> dict[int, list[str]]:
    """Layers whose ``in_features`` ``group_size`` does not divide: the group each takes -> their names.

    ValueError naming the layer when one cannot be quantized at all
    (``in_features`` not a multiple of 32).
    """
    found: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        in_features = module.in_features if isinstance(module, nn.Linear) else module.embedding_dim
        try:
            group = layer_group_size(in_features, group_size)
        except ValueError as e:
            raise ValueError(f"{name} cannot be quantized: {e}") from None
        if group_size is not None and group != group_size:
            found.setdefault(group, []).append(name)
    return found
