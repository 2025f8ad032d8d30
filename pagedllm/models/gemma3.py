"""Gemma 3, text only (transformers' ``Gemma3ForCausalLM``, model_type ``gemma3_text``; GGUF ``gemma3``), on the
shared blocks.

Where it differs from the Llama family, each as transformers computes it:

- embeddings are multiplied by ``sqrt(hidden_size)``, that factor rounded
  to the model's dtype first (``DecoderSpec.embed_scale``);
- every RMSNorm is Gemma's: ``rms_norm(x) * (1 + weight)`` in float32 (a
  GGUF file holds ``1 + weight``: its norms multiply by the weight as
  stored, in the same order; ``loader/gguf_gemma.py``);
- four norms per layer: before and after attention, before and after the MLP,
  the "after" ones applied to the branch before it joins the residual;
- q and k are RMS-normed per head before RoPE;
- the MLP gate is ``hidden_activation`` (GELU, tanh approximation);
- attention scales scores by ``query_pre_attn_scalar ** -0.5``; the logits
  are capped by ``final_logit_softcapping``. Scores would be capped by
  ``cfg.attn_logit_softcapping``, but the loader reads Gemma 3's as None:
  transformers' Gemma 3 keeps that value and never applies it;
- sliding-window layers ("sliding_attention") use their own RoPE base
  (``local_rope_theta``), global layers ``rope_theta`` with its scaling;
- the LM head is usually tied to the embedding.

With native ops (float32 on the CPU) the norms run the native RMSNorm with
``1 + w`` made once, and q/k norms and RoPE are one in-place pass over qkv
(``layers/qk_rotary.py``); GELU stays torch.
"""

from __future__ import annotations

from pagedllm.layers.decoder import CausalLM, DecoderLayerSpec, DecoderSpec
from pagedllm.layers.norm import NormSpec
from pagedllm.layers.rotary import RopeSpec
from pagedllm.layers.self_attention import AttentionSpec
from pagedllm.loader.model_config import ModelArchConfig


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3's decoder: sandwich-normed layers, two RoPE tables, scaled embeddings, capped logits."""

    @classmethod
    def decoder_spec(cls, cfg: ModelArchConfig) -> DecoderSpec:
        """Gemma's norms everywhere; sliding layers rotate by the "local" table, global ones by "full"."""
        if cfg.architecture != "gemma3":
            raise ValueError(f"Gemma3ForCausalLM cannot run a {cfg.architecture!r} model")
        # a Hugging Face folder stores w (the norm adds 1), a GGUF file 1 + w
        norm = NormSpec(cfg.rms_norm_eps, unit_offset=cfg.checkpoint_format == "hf", float32_weight=True)
        layers = []
        for i in range(cfg.num_hidden_layers):
            sliding = bool(cfg.layer_types) and cfg.layer_types[i] == "sliding_attention"
            attention = AttentionSpec(
                cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=norm, scale=cfg.attn_scale,
                softcap=cfg.attn_logit_softcapping, sliding_window=cfg.sliding_window(i),
            )
            layers.append(DecoderLayerSpec(attention, cfg.intermediate_size, cfg.hidden_act, norm,
                                           rope_table="local" if sliding else "full", post_norms=True))
        max_pos = cfg.max_position_embeddings
        local_theta = cfg.local_rope_theta if cfg.local_rope_theta is not None else cfg.rope_theta
        tables = {"full": RopeSpec(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling),
                  "local": RopeSpec(cfg.head_dim, max_pos, local_theta, cfg.local_rope_scaling)}
        return DecoderSpec(cfg.vocab_size, cfg.hidden_size, tuple(layers), norm, tables,
                           embed_scale=cfg.hidden_size**0.5, final_logit_softcap=cfg.final_logit_softcapping,
                           tie_word_embeddings=cfg.tie_word_embeddings)
