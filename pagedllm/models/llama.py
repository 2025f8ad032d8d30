"""The Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2 and Qwen3.

Pre-norm layers of the shared blocks (``layers/decoder.py``) that differ in
switches read from ``ModelArchConfig``: q/k/v and output biases
(``attention_bias``; Qwen2 never biases the output), biases on the MLP's three projections (``mlp_bias``), a per-head RMSNorm on q and k (Qwen3), the MLP's
activation (``hidden_act``, SiLU unless the config names another), tied
embeddings, RoPE scaling (a GGUF file's ``rope_freqs`` divisors too) and a per-layer sliding window (Mistral, Qwen3
with ``use_sliding_window``).

Two variants differ from Llama only in parameters of the shared blocks:

SmolLM3 (transformers' ``SmolLM3ForCausalLM``): RoPE left out of some layers.
A NoPE layer (``ModelArchConfig.nope_layers``: every fourth by default,
``no_rope_layers`` in config.json, llama.cpp's fixed step of 4 in GGUF)
attends over q and k as projected, unrotated; the shared blocks take a layer
without RoPE as it is (``DecoderLayerSpec.rope_table=None``,
``AttentionSpec.rope=False``) in the torch, native and captured paths alike.

Granite 3.x (transformers' ``GraniteForCausalLM``): four multipliers, read by
``loader/smollm3_granite_config.py`` from config.json or llama.cpp's GGUF
keys: ``embedding_multiplier`` (``DecoderSpec.embed_scale``; in a 2-byte
dtype rounded to it first, exact for Granite's 12.0), ``residual_multiplier``
(each branch scaled before the residual add,
``DecoderLayerSpec.residual_multiplier``), ``attention_multiplier``
(``attn_scale``, the score scale in place of ``head_dim ** -0.5``) and
``logits_scaling`` (logits divided by it, ``DecoderSpec.logits_scaling``). A
Granite GGUF whose ``rope.scaling.finetuned`` is false rotates no layer
(``nope_layers`` holds them all), as llama.cpp runs it.
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


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """Llama's layers; those of ``cfg.nope_layers`` rotate by no table."""

    @classmethod
    def decoder_spec(cls, cfg: ModelArchConfig) -> DecoderSpec:
        """Llama's spec with the NoPE layers' RoPE switched off."""
        return super().decoder_spec(cfg).without_rope(cfg.nope_layers)


class GraniteForCausalLM(LlamaForCausalLM):
    """Llama's layers with Granite's embedding, residual, score and logit multipliers."""

    @classmethod
    def attention_spec(cls, cfg: ModelArchConfig, layer: int) -> AttentionSpec:
        """Llama's attention scaled by ``attention_multiplier``."""
        return dataclasses.replace(super().attention_spec(cfg, layer), scale=cfg.attn_scale)

    @classmethod
    def decoder_spec(cls, cfg: ModelArchConfig) -> DecoderSpec:
        """Llama's spec with the multipliers; a multiplier of 1 adds no work."""
        spec = super().decoder_spec(cfg).without_rope(cfg.nope_layers)
        residual = None if cfg.residual_multiplier == 1.0 else cfg.residual_multiplier
        return dataclasses.replace(
            spec, layers=tuple(dataclasses.replace(layer, residual_multiplier=residual) for layer in spec.layers),
            embed_scale=None if cfg.embedding_multiplier == 1.0 else cfg.embedding_multiplier,
            logits_scaling=None if cfg.logits_scaling == 1.0 else cfg.logits_scaling,
        )
