"""Gemma 4's decoder layer: sandwich norms, a dense MLP with a mixture of experts beside it, a per-layer scalar.

As transformers' ``Gemma4TextDecoderLayer`` computes it, on the residual stream ``x``::

    x = x + post_attention_layernorm(attn(input_layernorm(x)))
    h = mlp(pre_feedforward_layernorm(x))
    with experts (enable_moe_block, Gemma 4 26B-A4B):
        weights, ids = router(x)                                    (below)
        e = experts(pre_feedforward_layernorm_2(x), weights, ids)   the routed sum, layers/fused_moe.py
        h = post_feedforward_layernorm_1(h) + post_feedforward_layernorm_2(e)
    x = (x + post_feedforward_layernorm(h)) * layer_scalar

The router reads the residual stream, not the MLP's input: an RMSNorm
without weight, times ``router.scale`` and ``hidden_size ** -0.5``, then
``router.proj``; softmax over all experts in float32, the top ``k``,
renormalised to sum to one, each multiplied by its expert's
``per_expert_scale``. The experts are gated GELU MLPs stored stacked
(``experts.gate_up_proj``, ``experts.down_proj``). Every norm is an RMSNorm
whose weight multiplies in float32 (Gemma 4 stores the weight itself, not
Gemma 2/3's offset from 1).

Under tensor parallelism a rank holds its slice of the attention's heads
(``layers/gemma4_attention.py``), of the dense MLP's intermediate rows and
of every expert's (``ShardPlan.expert_intermediate``, as ``MoEBlock``
splits them); the router is whole on every rank. The dense MLP's and the
experts' outputs are then partial sums, each normed after its own sum: the
two are all-reduced together, one all-reduce of ``[num_tokens, 2 * hidden]``
per layer rather than two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.activation import gated_activation
from pagedllm.layers.attention import AttentionBackend, AttentionMetadata
from pagedllm.layers.decoder import DecoderLayerSpec
from pagedllm.layers.fused_moe import (
    ExpertWeights,
    MoESpec,
    count_routing,
    register_expert_counters,
    routed_experts,
)
from pagedllm.layers.gemma4_attention import Gemma4Attention, Gemma4AttentionShape
from pagedllm.layers.mlp import GatedMLP
from pagedllm.layers.moe_pairs import PairGrouping
from pagedllm.layers.moe_slot_sum import SlotSum
from pagedllm.layers.parallel import TensorParallelGroup
from pagedllm.layers.quantization.quant_config import QuantConfig
from pagedllm.layers.router import Router
from pagedllm.layers.self_attention import CosSin


@dataclass(frozen=True)
class Gemma4LayerSpec(DecoderLayerSpec):
    """A Gemma 4 layer: ``DecoderLayerSpec`` (its ``moe`` is the experts beside the dense MLP, not in its place)
    plus the attention's ``Gemma4AttentionShape``."""

    shape: Gemma4AttentionShape | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shape is None:
            raise ValueError("a Gemma 4 layer needs its attention shape (Gemma4AttentionShape)")


class Gemma4Router(nn.Module):
    """``router.proj`` ``[num_experts, hidden]``, ``router.scale`` ``[hidden]``, ``router.per_expert_scale``
    ``[num_experts]``; ``route`` gives each token's experts and weights (see the module docstring)."""

    def __init__(self, spec: MoESpec, hidden_size: int, eps: float, quant_config: QuantConfig | None,
                 prefix: str) -> None:
        super().__init__()
        self.proj = Router(spec.router, hidden_size, quant_config, f"{prefix}.proj")
        self.scale = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(spec.num_experts), requires_grad=False)
        self.root_size = hidden_size**-0.5
        self.eps = eps

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``x`` ``[num_tokens, hidden]`` -> (weights float32 ``[num_tokens, top_k]``, expert ids int64)."""
        h = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        weights, ids = self.proj.route(h * self.scale * self.root_size)  # softmax, top-k, renormalised
        return weights * self.per_expert_scale[ids], ids


class Gemma4DecoderLayer(nn.Module):
    """One Gemma 4 layer of a ``Gemma4LayerSpec`` (see the module docstring); Hugging Face's parameter names."""

    def __init__(
        self, spec: Gemma4LayerSpec, hidden_size: int, backend: AttentionBackend,
        tp: TensorParallelGroup | None = None, quant_config: QuantConfig | None = None, prefix: str = "",
    ) -> None:
        super().__init__()
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.rope_table = spec.rope_table
        norm = spec.norm
        self.self_attn = Gemma4Attention(spec.attention, spec.shape, norm, backend, quant_config,
                                         f"{prefix}.self_attn", self.tp)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, norm.build(hidden_size))
        self.moe = spec.moe
        # with experts beside it, the dense MLP's partial sum waits for the experts' (one all-reduce of both)
        self.mlp = GatedMLP(hidden_size, spec.intermediate_size, spec.hidden_act, self.tp, quant_config,
                            f"{prefix}.mlp", bias=spec.mlp_bias, reduce=spec.moe is None)
        if spec.moe is not None:
            self.router = Gemma4Router(spec.moe, hidden_size, norm.eps, quant_config, f"{prefix}.router")
            start = self.tp.plan.expert_intermediate[0] if self.tp is not None else 0
            self.experts = ExpertWeights(spec.moe, hidden_size, quant_config, f"{prefix}.experts", start)
            self.experts_act = gated_activation(spec.moe.hidden_act)
            register_expert_counters(self, spec.moe.num_experts)  # the expert load /metrics and bench show
            self.grouping = PairGrouping(spec.moe.num_experts)
            self.slot_sum = SlotSum()
            for name in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2"):
                setattr(self, name, norm.build(hidden_size))
        # a checkpoint buffer (transformers' nn.Buffer, saved with the weights): loaded like a parameter
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def _feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The dense MLP's branch, plus the experts' where the layer has them, each normed: ``[num_tokens, hidden]``."""
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe is None:
            return h
        weights, ids = self.router.route(x)
        groups = self.grouping(ids)
        count_routing(self, groups.counts)
        e = routed_experts(self.experts, self.experts_act, self.pre_feedforward_layernorm_2(x), weights, ids, groups,
                           self.slot_sum)
        if self.tp is not None:  # each a partial sum over this rank's rows: both summed in one all-reduce
            both = self.tp.all_reduce_(torch.cat((h, e.to(h.dtype)), dim=-1))
            h, e = (part.contiguous() for part in both.split(h.shape[-1], dim=-1))
        return self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(e)

    def forward(
        self, cos_sin: CosSin | None, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """One layer over the residual stream ``x`` ``[num_tokens, hidden]``, updated in place and returned."""
        attn_out = self.self_attn(cos_sin, self.input_layernorm(x), kv_cache, meta)
        x.add_(self.post_attention_layernorm(attn_out))
        x.add_(self.post_feedforward_layernorm(self._feed_forward(x)))
        return x.mul_(self.layer_scalar.to(x.dtype))
