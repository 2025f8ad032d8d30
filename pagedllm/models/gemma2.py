"""Gemma 2 (transformers' ``Gemma2ForCausalLM``, model_type ``gemma2``; GGUF ``gemma2``), on the shared blocks.

Where it differs from the Llama family, each as transformers computes it:

- embeddings are multiplied by ``sqrt(hidden_size)``, rounded to the
  model's dtype first (``DecoderSpec.embed_scale``);
- every RMSNorm is Gemma's, ``rms_norm(x) * (1 + w)`` in float32 (a GGUF
  file holds ``1 + w``: its norms multiply by the weight as stored, in the
  same order; ``loader/gguf_gemma.py``);
- four norms per layer, before and after attention and the MLP, the
  "after" ones applied to the branch before it joins the residual;
- the MLP gate is GELU (tanh approximation, ``hidden_activation``);
- scores are scaled by ``query_pre_attn_scalar ** -0.5`` and capped,
  ``cap * tanh(s / cap)`` with ``attn_logit_softcapping``, before the
  mask; the logits are capped by ``final_logit_softcapping``;
- layers alternate: even ones attend through a sliding window, odd ones
  globally (``layer_types``); all rotate by one RoPE table;
- the LM head is tied to the embedding.

Capped scores run through the explicit-softmax attention paths (SDPA takes
no cap, the native kernels neither); decode steps are then not captured
(``CapturedDecode.supports``).
"""

from __future__ import annotations

from pagedllm.layers.decoder import CausalLM, DecoderLayerSpec, DecoderSpec
from pagedllm.layers.norm import NormSpec
from pagedllm.layers.rotary import RopeSpec
from pagedllm.layers.self_attention import AttentionSpec
from pagedllm.loader.model_config import ModelArchConfig


class Gemma2ForCausalLM(CausalLM):
    """Gemma 2's decoder: sandwich-normed layers, capped scores and logits, alternating windows."""

    @classmethod
    def decoder_spec(cls, cfg: ModelArchConfig) -> DecoderSpec:
        """Gemma's norms everywhere; every layer rotated by the one table, windowed where ``cfg`` says."""
        if cfg.architecture != "gemma2":
            raise ValueError(f"Gemma2ForCausalLM cannot run a {cfg.architecture!r} model")
        # a Hugging Face folder stores w (the norm adds 1), a GGUF file 1 + w
        norm = NormSpec(cfg.rms_norm_eps, unit_offset=cfg.checkpoint_format == "hf", float32_weight=True)
        layers = tuple(
            DecoderLayerSpec(
                AttentionSpec(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                              qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, scale=cfg.attn_scale,
                              softcap=cfg.attn_logit_softcapping, sliding_window=cfg.sliding_window(i)),
                cfg.intermediate_size, cfg.hidden_act, norm, post_norms=True,
            )
            for i in range(cfg.num_hidden_layers)
        )
        rope = RopeSpec(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        return DecoderSpec(cfg.vocab_size, cfg.hidden_size, layers, norm, {"default": rope},
                           embed_scale=cfg.hidden_size**0.5, final_logit_softcap=cfg.final_logit_softcapping,
                           tie_word_embeddings=cfg.tie_word_embeddings)
