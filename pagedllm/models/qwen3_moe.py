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

import dataclasses

from pagedllm.layers.decoder import DecoderSpec
from pagedllm.layers.fused_moe import MoESpec
from pagedllm.layers.router import RouterSpec
from pagedllm.loader.model_config import ModelArchConfig
from pagedllm.models.llama import LlamaForCausalLM


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3's layers; the sparse ones route each token to its top-k experts."""

    supports_experts = True

    @classmethod
    def moe_spec(cls, cfg: ModelArchConfig) -> MoESpec:
        """A sparse layer's block: softmax, then top-k, renormalised where ``norm_topk_prob`` says."""
        router = RouterSpec(cfg.num_experts, cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob)
        return MoESpec(router, cfg.moe_intermediate_size, cfg.hidden_act)

    @classmethod
    def decoder_spec(cls, cfg: ModelArchConfig) -> DecoderSpec:
        """Llama's spec (Qwen3's q/k norms come from ``cfg.qk_norm``) with the sparse layers' experts."""
        spec = super().decoder_spec(cfg)
        moe = cls.moe_spec(cfg)
        return dataclasses.replace(spec, layers=tuple(
            dataclasses.replace(layer, moe=moe) if cfg.is_sparse(i) else layer for i, layer in enumerate(spec.layers)
        ))
