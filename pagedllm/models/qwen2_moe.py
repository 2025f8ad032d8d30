"""Qwen2-MoE (transformers' ``Qwen2MoeForCausalLM``, GGUF architecture ``qwen2moe``) on the shared blocks.

Qwen2's attention (biases on q, k and v as ``qkv_bias`` says, none on the
output) and, in each sparse layer, a mixture of experts
(``layers/fused_moe.py``): a softmax over ``num_experts`` router logits, the
``num_experts_per_tok`` largest probabilities, renormalised only with
``norm_topk_prob`` (false in Qwen1.5-MoE), experts of
``moe_intermediate_size``; plus a shared expert, a dense SiLU-gated MLP of
``shared_expert_intermediate_size`` that every token runs, its output scaled
by ``sigmoid(shared_expert_gate(x))`` (a ``[1, hidden]`` gate) before it is
added to the routed sum. A layer of ``mlp_only_layers``, or off the
``decoder_sparse_step``, keeps a dense MLP of ``intermediate_size``.

Names: the folder's are the shared blocks' own (``mlp.gate``,
``mlp.experts.{e}.*_proj``, ``mlp.shared_expert.*_proj``,
``mlp.shared_expert_gate``); llama.cpp's converter writes them as
``ffn_gate_inp``, ``ffn_*_exps``, ``ffn_*_shexp`` and ``ffn_gate_inp_shexp``
(Q/K rows as transformers holds them), and never renormalises the top-k
(``loader/moe_families_config.py``).
"""

from __future__ import annotations

from pagedllm.layers.decoder import CausalLM, DecoderLayerSpec, DecoderSpec
from pagedllm.layers.fused_moe import MoESpec
from pagedllm.layers.norm import NormSpec
from pagedllm.layers.rotary import RopeSpec
from pagedllm.layers.router import RouterSpec
from pagedllm.layers.self_attention import AttentionSpec
from pagedllm.loader.model_config import ModelArchConfig


class Qwen2MoeForCausalLM(CausalLM):
    """Qwen2's pre-norm layers; the sparse ones route each token to its top-k experts beside a gated shared
    expert."""

    supports_experts = True

    @classmethod
    def moe_spec(cls, cfg: ModelArchConfig) -> MoESpec:
        """A sparse layer's block: softmax, top-k (renormalised with ``norm_topk_prob``), the gated shared expert."""
        router = RouterSpec(cfg.num_experts, cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob)
        shared = cfg.shared_expert_intermediate_size
        return MoESpec(router, cfg.moe_intermediate_size, cfg.hidden_act, shared_expert_intermediate_size=shared,
                       shared_expert_gate=shared > 0)

    @classmethod
    def decoder_spec(cls, cfg: ModelArchConfig) -> DecoderSpec:
        """Per layer: Qwen2's attention (q/k/v biased with ``qkv_bias``, the output never), then the experts where
        the layer is sparse, else the dense MLP."""
        norm = NormSpec(cfg.rms_norm_eps)
        moe = cls.moe_spec(cfg) if cfg.num_experts else None  # no experts: every layer dense
        layers = tuple(
            DecoderLayerSpec(
                AttentionSpec(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                              qkv_bias=cfg.attention_bias, o_bias=False),
                cfg.intermediate_size, cfg.hidden_act, norm, moe=moe if cfg.is_sparse(i) else None,
            )
            for i in range(cfg.num_hidden_layers)
        )
        rope = RopeSpec(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                        cfg.rope_freq_factors)
        return DecoderSpec(cfg.vocab_size, cfg.hidden_size, layers, norm, {"default": rope},
                           tie_word_embeddings=cfg.tie_word_embeddings)
