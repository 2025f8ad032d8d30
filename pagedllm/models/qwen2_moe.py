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

from pagedllm.layers.decoder import DecoderSpec
from pagedllm.layers.fused_moe import MoESpec
from pagedllm.layers.router import RouterSpec
from pagedllm.loader.model_config import ModelArchConfig
from pagedllm.models.llama import Qwen2ForCausalLM
from pagedllm.models.mixtral import with_experts


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    """Qwen2's layers; the sparse ones route each token to its top-k experts beside a gated shared expert."""

    supports_experts = True

    @classmethod
    def decoder_spec(cls, cfg: ModelArchConfig) -> DecoderSpec:
        """Qwen2's spec with the sparse layers' experts and shared expert."""
        router = RouterSpec(cfg.num_experts, cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob)
        shared = cfg.shared_expert_intermediate_size
        moe = MoESpec(router, cfg.moe_intermediate_size, cfg.hidden_act, shared_expert_intermediate_size=shared,
                      shared_expert_gate=shared > 0)
        return with_experts(super().decoder_spec(cfg), cfg, moe)
