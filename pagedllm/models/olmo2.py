"""OLMo 2 (transformers' ``Olmo2ForCausalLM``, GGUF architecture ``olmo2``) on the shared blocks.

Where it differs from the Llama family, each as transformers computes it:

- no norm before attention or the MLP: each branch reads the residual
  stream as it is, and its output is RMS-normed before it joins it
  (``x = x + norm(attn(x)); x = x + norm(mlp(x))``: ``post_norms`` without
  ``pre_norms``, norms named ``post_attention_layernorm`` and
  ``post_feedforward_layernorm``);
- q and k are RMS-normed over the whole projection, not per head (weights
  of ``num_heads * head_dim`` and ``num_kv_heads * head_dim``), before RoPE
  (``AttentionSpec.qk_norm_span="projection"``); under tensor parallelism
  each rank holds its heads' slice of the norms and the sums of squares are
  all-reduced (``layers/parallel.ParallelRMSNorm``);
- ``rms_norm_eps`` defaults to 1e-5 (the loader's reading).

``attention_bias`` biases q, k, v and the output, as in Llama. llama.cpp's
converter writes q and k rows as transformers holds them (no RoPE
permutation) and the two norms as ``post_attention_norm`` / ``post_ffw_norm``.
"""

from __future__ import annotations

from pagedllm.layers.decoder import CausalLM, DecoderLayerSpec, DecoderSpec
from pagedllm.layers.norm import NormSpec
from pagedllm.layers.rotary import RopeSpec
from pagedllm.layers.self_attention import AttentionSpec
from pagedllm.loader.model_config import ModelArchConfig


class Olmo2ForCausalLM(CausalLM):
    """OLMo 2's decoder: post-normed branches, q/k norms over whole projections, one RoPE table."""

    @classmethod
    def decoder_spec(cls, cfg: ModelArchConfig) -> DecoderSpec:
        """Every layer post-normed with Llama's RMSNorm; q and k normed as whole projections, then rotated."""
        norm = NormSpec(cfg.rms_norm_eps)
        layers = tuple(
            DecoderLayerSpec(
                AttentionSpec(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                              qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=norm,
                              qk_norm_span="projection", sliding_window=cfg.sliding_window(i)),
                cfg.intermediate_size, cfg.hidden_act, norm, pre_norms=False, post_norms=True,
            )
            for i in range(cfg.num_hidden_layers)
        )
        rope = RopeSpec(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                        cfg.rope_freq_factors)
        return DecoderSpec(cfg.vocab_size, cfg.hidden_size, layers, norm, {"default": rope},
                           tie_word_embeddings=cfg.tie_word_embeddings)
