"""The decoder layer of Qwen3-Next and Qwen3.5: a Gated DeltaNet or a gated attention, then the MLP or experts.

Three layers of four (``layer_types`` "linear_attention") mix tokens with
Gated DeltaNet (``layers/gated_deltanet.py``), whose per-sequence states the
runner hands in the place of a K/V cache; the others ("full_attention") with
``GatedSelfAttention`` (``layers/gated_attention.py``) over the paged cache,
rotating part of each head. Both are pre-normed, ``(1 + w)`` RMSNorms, and
the MLP is dense or a mixture of experts with a gated shared expert
(``layers/fused_moe.py``), as ``DecoderLayer`` builds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.layers.attention import AttentionBackend, AttentionMetadata
from pagedllm.layers.decoder import DecoderLayerSpec
from pagedllm.layers.fused_moe import MoEBlock
from pagedllm.layers.gated_attention import GatedSelfAttention
from pagedllm.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetSpec
from pagedllm.layers.mlp import GatedMLP
from pagedllm.layers.parallel import TensorParallelGroup
from pagedllm.layers.quantization.quant_config import QuantConfig
from pagedllm.layers.self_attention import CosSin


@dataclass(frozen=True)
class HybridLayerSpec(DecoderLayerSpec):
    """A ``DecoderLayerSpec`` whose ``linear`` (when given) replaces the attention by Gated DeltaNet."""

    linear: GatedDeltaNetSpec | None = None


class HybridDecoderLayer(nn.Module):
    """``x += mix(norm(x))``, ``x += mlp(norm(x))``; the mix is ``linear_attn`` or ``self_attn`` (HF's names)."""

    def __init__(
        self, spec: HybridLayerSpec, hidden_size: int, backend: AttentionBackend,
        tp: TensorParallelGroup | None = None, quant_config: QuantConfig | None = None, prefix: str = "",
    ) -> None:
        super().__init__()
        if tp is not None and tp.size > 1:
            raise ValueError("Qwen3-Next / Qwen3.5 layers do not run tensor-parallel yet")
        self.rope_table = spec.rope_table
        self.input_layernorm = spec.norm.build(hidden_size)
        self.linear_attn: GatedDeltaNet | None = None
        if getattr(spec, "linear", None) is not None:
            self.linear_attn = GatedDeltaNet(spec.linear, quant_config, f"{prefix}.linear_attn")
        else:
            self.self_attn = GatedSelfAttention(spec.attention, backend, tp, quant_config, f"{prefix}.self_attn")
        self.post_attention_layernorm = spec.norm.build(hidden_size)
        self.mlp: nn.Module = (
            MoEBlock(spec.moe, hidden_size, tp, quant_config, f"{prefix}.mlp") if spec.moe is not None
            else GatedMLP(hidden_size, spec.intermediate_size, spec.hidden_act, tp, quant_config, f"{prefix}.mlp")
        )

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """A Gated DeltaNet layer's per-sequence states (``runner/state_cache.py``); ValueError for attention."""
        if self.linear_attn is None:
            raise ValueError("an attention layer keeps K/V in the paged cache, no per-sequence state")
        return self.linear_attn.state_shapes()

    def forward(
        self, cos_sin: CosSin | None, x: torch.Tensor, cache: tuple[torch.Tensor, ...], meta: AttentionMetadata
    ) -> torch.Tensor:
        """One layer over the residual stream ``x`` ``[num_tokens, hidden]``, updated in place and returned.

        ``cache``: the attention's (K, V), or the Gated DeltaNet's (conv state, recurrent state).
        """
        h = self.input_layernorm(x)
        if self.linear_attn is not None:
            mixed = self.linear_attn(h, cache, meta)
        else:
            mixed = self.self_attn(cos_sin, h, cache, meta)
        h = self.post_attention_layernorm.add_forward(x, mixed)
        return x.add_(self.mlp(h))
