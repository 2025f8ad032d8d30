"""Qwen3-MoE (transformers' ``Qwen3MoeForCausalLM``, GGUF architecture ``qwen3moe``) on the shared blocks.

Qwen3's attention (per-head RMSNorm on q and k, optional biases, one RoPE
table, a window on every layer with ``use_sliding_window``) and, in each
sparse layer, a mixture of experts (``layers/fused_moe.py``) in place of the
dense MLP: a softmax router over ``num_experts``, the ``num_experts_per_tok``
largest probabilities (renormalised to sum to one with ``norm_topk_prob``),
experts of ``moe_intermediate_size`` with SiLU, no shared expert. A layer is
dense (``intermediate_size``) when it is in ``mlp_only_layers`` or off the
``decoder_sparse_step`` (``loader/moe_config.py``; in GGUF: a layer without
a router). Qwen3-30B-A3B: 128 experts, 8 per token, all 48 layers sparse.
"""

from __future__ import annotations

from pagedllm.layers.decoder import CausalLM, DecoderLayerSpec, DecoderSpec
from pagedllm.layers.fused_moe import MoESpec
from pagedllm.layers.norm import NormSpec
from pagedllm.layers.rotary import RopeSpec
from pagedllm.layers.router import RouterSpec
from pagedllm.layers.self_attention import AttentionSpec
from pagedllm.loader.model_config import ModelArchConfig


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3's pre-norm layers; the sparse ones route each token to its top-k experts."""

    supports_experts = True

    @classmethod
    def moe_spec(cls, cfg: ModelArchConfig) -> MoESpec:
        """A sparse layer's block: softmax, then top-k, renormalised where ``norm_topk_prob`` says."""
        router = RouterSpec(cfg.num_experts, cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob)
        return MoESpec(router, cfg.moe_intermediate_size, cfg.hidden_act)

    @classmethod
    def decoder_spec(cls, cfg: ModelArchConfig) -> DecoderSpec:
        """Per layer: Qwen3's attention (q/k norms per head, biases on q/k/v/o with ``attention_bias``, the
        layer's window), then the experts where the layer is sparse, else the dense MLP."""
        norm = NormSpec(cfg.rms_norm_eps)
        moe = cls.moe_spec(cfg) if cfg.num_experts else None  # no experts: every layer dense
        layers = tuple(
            DecoderLayerSpec(
                AttentionSpec(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                              qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                              qk_norm=norm if cfg.qk_norm else None, sliding_window=cfg.sliding_window(i)),
                cfg.intermediate_size, cfg.hidden_act, norm, moe=moe if cfg.is_sparse(i) else None,
            )
            for i in range(cfg.num_hidden_layers)
        )
        rope = RopeSpec(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                        cfg.rope_freq_factors)
        return DecoderSpec(cfg.vocab_size, cfg.hidden_size, layers, norm, {"default": rope},
                           tie_word_embeddings=cfg.tie_word_embeddings)
