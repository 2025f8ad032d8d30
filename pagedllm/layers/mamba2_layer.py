"""A pre-norm decoder layer whose mixer is Mamba-2 or attention, as a hybrid model's layers are (Granite 4.0-H).

``HybridLayerSpec`` is a ``DecoderLayerSpec`` with an optional
``Mamba2Spec``: with one, the layer's mixer is a ``Mamba2Mixer``
(Hugging Face's ``mamba``) and its cache entry is that layer's state,
``(conv_state, ssm_state)``; without, it is ``SelfAttention`` over its KV
blocks, exactly as ``DecoderLayer``'s. Either way the MLP (dense, or a
mixture of experts with its shared expert), the norms and Granite's
residual multiplier are ``DecoderLayer``'s::

    x += scale * mixer(input_layernorm(x))
    x += scale * mlp(post_attention_layernorm(x))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.layers.attention import AttentionBackend, AttentionMetadata
from pagedllm.layers.branch_scale import BranchScale
from pagedllm.layers.decoder import DecoderLayerSpec
from pagedllm.layers.fused_moe import MoEBlock
from pagedllm.layers.mamba2 import Mamba2Mixer, Mamba2Spec
from pagedllm.layers.mlp import GatedMLP
from pagedllm.layers.parallel import TensorParallelGroup
from pagedllm.layers.quantization.quant_config import QuantConfig
from pagedllm.layers.self_attention import CosSin, SelfAttention


@dataclass(frozen=True)
class HybridLayerSpec(DecoderLayerSpec):
    """A decoder layer whose mixer is Mamba-2 (``mamba`` set; ``attention`` then unread) or attention."""

    mamba: Mamba2Spec | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mamba is not None and (self.post_norms or not self.pre_norms):
            raise ValueError("a Mamba-2 layer is a pre-norm layer")


class HybridDecoderLayer(nn.Module):
    """Mixer (Mamba-2 or attention) and MLP over the residual stream, each after its norm (module docstring)."""

    def __init__(
        self, spec: HybridLayerSpec, hidden_size: int, backend: AttentionBackend,
        tp: TensorParallelGroup | None = None, quant_config: QuantConfig | None = None, prefix: str = "",
    ) -> None:
        super().__init__()
        if tp is not None and tp.size > 1:
            raise ValueError("tensor parallelism is not supported for Mamba-2 hybrid models")
        self.rope_table = spec.rope_table
        self.input_layernorm = spec.norm.build(hidden_size)
        self.is_mamba = spec.mamba is not None
        if self.is_mamba:
            self.mamba = Mamba2Mixer(spec.mamba, quant_config, f"{prefix}.mamba")
        else:
            self.self_attn = SelfAttention(spec.attention, backend, tp, quant_config, f"{prefix}.self_attn")
        self.post_attention_layernorm = spec.norm.build(hidden_size)
        self.mlp: nn.Module = (
            MoEBlock(spec.moe, hidden_size, tp, quant_config, f"{prefix}.mlp") if spec.moe is not None
            else GatedMLP(hidden_size, spec.intermediate_size, spec.hidden_act, tp, quant_config, f"{prefix}.mlp",
                          bias=spec.mlp_bias)
        )
        self.branch_scale = (BranchScale(hidden_size, spec.residual_multiplier)
                             if spec.residual_multiplier is not None else None)

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """A Mamba-2 layer's per-sequence state: its conv state and SSM state shapes (docs/hybrid-models.md)."""
        if not self.is_mamba:
            raise ValueError("an attention layer keeps K/V blocks, not a state")
        return self.mamba.spec.state_shapes()

    def forward(self, cos_sin: CosSin | None, x: torch.Tensor, cache: tuple[torch.Tensor, ...],
                meta: AttentionMetadata) -> torch.Tensor:
        """One layer over ``x`` ``[num_tokens, hidden]``, updated in place and returned; ``cache``: this layer's
        (K, V) blocks, or its (conv, SSM) state."""
        h = self.input_layernorm(x)
        mixed = self.mamba(h, cache, meta) if self.is_mamba else self.self_attn(cos_sin, h, cache, meta)
        h = self.post_attention_layernorm.add_forward(x, self._scaled(mixed))
        return x.add_(self._scaled(self.mlp(h)))

    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        return branch if self.branch_scale is None else self.branch_scale(branch)
