"""LFM2 (transformers' ``Lfm2ForCausalLM``) on the shared blocks: short-conv layers beside attention layers.

Each layer is pre-normed like Llama's (``operator_norm`` before the mixer,
``ffn_norm`` before a SwiGLU MLP ``w2(silu(w1 x) * w3 x)``); the mixer is
either attention (``layer_types`` "full_attention": q and k RMS-normed per
head, then RoPE) or a gated short convolution ("conv")::

    B, C, x = in_proj(h).chunk(3)           [num_tokens, hidden] each
    y = C * causal_conv1d(B * x)            depthwise over conv_L_cache taps, per sequence
    out = out_proj(y)

The conv keeps the last ``conv_L_cache - 1`` inputs of each sequence as its
state (docs/hybrid-models.md): ``state_shapes()`` declares
``(conv_L_cache - 1, hidden)`` and the runner hands the layer its
``[num_slots, ...]`` tensor where an attention layer gets its K/V. The final
norm is transformers' ``embedding_norm``; the LM head is tied by default.
Checkpoint names are mapped to the shared blocks' (``lfm2_weight_names``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.layers.attention import AttentionBackend, AttentionMetadata
from pagedllm.layers.causal_conv1d import causal_conv1d
from pagedllm.layers.decoder import CausalLM, DecoderLayerSpec, DecoderSpec
from pagedllm.layers.linear import Linear
from pagedllm.layers.mlp import GatedMLP
from pagedllm.layers.norm import NormSpec
from pagedllm.layers.parallel import TensorParallelGroup
from pagedllm.layers.quantization.quant_config import QuantConfig
from pagedllm.layers.rotary import RopeSpec
from pagedllm.layers.self_attention import AttentionSpec, CosSin, SelfAttention
from pagedllm.loader.model_config import ModelArchConfig

# transformers' LFM2 names -> the shared blocks' (a substring of the tensor's name, replaced once)
_RENAMES = (
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    (".feed_forward.w1.", ".mlp.gate_proj."),
    (".feed_forward.w3.", ".mlp.up_proj."),
    (".feed_forward.w2.", ".mlp.down_proj."),
    (".operator_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
    (".conv.conv.weight", ".conv.conv_weight"),
    (".conv.conv.bias", ".conv.conv_bias"),
    ("model.embedding_norm.", "model.norm."),
)


def lfm2_weight_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """An LFM2 checkpoint's tensors under the shared blocks' names; the conv's ``[hidden, 1, width]`` weight as
    ``[hidden, width]``."""
    for name, tensor in weights:
        for old, new in _RENAMES:
            if old in name:
                name = name.replace(old, new)
                break
        if name.endswith(".conv.conv_weight") and tensor.dim() == 3:
            tensor = tensor.squeeze(1)
        yield name, tensor


@dataclass(frozen=True)
class ShortConvLayerSpec(DecoderLayerSpec):
    """A decoder layer whose mixer is LFM2's gated short conv (``attention`` is not built)."""

    conv_kernel_size: int = 3
    conv_bias: bool = False


class ShortConv(nn.Module):
    """LFM2's gated short conv over the step's tokens, continuing each sequence's conv state."""

    def __init__(self, hidden_size: int, width: int, bias: bool, quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.width = width
        self.in_proj = Linear(hidden_size, 3 * hidden_size, bias, quant_config, f"{prefix}.in_proj")
        self.out_proj = Linear(hidden_size, hidden_size, bias, quant_config, f"{prefix}.out_proj")
        self.conv_weight = nn.Parameter(torch.empty(hidden_size, width), requires_grad=False)  # [hidden, width]
        self.conv_bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False) if bias else None

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The conv state: the last ``width - 1`` inputs of a sequence (at least one row, so a width-1 conv
        still has a tensor to point at)."""
        return ((max(1, self.width - 1), self.hidden_size),)

    def forward(self, h: torch.Tensor, states: tuple[torch.Tensor, ...], meta: AttentionMetadata) -> torch.Tensor:
        """``h`` ``[num_tokens, hidden]`` (normed) -> the mixer's output ``[num_tokens, hidden]``."""
        if meta.state_slots is None or meta.has_initial_state is None:
            raise ValueError("an LFM2 conv layer needs the step's state slots (AttentionMetadata.state_slots)")
        b, c, x = self.in_proj(h).chunk(3, dim=-1)
        conv_state = states[0][:, : self.width - 1]  # [num_slots, width - 1, hidden]
        y = causal_conv1d((b * x).contiguous(), self.conv_weight, self.conv_bias, conv_state, meta.query_start_loc,
                          meta.state_slots, meta.has_initial_state, "none", native=conv_state.is_contiguous())
        return self.out_proj(c * y)


class Lfm2DecoderLayer(nn.Module):
    """Pre-normed mixer (attention or short conv) and SwiGLU MLP over the residual stream."""

    def __init__(
        self, spec: DecoderLayerSpec, hidden_size: int, backend: AttentionBackend,
        tp: TensorParallelGroup | None = None, quant_config: QuantConfig | None = None, prefix: str = "",
    ) -> None:
        super().__init__()
        if tp is not None and tp.size > 1:
            raise ValueError("LFM2 does not run under tensor parallelism yet")
        self.rope_table = spec.rope_table
        self.input_layernorm = spec.norm.build(hidden_size)
        self.conv: ShortConv | None = None
        if isinstance(spec, ShortConvLayerSpec):
            self.conv = ShortConv(hidden_size, spec.conv_kernel_size, spec.conv_bias, quant_config, f"{prefix}.conv")
        else:
            self.self_attn = SelfAttention(spec.attention, backend, tp, quant_config, f"{prefix}.self_attn")
        self.post_attention_layernorm = spec.norm.build(hidden_size)
        self.mlp = GatedMLP(hidden_size, spec.intermediate_size, spec.hidden_act, tp, quant_config, f"{prefix}.mlp")

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """A conv layer's per-sequence state (docs/hybrid-models.md); an attention layer keeps none."""
        if self.conv is None:
            raise ValueError("an LFM2 attention layer keeps K/V, not a state")
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


class Lfm2ForCausalLM(CausalLM):
    """LFM2: gated short-conv layers and per-head-normed attention layers, tied embeddings."""

    layer_class = Lfm2DecoderLayer

    @classmethod
    def decoder_spec(cls, cfg: ModelArchConfig) -> DecoderSpec:
        """Attention layers as Qwen3's (per-head q/k norms), conv layers as ``ShortConvLayerSpec``."""
        norm = NormSpec(cfg.rms_norm_eps)
        layers: list[DecoderLayerSpec] = []
        for i in range(cfg.num_hidden_layers):
            attn = AttentionSpec(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                 qk_norm=norm)
            if cfg.is_attention_layer(i):
                layers.append(DecoderLayerSpec(attn, cfg.intermediate_size, cfg.hidden_act, norm))
            else:
                layers.append(ShortConvLayerSpec(attn, cfg.intermediate_size, cfg.hidden_act, norm,
                                                 conv_kernel_size=cfg.conv_kernel_size, conv_bias=cfg.conv_bias))
        rope = RopeSpec(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                        cfg.rope_freq_factors)
        return DecoderSpec(cfg.vocab_size, cfg.hidden_size, tuple(layers), norm, {"default": rope},
                           tie_word_embeddings=cfg.tie_word_embeddings)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load an LFM2 checkpoint (transformers' names, ``lfm2_weight_names``)."""
        super().load_weights(lfm2_weight_names(weights))
