"""The decoder layer of a hybrid model: a state layer or attention mixes the tokens, then the MLP or experts.

Qwen3-Next and Qwen3.5 mix three layers of four with Gated DeltaNet
(``layers/gated_deltanet.py``, Hugging Face's ``linear_attn``), Granite 4.0-H
most of its layers with Mamba-2 (``layers/mamba2.py``, HF's ``mamba``); the
runner hands such a layer its per-sequence state in the place of a K/V cache
(``runner/state_cache.py``). The other layers attend over their paged K/V
blocks: ``GatedSelfAttention`` (``layers/gated_attention.py``, Qwen's,
rotating part of each head) where ``gated_attention``, else ``SelfAttention``.
Whichever the mixer, the layer is pre-norm, and the norms, the MLP (dense or
a mixture of experts with its shared expert, ``layers/fused_moe.py``) and
Granite's residual multiplier are ``DecoderLayer``'s; under tensor parallelism
each mixer holds its rank's heads (``distributed/shard_plan.py``) and ends in
a row-parallel ``out_proj`` / ``o_proj``::

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
from pagedllm.layers.gated_attention import GatedSelfAttention
from pagedllm.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetSpec
from pagedllm.layers.mamba2 import Mamba2Mixer, Mamba2Spec
from pagedllm.layers.mlp import GatedMLP
from pagedllm.layers.parallel import TensorParallelGroup
from pagedllm.layers.quantization.quant_config import QuantConfig
from pagedllm.layers.self_attention import CosSin, SelfAttention


@dataclass(frozen=True)
class HybridLayerSpec(DecoderLayerSpec):
    """A ``DecoderLayerSpec`` whose mixer is Gated DeltaNet (``linear``), Mamba-2 (``mamba``) or, with neither,
    attention (``attention``; gated per head where ``gated_attention``)."""

    linear: GatedDeltaNetSpec | None = None
    mamba: Mamba2Spec | None = None
    gated_attention: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.linear is not None and self.mamba is not None:
            raise ValueError("a hybrid layer's mixer is Gated DeltaNet or Mamba-2, not both")
        # HybridDecoderLayer has the pre-norm path only, for every mixer: refuse what it would not build
        if self.post_norms or not self.pre_norms:
            raise ValueError("a hybrid model's layers are pre-norm (post_norms / pre_norms=False are not built)")
        if self.gated_attention and (self.linear is not None or self.mamba is not None):
            raise ValueError("gated_attention is for an attention layer, not a Gated DeltaNet or Mamba-2 one")


class HybridDecoderLayer(nn.Module):
    """Mixer (Gated DeltaNet, Mamba-2 or attention) and MLP over the residual stream, each after its norm
    (module docstring); the mixer keeps HF's name: ``linear_attn``, ``mamba`` or ``self_attn``."""

    def __init__(
        self, spec: HybridLayerSpec, hidden_size: int, backend: AttentionBackend,
        tp: TensorParallelGroup | None = None, quant_config: QuantConfig | None = None, prefix: str = "",
    ) -> None:
        super().__init__()
        self.rope_table = spec.rope_table
        self.input_layernorm = spec.norm.build(hidden_size)
        self.linear_attn: GatedDeltaNet | None = None
        self.mamba: Mamba2Mixer | None = None
        if spec.linear is not None:
            self.linear_attn = GatedDeltaNet(spec.linear, quant_config, f"{prefix}.linear_attn", tp)
        elif spec.mamba is not None:
            self.mamba = Mamba2Mixer(spec.mamba, quant_config, f"{prefix}.mamba", tp)
        else:
            attention = GatedSelfAttention if spec.gated_attention else SelfAttention
            self.self_attn = attention(spec.attention, backend, tp, quant_config, f"{prefix}.self_attn")
        self.post_attention_layernorm = spec.norm.build(hidden_size)
        self.mlp: nn.Module = (
            MoEBlock(spec.moe, hidden_size, tp, quant_config, f"{prefix}.mlp") if spec.moe is not None
            else GatedMLP(hidden_size, spec.intermediate_size, spec.hidden_act, tp, quant_config, f"{prefix}.mlp",
                          bias=spec.mlp_bias)
        )
        self.branch_scale = (BranchScale(hidden_size, spec.residual_multiplier)
                             if spec.residual_multiplier is not None else None)

    @property
    def is_mamba(self) -> bool:
        """Whether the mixer is Mamba-2."""
        return self.mamba is not None

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """A state layer's per-sequence states (``runner/state_cache.py``): Gated DeltaNet's (conv, recurrent)
        or Mamba-2's (conv, SSM) shapes; ValueError for attention, which keeps K/V blocks."""
        if self.linear_attn is not None:
            return self.linear_attn.state_shapes()
        if self.mamba is not None:
            return self.mamba.spec.state_shapes()
        raise ValueError("an attention layer keeps K/V in the paged cache, no per-sequence state")

    def forward(
        self, cos_sin: CosSin | None, x: torch.Tensor, cache: tuple[torch.Tensor, ...], meta: AttentionMetadata
    ) -> torch.Tensor:
        """One layer over the residual stream ``x`` ``[num_tokens, hidden]``, updated in place and returned.

        ``cache``: the attention's (K, V) blocks, or the state layer's (conv state, recurrent / SSM state).
        """
        h = self.input_layernorm(x)
        if self.linear_attn is not None:
            mixed = self.linear_attn(h, cache, meta)
        elif self.mamba is not None:
            mixed = self.mamba(h, cache, meta)
        else:
            mixed = self.self_attn(cos_sin, h, cache, meta)
        h = self.post_attention_layernorm.add_forward(x, self._scaled(mixed))
        return x.add_(self._scaled(self.mlp(h)))

    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        return branch if self.branch_scale is None else self.branch_scale(branch)
