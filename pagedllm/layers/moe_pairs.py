"""A mixture-of-experts step's (token, slot) pairs grouped by expert, in torch or as one native call.

``PairGrouping`` groups the step's pairs by expert: a stable argsort and a
few gathers in torch; ``torch.ops.pagedllm.moe_group`` natively, one stable
counting sort (``kernels/elementwise/moe_group.cpp``), the very permutation
a stable argsort gives, so the two give the same tensors. With the native
router (``layers/router.py``'s ``RouterScores``) about fifteen small ops per
sparse layer become two calls, in eager steps and in captured decode steps
alike (``runner/capture/``: each runs from Python over the step's own rows,
its pairs cut to ``top_k`` times the rows).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedllm.layers.custom_op import CustomOp


class PairGroups(NamedTuple):
    """A step's ``num_tokens * top_k`` (token, slot) pairs (pair ``p = token * top_k + slot``) sorted by expert,
    stably: ``order`` int64 (each sorted pair's ``p``), ``token_ids`` int32 (its token), ``pair_experts`` int64
    (its expert, ascending), ``counts`` int64 ``[num_experts]`` (pairs per expert) and ``offsets`` int32
    ``[num_experts + 1]`` (expert ``e``'s pairs are ``[offsets[e], offsets[e + 1])``)."""

    order: torch.Tensor
    token_ids: torch.Tensor
    pair_experts: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor


class PairGrouping(CustomOp):
    """Expert ids ``[num_tokens, top_k]`` -> ``PairGroups``. Every size is the step's rows or its pairs, never a
    count the router chose, so a decode step through it traces and is captured."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts

    def forward_torch(self, ids: torch.Tensor) -> PairGroups:
        """A stable argsort of the ids and the gathers around it."""
        top_k = ids.shape[1]
        flat = ids.reshape(-1)  # pair p = token * top_k + slot
        order = torch.argsort(flat, stable=True)  # pairs by expert; within one, by token then slot
        token_ids = torch.div(order, top_k, rounding_mode="floor").to(torch.int32)
        pair_experts = flat.index_select(0, order)
        # a sum into a tensor of fixed size (bincount's size would be read from the data, which a traced step
        # cannot do); integer sums, the same in any order
        counts = torch.zeros(self.num_experts, dtype=torch.int64).scatter_add_(0, flat, torch.ones_like(flat))
        offsets = torch.zeros(self.num_experts + 1, dtype=torch.int32)
        offsets[1:] = torch.cumsum(counts, 0)
        return PairGroups(order, token_ids, pair_experts, counts, offsets)

    def forward_native(self, ids: torch.Tensor) -> PairGroups:
        """One counting sort (``kernels/elementwise/moe_group.cpp``): the same five tensors."""
        return PairGroups(*self.native.moe_group(ids, self.num_experts))
