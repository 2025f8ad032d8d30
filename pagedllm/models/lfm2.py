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

import torch

from pagedllm.layers.decoder import CausalLM, DecoderLayerSpec, DecoderSpec
from pagedllm.layers.mixer_decoder_layer import MixerDecoderLayer
from pagedllm.layers.norm import NormSpec
from pagedllm.layers.rotary import RopeSpec
from pagedllm.layers.self_attention import AttentionSpec
from pagedllm.layers.short_conv import ShortConvLayerSpec
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


class Lfm2ForCausalLM(CausalLM):
    """LFM2: gated short-conv layers and per-head-normed attention layers, tied embeddings."""

    layer_class = MixerDecoderLayer

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
