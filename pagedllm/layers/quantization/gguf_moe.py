"""A mixture-of-experts layer's experts in GGUF blocks, multiplied in one native call per projection.

The experts of one projection are held stacked, ``qweight`` ``[num_experts *
N, row bytes]`` (expert ``e`` owns rows ``[e * N, (e + 1) * N)``, in file
order or interleaved 16 rows at a time as ``GGUFLinearMethod`` keeps a dense
layer). A step's routing, ``topk_ids`` ``[num_tokens, top_k]``, becomes pairs
(token, slot) sorted by expert (``route_pairs``), and
``torch.ops.pagedllm.gguf_moe_linear`` (``kernels/gguf/gguf_moe_linear.cpp``)
gives every pair its row

    out[p] = x[token_ids[p]] @ W_e.T          pairs [expert_offsets[e], expert_offsets[e + 1]) are expert e's

rounding the tokens to int8 once (x16 layout), and sharing (expert, chunk of
128 channels) units out over the threads: an expert no token chose costs
nothing, and a decode step's one token and 8 experts keeps every core busy.
Each row is bit for bit what ``gguf_linear`` gives it against its expert's
rows alone (the same kernels on the same rows). A bias, added after the
product, is one float addition of the same two values the dense kernel adds:
the same bits too.
"""

from __future__ import annotations

import torch

from pagedllm.layers.linear import Linear
from pagedllm.layers.quantization.gguf_linear import GGUFLinearMethod


def route_pairs(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs of a routing, sorted by expert: ``(order, token_ids, expert_offsets)``.

    ``topk_ids`` ``[num_tokens, top_k]`` integer expert ids in ``[0, num_experts)``. Pair ``p`` in expert order is
    ``order[p]`` (int64) in ``(token, slot)`` order, ``token * top_k + slot``: within an expert by token, then
    slot (a stable sort). ``token_ids`` int32 ``[num_pairs]``: each pair's token; ``expert_offsets`` int32
    ``[num_experts + 1]``: expert ``e``'s pairs are ``[offsets[e], offsets[e + 1])``.
    """
    if num_experts < 1:
        raise ValueError(f"num_experts must be at least 1, got {num_experts}")
    if topk_ids.dim() != 2 or topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be integer [num_tokens, top_k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(f"topk_ids must be expert ids in [0, {num_experts}), got {int(flat.min())}..{int(flat.max())}")
    order = torch.argsort(flat, stable=True)  # [num_pairs]
    token_ids = torch.div(order, max(top_k, 1), rounding_mode="floor").to(torch.int32)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64)
    offsets[1:] = torch.bincount(flat, minlength=num_experts).cumsum(0)
    return order, token_ids, offsets.to(torch.int32)


def gguf_experts_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    ggml_type: int,
    num_experts: int,
    token_ids: torch.Tensor,
    expert_offsets: torch.Tensor,
    bias: torch.Tensor | None = None,
    pair_experts: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[num_pairs, N]`` float32: each pair's token row of ``x`` (float32 ``[num_tokens, K]``) times its expert's
    rows of ``qweight`` (``[num_experts * N, row bytes]`` of ``ggml_type``, 512 + the type when interleaved),
    plus its expert's ``bias`` rows (``[num_experts * N]``) where given. ``pair_experts``: each pair's expert
    (int64 ``[num_pairs]``) where the caller has them; else they are expanded from the offsets (a size read
    from the data: not in a traced step). ValueError for a bad argument."""
    if x.dtype != torch.float32:
        raise ValueError(f"GGUF expert layers compute in float32, got {x.dtype}")
    out = torch.ops.pagedllm.gguf_moe_linear(x.contiguous(), qweight, ggml_type, num_experts, token_ids,
                                             expert_offsets)
    if bias is not None:
        if bias.shape != (qweight.shape[0],):
            raise ValueError(f"bias must be [{qweight.shape[0]}] (every expert's rows), got {tuple(bias.shape)}")
        if pair_experts is None:
            counts = (expert_offsets[1:] - expert_offsets[:-1]).long()  # [num_experts]: pairs per expert
            pair_experts = torch.repeat_interleave(torch.arange(num_experts), counts)  # [num_pairs]
        elif pair_experts.shape != (token_ids.shape[0],):
            raise ValueError(f"pair_experts must be [{token_ids.shape[0]}], got {tuple(pair_experts.shape)}")
        out += bias.detach().view(num_experts, -1).index_select(0, pair_experts)
    return out


def gguf_experts_layer(
    layer: Linear, x: torch.Tensor, token_ids: torch.Tensor, expert_offsets: torch.Tensor, num_experts: int,
    pair_experts: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``gguf_experts_linear`` on a stacked experts' ``Linear`` whose method is ``GGUFLinearMethod`` (one block
    type); None for any other method (a fused layer of mixed types: the caller's per-expert loop)."""
    method = layer.quant_method
    if type(method) is not GGUFLinearMethod:
        return None
    return gguf_experts_linear(x, layer.qweight, method.ggml_type, num_experts, token_ids, expert_offsets,
                               layer.bias, pair_experts)
