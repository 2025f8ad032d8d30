"""GraniteMoE (transformers' ``GraniteMoeForCausalLM``, GGUF architecture ``granitemoe``) on the shared blocks.

Granite's pre-norm layers with its four multipliers, as
``GraniteForCausalLM`` applies them: ``embedding_multiplier`` scales the
embeddings, ``residual_multiplier`` each branch before its residual add,
``attention_multiplier`` is the score scale (in place of ``head_dim **
-0.5``), ``logits_scaling`` divides the logits (a GGUF file whose
``rope.scaling.finetuned`` is false rotates no layer); and every MLP a
mixture of experts (``layers/fused_moe.py``) routed as
``GraniteMoeTopKRouter`` routes: the ``num_experts_per_tok``
largest router logits, then a softmax over those only
(``RouterSpec.order="topk_softmax"``), experts of ``intermediate_size``.

The folder stores the experts stacked, as transformers' JetMoE-style
``ParallelExperts`` did: ``block_sparse_moe.input_linear.weight``
``[experts, 2 * intermediate, hidden]`` (each expert's gate rows, then its up
rows), ``block_sparse_moe.output_linear.weight`` ``[experts, hidden,
intermediate]`` and the router ``block_sparse_moe.router.layer.weight``; they
are handed to the shared blocks one expert at a time under
``mlp.experts.{e}.gate_proj/up_proj/down_proj`` and ``mlp.gate``.
llama.cpp's converter splits gate from up itself (``ffn_gate_exps``,
``ffn_up_exps``) and permutes Q/K rows as Granite's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedllm.layers.decoder import CausalLM, DecoderLayerSpec, DecoderSpec
from pagedllm.layers.fused_moe import MoESpec
from pagedllm.layers.granite_moe_names import granitemoe_weight_names
from pagedllm.layers.norm import NormSpec
from pagedllm.layers.rotary import RopeSpec
from pagedllm.layers.router import RouterSpec
from pagedllm.layers.self_attention import AttentionSpec
from pagedllm.loader.model_config import ModelArchConfig


class GraniteMoeForCausalLM(CausalLM):
    """Granite's multiplied layers, each MLP a mixture of experts routed by top-k logits, then softmax."""

    supports_experts = True

    @classmethod
    def moe_spec(cls, cfg: ModelArchConfig) -> MoESpec:
        """A layer's block: the top-k router logits, then a softmax over them."""
        router = RouterSpec(cfg.num_experts, cfg.num_experts_per_tok, order="topk_softmax")
        return MoESpec(router, cfg.moe_intermediate_size, cfg.hidden_act)

    @classmethod
    def decoder_spec(cls, cfg: ModelArchConfig) -> DecoderSpec:
        """Per layer: attention scaled by ``attention_multiplier``, the experts (softmax over the top-k router
        logits), each branch scaled by ``residual_multiplier``; a multiplier of 1 adds no work."""
        norm = NormSpec(cfg.rms_norm_eps)
        moe = cls.moe_spec(cfg) if cfg.num_experts else None  # no experts: every layer dense
        residual = None if cfg.residual_multiplier == 1.0 else cfg.residual_multiplier
        layers = tuple(
            DecoderLayerSpec(
                AttentionSpec(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                              qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, scale=cfg.attn_scale),
                cfg.intermediate_size, cfg.hidden_act, norm, residual_multiplier=residual,
                moe=moe if cfg.is_sparse(i) else None,
            )
            for i in range(cfg.num_hidden_layers)
        )
        rope = RopeSpec(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                        cfg.rope_freq_factors)
        spec = DecoderSpec(cfg.vocab_size, cfg.hidden_size, layers, norm, {"default": rope},
                           tie_word_embeddings=cfg.tie_word_embeddings,
                           embed_scale=None if cfg.embedding_multiplier == 1.0 else cfg.embedding_multiplier,
                           logits_scaling=None if cfg.logits_scaling == 1.0 else cfg.logits_scaling)
        return spec.without_rope(cfg.nope_layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The stacked experts split per expert and renamed, then loaded as any family's."""
        super().load_weights(granitemoe_weight_names(weights))
