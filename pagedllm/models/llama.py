"""The Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2 and Qwen3.

Pre-norm layers of the shared blocks (``layers/decoder.py``) that differ in
switches read from ``ModelArchConfig``: q/k/v and output biases
(``attention_bias``; Qwen2 never biases the output), biases on the MLP's three projections (``mlp_bias``), a per-head RMSNorm on q and k (Qwen3), the MLP's
activation (``hidden_act``, SiLU unless the config names another), tied
embeddings, RoPE scaling (a GGUF file's ``rope_freqs`` divisors too) and a per-layer sliding window (Mistral, Qwen3
with ``use_sliding_window``).
"""

from __future__ import annotations

import dataclasses

from pagedllm.layers.decoder import CausalLM, DecoderLayerSpec, DecoderSpec
from pagedllm.layers.norm import NormSpec
from pagedllm.layers.rotary import RopeSpec
from pagedllm.layers.self_attention import AttentionSpec
from pagedllm.loader.model_config import ModelArchConfig


class LlamaForCausalLM(CausalLM):
    """Llama's decoder: ``x += attn(norm(x)); x += mlp(norm(x))`` per layer, one RoPE table."""

    @classmethod
    def attention_spec(cls, cfg: ModelArchConfig, layer: int) -> AttentionSpec:
        """Layer ``layer``'s attention; transformers' Llama and Qwen3 bias the output projection with q/k/v."""
        return AttentionSpec(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
            qk_norm=NormSpec(cfg.rms_norm_eps) if cfg.qk_norm else None, sliding_window=cfg.sliding_window(layer),
        )

    @classmethod
    def decoder_spec(cls, cfg: ModelArchConfig) -> DecoderSpec:
        """Every layer pre-normed with Llama's RMSNorm, rotated by the one table of ``rope_theta`` and scaling."""
        norm = NormSpec(cfg.rms_norm_eps)
        layers = tuple(
            DecoderLayerSpec(cls.attention_spec(cfg, i), cfg.intermediate_size, cfg.hidden_act, norm,
                             mlp_bias=cfg.mlp_bias)
            for i in range(cfg.num_hidden_layers)
        )
        rope = RopeSpec(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                        cfg.rope_freq_factors)
        return DecoderSpec(cfg.vocab_size, cfg.hidden_size, layers, norm, {"default": rope},
                           tie_word_embeddings=cfg.tie_word_embeddings)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama's decoder with transformers' Qwen2 attention: biases on q, k and v, none on ``o_proj``."""

    @classmethod
    def attention_spec(cls, cfg: ModelArchConfig, layer: int) -> AttentionSpec:
        """Llama's attention spec without the output bias."""
        return dataclasses.replace(super().attention_spec(cfg, layer), o_bias=False)
