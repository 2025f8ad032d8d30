"""A pre-normed decoder layer whose mixer is attention or a state layer's (LFM2's short conv).

``x += mixer(norm(x)); x += mlp(norm(x))`` as Llama's layer, with the mixer
chosen per layer by its spec: a ``ShortConvLayerSpec`` builds a ``ShortConv``
(``conv``) and the layer declares its state (``state_shapes``,
docs/hybrid-models.md); any other spec builds ``SelfAttention``
(``self_attn``). The runner hands each layer its cache: an attention layer
its (K, V), a conv layer its state tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.attention import AttentionBackend, AttentionMetadata
from pagedllm.layers.decoder import DecoderLayerSpec
from pagedllm.layers.mlp import GatedMLP
from pagedllm.layers.parallel import TensorParallelGroup
from pagedllm.layers.quantization.quant_config import QuantConfig
from pagedllm.layers.self_attention import CosSin, SelfAttention
from pagedllm.layers.short_conv import ShortConv, ShortConvLayerSpec


class MixerDecoderLayer(nn.Module):
    """Pre-normed mixer (attention or short conv) and SwiGLU MLP over the residual stream."""

    def __init__(
        self, spec: DecoderLayerSpec, hidden_size: int, backend: AttentionBackend,
        tp: TensorParallelGroup | None = None, quant_config: QuantConfig | None = None, prefix: str = "",
    ) -> None:
        super().__init__()
        self.rope_table = spec.rope_table
        self.input_layernorm = spec.norm.build(hidden_size)
        self.conv: ShortConv | None = None
        if isinstance(spec, ShortConvLayerSpec):
            self.conv = ShortConv(hidden_size, spec.conv_kernel_size, spec.conv_bias, quant_config, f"{prefix}.conv",
                                  tp)
        else:
            self.self_attn = SelfAttention(spec.attention, backend, tp, quant_config, f"{prefix}.self_attn")
        self.post_attention_layernorm = spec.norm.build(hidden_size)
        self.mlp = GatedMLP(hidden_size, spec.intermediate_size, spec.hidden_act, tp, quant_config, f"{prefix}.mlp")

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """A conv layer's per-sequence state (docs/hybrid-models.md); an attention layer keeps none."""
        if self.conv is None:
            raise ValueError("an attention layer keeps K/V, not a state")
        return self.conv.state_shapes()

    def forward(
        self, cos_sin: CosSin | None, x: torch.Tensor, cache: tuple[torch.Tensor, ...], meta: AttentionMetadata
    ) -> torch.Tensor:
        """One layer over the residual stream ``x`` ``[num_tokens, hidden]``, updated in place and returned.
        ``cache``: an attention layer's (K, V), a conv layer's state tensors."""
        h = self.input_layernorm(x)
        mixed = self.conv(h, cache, meta) if self.conv is not None else self.self_attn(cos_sin, h, cache, meta)
        h = self.post_attention_layernorm.add_forward(x, mixed)
        return x.add_(self.mlp(h))
