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

import dataclasses

from pagedllm.layers.decoder import DecoderSpec
from pagedllm.layers.fused_moe import MoESpec
from pagedllm.layers.router import RouterSpec
from pagedllm.layers.self_attention import AttentionSpec
from pagedllm.loader.model_config import ModelArchConfig
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.mixtral import with_experts


class OlmoeForCausalLM(LlamaForCausalLM):
    """Llama's layers with q/k norms over whole projections and a mixture of experts for every MLP."""

    supports_experts = True

    @classmethod
    def attention_spec(cls, cfg: ModelArchConfig, layer: int) -> AttentionSpec:
        """Llama's attention with the q/k norms spanning each projection (OLMo 2's)."""
        return dataclasses.replace(super().attention_spec(cfg, layer), qk_norm_span="projection")

    @classmethod
    def decoder_spec(cls, cfg: ModelArchConfig) -> DecoderSpec:
        """Llama's spec with every MLP a top-k of ``cfg.num_experts`` SiLU experts."""
        router = RouterSpec(cfg.num_experts, cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob)
        return with_experts(super().decoder_spec(cfg), cfg, MoESpec(router, cfg.moe_intermediate_size, cfg.hidden_act))
