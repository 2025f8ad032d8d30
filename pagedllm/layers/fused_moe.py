"""The mixture-of-experts MLP block: a router picks ``top_k`` experts per token, each a gated MLP of its own.

``MoESpec`` says what a family's block holds; ``MoEBlock`` (Hugging Face's
``mlp`` of a sparse layer) computes, for the step's rows ``x`` ``[num_tokens,
hidden]``::

    weights, ids = router(x)                               [num_tokens, top_k] each (layers/router.py)
    pairs (token, slot) sorted by expert (stable: by token, then slot, within an expert)
    h = act(gate_up_e(x[token]))                            per expert, on its pairs only (experts_linear)
    y = down_e(h)
    out[t] = sum over slots s = 0..top_k-1, in that order, of weights[t, s] * y[t, s]
    (+ sigmoid(shared_expert_gate(x)) * shared_expert(x), where the family has a shared expert)

Every step of a row depends on that row only: the routing is per row, each
expert's product runs the dense kernel on its pairs (a row alike alone or
among others), and the weighted sum runs over the row's own slots in slot
order. So batch invariance holds for a mixture of experts as for a dense MLP.

The experts' weights: each projection of all experts is one ``Linear`` whose
rows are the experts' stacked, ``experts.gate_up`` ``[num_experts * 2 *
inter, hidden]`` (expert ``e``'s gate rows, then its up rows) and
``experts.down`` ``[num_experts * hidden, inter]``, held by the quantization
machinery as any linear layer (GGUF blocks never widened to float, bf16,
float32, int8 / int4), so that an expert is a row range
(``layers/experts_linear.py``). A checkpoint's per-expert tensors
(``mlp.experts.{e}.gate_proj.weight``...) load into their rows through the
fused map ``moe_fused_projections``.

Tensor parallelism (``distributed/shard_plan.py``, ``ShardPlan.expert_intermediate``)
splits every expert as a dense MLP is split: a rank holds rows
``[start, start + I_rank)`` of each expert's gate and of its up
(column-parallel) and the same input columns of its down (row-parallel), the
router whole. A rank's block output is then a partial sum (the weighted sum
of the top-k is linear in each expert's output), all-reduced once after the
block as a dense MLP's down projection is. A GGUF file's down columns are cut
in whole blocks (the plan's unit; a layer the kernels could not take as
stored is refused rather than widened to float), and the x16 interleave is
kept only where each expert's slice of rows is whole groups of 16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.layers.activation import gated_activation
from pagedllm.layers.experts_linear import experts_linear, layer_is_grouped
from pagedllm.layers.linear import Linear, LinearMethod
from pagedllm.layers.mlp import GatedMLP
from pagedllm.layers.moe_pairs import PairGrouping, PairGroups
from pagedllm.layers.moe_slot_sum import SlotSum
from pagedllm.layers.quantization.expert_packed import expert_method
from pagedllm.layers.quantization.gguf_dequantized import has_gguf_kernel
from pagedllm.layers.quantization.gguf_linear import (
    INTERLEAVE_ROWS,
    GGUFLinearMethod,
    GGUFPartsLinearMethod,
)
from pagedllm.layers.quantization.quant_config import QuantConfig
from pagedllm.layers.router import Router, RouterSpec
from pagedllm.layers.weights import FusedMap


@dataclass(frozen=True)
class MoESpec:
    """One sparse MLP: its router, each expert's ``intermediate_size`` and activation (a gated one,
    ``layers/activation.py``), biases on the experts' projections, and an optional shared expert (a dense
    gated MLP of ``shared_expert_intermediate_size`` added to every token, 0: none) with an optional
    sigmoid gate (Qwen2-MoE's ``shared_expert_gate``, ``[1, hidden]``). ``swiglu_alpha`` / ``swiglu_limit``:
    the constants of gpt-oss's clamped SwiGLU (``hidden_act`` "swiglu_oai"), unread by other activations."""

    router: RouterSpec
    intermediate_size: int
    hidden_act: str = "silu"
    expert_bias: bool = False
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        if isinstance(self.intermediate_size, bool) or not isinstance(self.intermediate_size, int) \
                or self.intermediate_size < 1:
            raise ValueError(f"an expert needs a positive intermediate size, got {self.intermediate_size!r}")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError("shared_expert_intermediate_size must be 0 (no shared expert) or positive")
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ValueError("a shared-expert gate needs a shared expert (shared_expert_intermediate_size > 0)")

    @property
    def num_experts(self) -> int:
        """Routed experts (the router's)."""
        return self.router.num_experts


def moe_fused_projections(num_experts: int, intermediate_size: int, hidden_size: int,
                          shared_intermediate_size: int = 0, expert_start: int | None = None,
                          shared_start: int | None = None) -> FusedMap:
    """Where a checkpoint's per-expert (and shared-expert) tensors go in the block's stacked layers.

    Expert ``e``'s ``gate_proj`` takes rows ``[e * 2I, e * 2I + I)`` of ``experts.gate_up``, its ``up_proj``
    the next ``I``, its ``down_proj`` rows ``[e * H, (e + 1) * H)`` of ``experts.down``; a shared expert's
    gate and up fuse as a dense MLP's. ``intermediate_size`` is this rank's ``I``; ``expert_start``: the first
    of each expert's gate and up rows a tensor-parallel rank takes (None: all, one process); ``shared_start``
    the same of the shared expert's (``shared_intermediate_size`` is then this rank's). Down's columns are cut
    by ``shard_expert_columns`` (the shared expert's by its ``RowParallelLinear``).
    """
    fused: FusedMap = {}
    for e in range(num_experts):
        fused[f"experts.{e}.gate_proj"] = ("experts.gate_up", 2 * e * intermediate_size, intermediate_size,
                                           expert_start)
        fused[f"experts.{e}.up_proj"] = ("experts.gate_up", (2 * e + 1) * intermediate_size, intermediate_size,
                                         expert_start)
        fused[f"experts.{e}.down_proj"] = ("experts.down", e * hidden_size, hidden_size, None)
    if shared_intermediate_size:
        fused["shared_expert.gate_proj"] = ("shared_expert.gate_up_proj", 0, shared_intermediate_size,
                                            shared_start)
        fused["shared_expert.up_proj"] = ("shared_expert.gate_up_proj", shared_intermediate_size,
                                          shared_intermediate_size, shared_start)
    return fused


def stacked_experts_layer(in_features: int, rows: int, num_experts: int, bias: bool, quant_config: QuantConfig | None,
                          prefix: str, input_start: int = 0) -> Linear:
    """The stacked layer of one projection (named ``prefix``): ``rows`` rows per expert, each expert a row range
    of what the method holds (tiles of 16 rows are interleaved only where no expert starts inside one).
    ``input_start``: the first of the whole expert's input columns this rank holds (down, under tensor
    parallelism); a GGUF layer whose kernels cannot take that slice as stored is refused."""
    layer = Linear(in_features, num_experts * rows, bias, quant_config, prefix, input_start)
    parts = quant_config.gguf_parts(f"{prefix}.weight") if input_start and quant_config is not None else None
    # types with kernels not taken as stored: the slice is off their blocks (no kernel at all: dequantized, as in
    # one process)
    if parts and all(has_gguf_kernel(kind) for *_, kind in parts) \
            and not isinstance(layer.quant_method, (GGUFLinearMethod, GGUFPartsLinearMethod)):
        raise ValueError(f"{prefix}: this rank's experts' columns from {input_start} ({in_features} of them) are "
                         "not whole GGUF blocks of the file's types: the experts cannot be split over these "
                         "tensor-parallel ranks without widening them to float (use tensor_parallel_size=1)")
    method: LinearMethod = expert_method(layer.quant_method, num_experts)
    if method is not layer.quant_method:
        layer.quant_method = method
        method.create_weights(layer)
    if rows % INTERLEAVE_ROWS:
        for flag in ("interleave", "interleave_after_loading"):
            if getattr(method, flag, False) is True:
                setattr(method, flag, False)
    return layer


class ExpertWeights(nn.Module):
    """The experts' projections stacked by rows: ``gate_up`` ``[E * 2I, H]``, ``down`` ``[E * H, I]``."""

    def __init__(self, spec: MoESpec, hidden_size: int, quant_config: QuantConfig | None, prefix: str,
                 input_start: int = 0) -> None:
        super().__init__()
        inter, num = spec.intermediate_size, spec.num_experts
        self.num_experts = num
        self.gate_up = stacked_experts_layer(hidden_size, 2 * inter, num, spec.expert_bias, quant_config,
                                             f"{prefix}.gate_up")
        self.down = stacked_experts_layer(inter, hidden_size, num, spec.expert_bias, quant_config, f"{prefix}.down",
                                          input_start)


def experts_capturable(model: nn.Module) -> bool:
    """Whether every experts' layer of ``model`` is multiplied by the grouped GGUF op (``layer_is_grouped``), so
    that its decode steps keep the routing in tensors and can be captured; the other formats' per-expert loop
    reads the routing into Python and runs eagerly."""
    return all(layer_is_grouped(m.gate_up) and layer_is_grouped(m.down)
               for m in model.modules() if isinstance(m, ExpertWeights))


class MoEBlock(nn.Module):
    """A sparse MLP of ``spec`` over the step's rows ``[num_tokens, hidden]`` (see the module docstring).

    With ``tp`` of more than one rank, ``spec.intermediate_size`` is this rank's slice of every expert
    (``tp.plan.expert_intermediate``) and the output is all-reduced once.
    """

    def __init__(self, spec: MoESpec, hidden_size: int, tp: TensorParallelGroup | None = None,
                 quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.spec = spec
        self.gate = Router(spec.router, hidden_size, quant_config, f"{prefix}.gate")
        start = self.tp.plan.expert_intermediate[0] if self.tp is not None else 0
        self.experts = ExpertWeights(spec, hidden_size, quant_config, f"{prefix}.experts", start)
        # the routing's running counts (runner/expert_load.py reads them when asked, never per step): tokens
        # each expert was chosen for, and forward passes; tensors, so a traced step would count too
        register_expert_counters(self, spec.num_experts)
        self.grouping = PairGrouping(spec.num_experts)  # the pairs by expert (a native counting sort where built)
        self.slot_sum = SlotSum()  # the top-k outputs' weighted sum, with the shared expert's (one native pass)
        self.act_fn = gated_activation(spec.hidden_act, spec.swiglu_alpha, spec.swiglu_limit)
        if spec.shared_expert_intermediate_size:
            # under tensor parallelism this rank's slice of its rows, its partial sum joining the routed experts'
            # before the block's one all-reduce (the gate below is whole on every rank: g * sum = sum of g * part)
            shared_start = self.tp.plan.shared_expert_intermediate[0] if self.tp is not None else 0
            self.shared_expert = GatedMLP(hidden_size, spec.shared_expert_intermediate_size, spec.hidden_act, self.tp,
                                          quant_config, f"{prefix}.shared_expert", input_start=shared_start,
                                          reduce=False)
        if spec.shared_expert_gate:
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False, quant_config=quant_config,
                                             prefix=f"{prefix}.shared_expert_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, hidden]`` -> ``[num_tokens, hidden]``."""
        weights, ids = self.gate.route(x)  # [num_tokens, top_k] each
        shared = gate = None
        if self.spec.shared_expert_intermediate_size:
            shared = self.shared_expert(x)  # [num_tokens, hidden]
            if self.spec.shared_expert_gate:
                gate = self.shared_expert_gate(x)  # [num_tokens, 1]: logits, sigmoid in the slot sum
        out = self.routed(x, weights, ids, shared, gate)
        # each rank's out sums its slice of every expert's down columns: the ranks' sum is the block's output
        return self.tp.all_reduce_(out) if self.tp is not None else out

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared: torch.Tensor | None = None,
               gate: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' weighted sum for rows ``x`` sent to experts ``ids`` with ``weights`` (plus a shared
        expert's output ``shared``, times ``sigmoid(gate)`` where given)."""
        groups = self.grouping(ids)
        count_routing(self, groups.counts)
        return routed_experts(self.experts, self.act_fn, x, weights, ids, groups, self.slot_sum, shared, gate)


def register_expert_counters(module: nn.Module, num_experts: int) -> None:
    """Give ``module`` the routing's running counts (``runner/expert_load.py`` reads them when asked, never per
    step): ``expert_tokens`` int64 ``[num_experts]``, the tokens each expert was chosen for, and
    ``num_forwards`` int64 ``[1]``; tensors, so a traced step counts too."""
    module.register_buffer("expert_tokens", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
    module.register_buffer("num_forwards", torch.zeros(1, dtype=torch.int64), persistent=False)


def count_routing(module: nn.Module, counts: torch.Tensor) -> None:
    """Add this step's pairs per expert ``counts`` (``PairGroups.counts``) to ``module``'s counters
    (``register_expert_counters``)."""
    module.expert_tokens.add_(counts)
    # one made from the step's tensors: tracing would add a constant 1 for real (an op on constants only)
    module.num_forwards.add_(counts.new_ones(1))


def routed_experts(
    experts: ExpertWeights, act_fn: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    groups: PairGroups, slot_sum: SlotSum, shared: torch.Tensor | None = None, gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum_s weights[t, s] * expert_{ids[t, s]}(x[t])`` for each row ``t`` of ``x`` (the module docstring's
    arithmetic; a family whose layer holds the experts without ``MoEBlock``'s router calls it too), plus
    ``shared`` (times ``sigmoid(gate)``) where given, in ``x``'s dtype. ``groups``: the pairs of ``ids`` by expert
    (``PairGrouping``); ``slot_sum``: the layer's ``SlotSum`` (``layers/moe_slot_sum.py``).

    Every size here is the step's rows or its pairs (``top_k`` per row), never read from the routing, so a
    decode step through the grouped GGUF op traces and is captured (``runner/capture/``)."""
    num_tokens, top_k = ids.shape
    num_experts = experts.num_experts
    order, token_ids, pair_experts, _, offsets = groups
    h = act_fn(experts_linear(experts.gate_up, x, token_ids, offsets, num_experts, pair_experts))  # [pairs, I]
    pair_rows = torch.arange(h.shape[0], dtype=torch.int32)
    y = experts_linear(experts.down, h, pair_rows, offsets, num_experts, pair_experts)  # [pairs, H], by expert
    by_slot = torch.empty_like(y)
    by_slot[order] = y  # back in (token, slot) order
    return slot_sum(by_slot.view(num_tokens, top_k, -1), weights, shared, gate).to(x.dtype)
