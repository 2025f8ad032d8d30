"""OLMoE (transformers' ``OlmoeForCausalLM``, GGUF architecture ``olmoe``) on the shared blocks.

Llama's pre-norm layout (unlike OLMo 2's post-norms) with OLMo 2's
attention: q and k RMS-normed over the whole projection, not per head
(``AttentionSpec.qk_norm_span="projection"``), before RoPE; biases on q, k, v
and the output where ``attention_bias`` says. Every MLP is a mixture of
experts (``layers/fused_moe.py``): softmax over ``num_experts`` router
logits, the ``num_experts_per_tok`` largest probabilities, renormalised only
with ``norm_topk_prob`` (false in OLMoE-1B-7B, and in llama.cpp's graph),
experts of ``intermediate_size``. ``clip_qkv`` is refused by the loader.

The folder's names are the shared blocks' own (``mlp.gate``,
``mlp.experts.{e}.*_proj``); llama.cpp's converter writes ``ffn_gate_inp``,
``ffn_*_exps`` and ``attn_{q,k}_norm`` with Q/K rows as transformers holds
them.
"""

from __future__ import annotations

from pagedllm.layers.decoder import CausalLM, DecoderLayerSpec, DecoderSpec
from pagedllm.layers.fused_moe import MoESpec
from pagedllm.layers.norm import NormSpec
from pagedllm.layers.rotary import RopeSpec
from pagedllm.layers.router import RouterSpec
from pagedllm.layers.self_attention import AttentionSpec
from pagedllm.loader.model_config import ModelArchConfig


class OlmoeForCausalLM(CausalLM):
    """Llama's pre-norm layers with q/k norms over whole projections and a mixture of experts for every MLP."""

    supports_experts = True

    @classmethod
    def moe_spec(cls, cfg: ModelArchConfig) -> MoESpec:
        """A layer's block: softmax, then top-k, renormalised where ``norm_topk_prob`` says."""
        router = RouterSpec(cfg.num_experts, cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob)
        return MoESpec(router, cfg.moe_intermediate_size, cfg.hidden_act)

    @classmethod
    def decoder_spec(cls, cfg: ModelArchConfig) -> DecoderSpec:
        """Per layer: attention with q and k normed as whole projections (biases with ``attention_bias``), then
        a top-k of ``cfg.num_experts`` SiLU experts (renormalised with ``norm_topk_prob``)."""
        norm = NormSpec(cfg.rms_norm_eps)
        moe = cls.moe_spec(cfg) if cfg.num_experts else None  # no experts: every layer dense
        layers = tuple(
            DecoderLayerSpec(
                AttentionSpec(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                              qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=norm,
                              qk_norm_span="projection"),
                cfg.intermediate_size, cfg.hidden_act, norm, moe=moe if cfg.is_sparse(i) else None,
            )
            for i in range(cfg.num_hidden_layers)
        )
        rope = RopeSpec(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                        cfg.rope_freq_factors)
        return DecoderSpec(cfg.vocab_size, cfg.hidden_size, layers, norm, {"default": rope},
                           tie_word_embeddings=cfg.tie_word_embeddings)
