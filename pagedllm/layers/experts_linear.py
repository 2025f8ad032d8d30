"""The grouped-expert product: each (token, slot) pair times its expert's rows of a stacked experts' layer.

A mixture-of-experts layer holds each projection's experts as one ``Linear``
whose rows are the experts' stacked (``layers/fused_moe.py``): expert ``e``
owns rows ``[e * N, (e + 1) * N)`` of ``[num_experts * N, K]``, in whatever
form the layer's method keeps rows (GGUF blocks, the interleaved x16 tiles,
int8 / int4 groups, a float or bf16 weight; ``quantization/expert_packed.py``
for the packed-panel kernels). ``experts_linear`` takes the step's pairs
sorted by expert, ``token_ids`` (which row of ``x`` each pair reads) and
``expert_offsets`` (pairs ``[offsets[e], offsets[e + 1])`` are expert
``e``'s), and returns one output row per pair:

    out[p] = x[token_ids[p]] @ W_e.T (+ b_e)      for the expert e whose range holds p

Each expert's rows are multiplied by the dense kernel of the layer's method,
on that expert's pairs only, so a pair's row is the very bits the dense
layer of that expert gives it (the dense kernels sum a row alike alone or
among others: batch invariance holds). An expert no pair chose costs
nothing. A layer of one GGUF block type (plain or x16) takes the native
grouped op instead of the loop (``torch.ops.pagedllm.gguf_moe_linear``,
``quantization/gguf_moe.py``): activations rounded once per step, threads
over (expert x channel chunk), the same bits as the loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.layers.linear import Linear, UnquantizedLinearMethod
from pagedllm.layers.quantization.bf16_linear import TorchBF16LinearMethod
from pagedllm.layers.quantization.expert_packed import (
    ExpertPackedBF16LinearMethod,
    ExpertPackedLinearMethod,
)
from pagedllm.layers.quantization.gguf_linear import GGUFLinearMethod, GGUFPartsLinearMethod
from pagedllm.layers.quantization.gguf_moe import gguf_experts_layer
from pagedllm.layers.quantization.quantized_linear import QuantizedLinearMethod


def experts_linear(
    layer: Linear, x: torch.Tensor, token_ids: torch.Tensor, expert_offsets: torch.Tensor, num_experts: int,
    pair_experts: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[num_pairs, N]`` float: pair ``p``'s row ``x[token_ids[p]]`` times the rows of the expert whose range of
    ``expert_offsets`` (int32 ``[num_experts + 1]``) holds ``p``.

    ``layer``: the experts' stacked layer, ``[num_experts * N, K]``; ``x`` ``[num_tokens, K]`` float;
    ``token_ids`` int32 ``[num_pairs]``, sorted by expert; ``pair_experts``: each pair's expert (int64
    ``[num_pairs]``, where the caller has them: a bias is then added without reading the offsets into Python).

    The grouped GGUF op reads the routing as tensors (it checks the offsets itself), so a step through it can be
    traced and captured (``layer_is_grouped``); the per-expert loop of the other formats reads the offsets into
    Python.
    """
    if layer.out_features % num_experts:
        raise ValueError(f"{layer.out_features} rows are not {num_experts} experts' stacked")
    if expert_offsets.shape != (num_experts + 1,):
        raise ValueError(f"expert_offsets must have {num_experts + 1} entries, got {tuple(expert_offsets.shape)}")
    if x.dtype == torch.float32:
        grouped = gguf_experts_layer(layer, x, token_ids, expert_offsets, num_experts, pair_experts)
        if grouped is not None:
            return grouped
    rows = layer.out_features // num_experts
    offsets = expert_offsets.tolist()
    num_pairs = token_ids.shape[0]
    if offsets[0] != 0 or offsets[-1] != num_pairs:
        raise ValueError(f"expert_offsets must run from 0 to the {num_pairs} pairs, got {offsets[0]}..{offsets[-1]}")
    out = torch.empty(num_pairs, rows, dtype=torch.float32 if x.dtype == torch.float32 else x.dtype,
                      device=x.device)
    gathered = x.index_select(0, token_ids)  # [num_pairs, K]: the pairs' rows, by expert
    for expert in range(num_experts):
        start, end = offsets[expert], offsets[expert + 1]
        if end > start:
            out[start:end] = expert_product(layer, gathered[start:end], expert, rows)
    return out


def layer_is_grouped(layer: Linear) -> bool:
    """Whether ``experts_linear`` multiplies ``layer`` by the grouped GGUF op (on float32 rows): the routing stays
    in tensors, and a step through it can be captured."""
    return type(layer.quant_method) is GGUFLinearMethod


def expert_product(layer: Linear, x: torch.Tensor, expert: int, rows: int) -> torch.Tensor:
    """``x`` ``[n, K]`` (contiguous) times expert ``expert``'s ``rows`` rows of ``layer``, by the dense kernel of
    its method: ``[n, rows]``."""
    method = layer.quant_method
    start = expert * rows
    bias = None if layer.bias is None else layer.bias.narrow(0, start, rows)
    if isinstance(method, GGUFLinearMethod):
        return torch.ops.pagedllm.gguf_linear(x, layer.qweight.narrow(0, start, rows), method.ggml_type,
                                              layer.in_features, bias)
    if isinstance(method, (ExpertPackedLinearMethod, ExpertPackedBF16LinearMethod)):
        return method.expert_rows(layer, x, expert)
    if isinstance(method, QuantizedLinearMethod):
        return torch.ops.pagedllm.quantized_linear(x, layer.qweight.narrow(0, start, rows), method.bits,
                                                   layer.group_size, layer.in_features, bias, layer.interleaved)
    if isinstance(method, GGUFPartsLinearMethod):
        return _parts_product(layer, method, x, start, rows)
    if isinstance(method, TorchBF16LinearMethod):
        return F.linear(x.to(torch.bfloat16), layer.weight.narrow(0, start, rows), bias).float()
    if type(method) is UnquantizedLinearMethod:
        return F.linear(x, layer.weight.narrow(0, start, rows), bias)
    raise ValueError(f"expert weights held by the {method.name!r} linear method cannot be multiplied per expert")


def _parts_product(
    layer: Linear, method: GGUFPartsLinearMethod, x: torch.Tensor, start: int, rows: int
) -> torch.Tensor:
    """Rows ``[start, start + rows)`` of a layer whose GGUF parts differ in type (an expert's gate and up)."""
    outs = []
    for i, (offset, size, ggml_type) in enumerate(method.parts):
        lo, hi = max(start, offset), min(start + rows, offset + size)
        if hi <= lo:
            continue
        weight = method.part_weight(layer, i).narrow(0, lo - offset, hi - lo)
        bias = None if layer.bias is None else layer.bias.narrow(0, lo, hi - lo)
        outs.append(torch.ops.pagedllm.gguf_linear(x, weight, ggml_type, layer.in_features, bias))
    return torch.cat(outs, dim=-1)
