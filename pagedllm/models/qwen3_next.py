"""Qwen3-Next and Qwen3.5 / Qwen3.6 (dense and MoE): hybrids of Gated DeltaNet and gated attention.

transformers' ``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM`` and
``Qwen3_5MoeForCausalLM`` (config ``qwen3_next``, ``qwen3_5_text``,
``qwen3_5_moe_text``): every ``full_attention_interval``-th layer (4) is
gated full attention, the others Gated DeltaNet
(``layers/hybrid_decoder.py``). What they share: ``(1 + w)`` RMSNorms
(final, per layer, q/k per head), the attention's output gate, RoPE over
``partial_rotary_factor`` of each head (0.25), a Gated DeltaNet's
``[num_v_heads, head_k_dim, head_v_dim]`` recurrent state and conv state per
sequence. Qwen3.5's multimodal RoPE (``mrope_section``) rotates text tokens
as plain RoPE does: their three position ids are equal.

What differs: Qwen3-Next stores its Gated DeltaNet input projections
interleaved per key head (``in_proj_qkvz``, ``in_proj_ba``: rewritten into
Qwen3.5's ``in_proj_qkv`` / ``_z`` / ``_b`` / ``_a`` at load); its experts
renormalise with ``norm_topk_prob`` and skip ``mlp_only_layers`` /
``decoder_sparse_step``; Qwen3.5-MoE always renormalises and every layer is
sparse. Both MoEs add a shared expert gated by ``sigmoid(shared_expert_gate(x))``.
A checkpoint's multi-token-prediction head (``mtp.*``) is not read.

Under tensor parallelism (``cfg`` a rank's) each rank holds its Gated
DeltaNet key heads and the value heads that read them, and its attention
heads' query and gate rows (``distributed/shard_plan.py``); Qwen3-Next's
interleaved rows are split by the whole model's heads first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch

from pagedllm.layers.decoder import CausalLM, DecoderSpec
from pagedllm.layers.fused_moe import MoESpec
from pagedllm.layers.gated_attention import gated_fused_map, split_gated_queries
from pagedllm.layers.gated_deltanet import (
    GatedDeltaNet,
    GatedDeltaNetSpec,
    split_qwen3_next_projections,
    whole_model_spec,
)
from pagedllm.layers.hybrid_decoder import HybridDecoderLayer, HybridLayerSpec
from pagedllm.layers.norm import NormSpec
from pagedllm.layers.parallel import TensorParallelGroup
from pagedllm.layers.rotary import RopeSpec
from pagedllm.layers.router import RouterSpec
from pagedllm.layers.self_attention import AttentionSpec
from pagedllm.layers.weights import FusedMap
from pagedllm.loader.model_config import ModelArchConfig


def gated_delta_spec(cfg: ModelArchConfig) -> GatedDeltaNetSpec:
    """A Gated DeltaNet layer of ``cfg`` (its ``linear_*`` fields)."""
    return GatedDeltaNetSpec(cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                             cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim,
                             cfg.rms_norm_eps, out_proj_tiled=cfg.linear_out_proj_tiled)


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next's and Qwen3.5's decoder; see the module docstring for the three checkpoints it reads."""

    supports_experts = True
    layer_class = HybridDecoderLayer

    @classmethod
    def moe_spec(cls, cfg: ModelArchConfig) -> MoESpec:
        """A sparse layer: softmax router, top-k (renormalised as the config says), the gated shared expert."""
        router = RouterSpec(cfg.num_experts, cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob)
        shared = cfg.shared_expert_intermediate_size
        return MoESpec(router, cfg.moe_intermediate_size, cfg.hidden_act, shared_expert_intermediate_size=shared,
                       shared_expert_gate=shared > 0)

    @classmethod
    def decoder_spec(cls, cfg: ModelArchConfig) -> DecoderSpec:
        """Per layer: Gated DeltaNet where ``layer_types`` says "linear_attention", else gated attention with
        partial RoPE; then the experts where the layer is sparse, else the dense MLP."""
        # (1 + w) norms; a GGUF file holds 1 + w already (loader/gguf_qwen35.py)
        gguf = cfg.checkpoint_format == "gguf"
        norm = NormSpec(cfg.rms_norm_eps, float32_weight=True) if gguf else NormSpec(cfg.rms_norm_eps, unit_offset=True)
        rope = RopeSpec(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                        cfg.rope_freq_factors, partial_rotary_factor=cfg.partial_rotary_factor)
        attention = AttentionSpec(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                  qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=norm,
                                  rotary_dim=rope.rotary_dim)
        # no layer_types: every layer full attention (a config read without the Gated DeltaNet fields)
        linear = gated_delta_spec(cfg) if "linear_attention" in cfg.layer_types else None
        moe = cls.moe_spec(cfg) if cfg.num_experts else None
        layers = []
        for i in range(cfg.num_hidden_layers):
            full = linear is None or cfg.layer_types[i] == "full_attention"
            layers.append(HybridLayerSpec(
                attention if full else dataclasses.replace(attention, rope=False), cfg.intermediate_size,
                cfg.hidden_act, norm, rope_table="default" if full else None,
                moe=moe if cfg.is_sparse(i) else None, linear=None if full else linear, gated_attention=full,
            ))
        return DecoderSpec(cfg.vocab_size, cfg.hidden_size, tuple(layers), norm, {"default": rope},
                           tie_word_embeddings=cfg.tie_word_embeddings)

    @staticmethod
    def checkpoint_fused_map(cfg: ModelArchConfig, tp: TensorParallelGroup | None) -> FusedMap:
        """The shared map (MLP, experts) with the gated attention's and Gated DeltaNet's fused projections."""
        fused = CausalLM.checkpoint_fused_map(cfg, tp)
        q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        fused = {**fused, **gated_fused_map(q_size, kv_size, tp.plan if tp is not None else None)}
        return {**fused, **GatedDeltaNet.fused_map(gated_delta_spec(cfg), tp)} \
            if "linear_attention" in cfg.layer_types else fused

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Qwen3-Next's interleaved projections and every family's (query, gate) rows split, then loaded."""
        super().load_weights(self._checkpoint_names(weights))

    def _checkpoint_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.config
        weights = ((name, t) for name, t in weights if not name.startswith("mtp."))
        if "linear_attention" in cfg.layer_types:
            # the checkpoint interleaves every key head's rows, not only this rank's
            spec = whole_model_spec(gated_delta_spec(cfg), self.tp.size if self.tp is not None else 1)
            weights = split_qwen3_next_projections(weights, spec)
        return split_gated_queries(weights, self.config.head_dim)
