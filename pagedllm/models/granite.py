"""Granite 3.x (transformers' ``GraniteForCausalLM``): Llama's decoder scaled by four multipliers.

As transformers' Granite computes them (``ModelArchConfig`` fields, read by
``loader/smollm3_granite_config.py`` from config.json or the GGUF keys
llama.cpp's converter writes):

- ``embedding_multiplier``: the embeddings multiplied by it
  (``DecoderSpec.embed_scale``; in a 2-byte dtype the factor is rounded to
  it first, exact for Granite's 12.0);
- ``residual_multiplier``: each branch's output multiplied by it before it
  is added to the residual (``DecoderLayerSpec.residual_multiplier``);
- ``attention_multiplier`` (``attn_scale``): the score scale in place of
  ``head_dim ** -0.5``;
- ``logits_scaling``: the logits divided by it (``DecoderSpec.logits_scaling``).

A Granite GGUF whose ``rope.scaling.finetuned`` is false rotates no layer
(``nope_layers`` holds them all), as llama.cpp runs it.
"""

from __future__ import annotations

import dataclasses

from pagedllm.layers.decoder import DecoderSpec
from pagedllm.layers.self_attention import AttentionSpec
from pagedllm.loader.model_config import ModelArchConfig
from pagedllm.models.llama import LlamaForCausalLM


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
