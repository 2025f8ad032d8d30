"""SmolLM3 (transformers' ``SmolLM3ForCausalLM``): Llama's decoder with RoPE left out of some layers.

A NoPE layer (``ModelArchConfig.nope_layers``: every fourth by default,
``no_rope_layers`` in config.json, llama.cpp's fixed step of 4 in GGUF)
attends over q and k as projected, unrotated; every other layer is Llama's.
Its attention has q/k/v and output biases where ``attention_bias`` says,
and a sliding window on the layers ``layer_types`` marks. The shared blocks
take a layer without RoPE as it is (``DecoderLayerSpec.rope_table=None``,
``AttentionSpec.rope=False``): the layer's q and k skip the rotation in the
torch, native and captured paths alike (``layers/qk_rotary.py``).
"""

from __future__ import annotations

from pagedllm.layers.decoder import DecoderSpec
from pagedllm.loader.model_config import ModelArchConfig
from pagedllm.models.llama import LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """Llama's layers; those of ``cfg.nope_layers`` rotate by no table."""

    @classmethod
    def decoder_spec(cls, cfg: ModelArchConfig) -> DecoderSpec:
        """Llama's spec with the NoPE layers' RoPE switched off."""
        return super().decoder_spec(cfg).without_rope(cfg.nope_layers)
