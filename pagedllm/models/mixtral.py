"""Mixtral (transformers' ``MixtralForCausalLM``; llama.cpp writes it as GGUF architecture ``llama`` with experts).

Llama's layers (no biases, a window on every layer where ``sliding_window``
says) with a mixture of experts in place of every MLP
(``layers/fused_moe.py``): a softmax over ``num_local_experts`` router
logits, the ``num_experts_per_tok`` largest probabilities renormalised to
sum to one (always: ``MixtralTopKRouter`` divides by their sum, and
llama.cpp's graph for ``llama`` does too), each expert a SiLU-gated MLP of
``intermediate_size``.

The folder's tensors are the published layout ``save_pretrained`` writes:
``block_sparse_moe.gate.weight`` and per expert
``block_sparse_moe.experts.{e}.w1/w2/w3.weight`` (gate, down, up), renamed
here to the shared blocks' ``mlp.gate`` / ``mlp.experts.{e}.gate_proj``...
The converter's GGUF (``ffn_gate_inp``, ``ffn_{gate,up,down}_exps``, Q/K rows
permuted as Llama's) is read by the GGUF loader under those names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from pagedllm.layers.decoder import CausalLM, DecoderLayerSpec, DecoderSpec
from pagedllm.layers.fused_moe import MoESpec
from pagedllm.layers.norm import NormSpec
from pagedllm.layers.rotary import RopeSpec
from pagedllm.layers.router import RouterSpec
from pagedllm.layers.self_attention import AttentionSpec
from pagedllm.loader.model_config import ModelArchConfig

# Mixtral's expert projections: w1 is the gate, w3 the up projection, w2 the down projection
_MIXTRAL_EXPERT_RE = re.compile(r"^(.*)\.block_sparse_moe\.experts\.(\d+)\.w([123])\.(weight|bias)$")
_MIXTRAL_PARTS = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def mixtral_weight_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A Mixtral folder's tensors under the shared blocks' names (the router ``mlp.gate``, the experts
    ``mlp.experts.{e}.gate_proj/up_proj/down_proj``); every other name as it is."""
    for name, tensor in weights:
        m = _MIXTRAL_EXPERT_RE.match(name)
        if m:
            yield f"{m.group(1)}.mlp.experts.{m.group(2)}.{_MIXTRAL_PARTS[m.group(3)]}.{m.group(4)}", tensor
        else:
            # the router, and transformers 5's in-memory experts (split where CausalLM loads them)
            yield name.replace(".block_sparse_moe.", ".mlp."), tensor


class MixtralForCausalLM(CausalLM):
    """Llama's pre-norm layers, each MLP a mixture of experts routed by softmax, top-k, renormalised."""

    supports_experts = True

    @classmethod
    def moe_spec(cls, cfg: ModelArchConfig) -> MoESpec:
        """A layer's block: softmax, then top-k, always renormalised (``MixtralTopKRouter``)."""
        router = RouterSpec(cfg.num_experts, cfg.num_experts_per_tok, renormalize=True)
        return MoESpec(router, cfg.moe_intermediate_size, cfg.hidden_act)

    @classmethod
    def decoder_spec(cls, cfg: ModelArchConfig) -> DecoderSpec:
        """Per layer: Llama's attention (no biases, the layer's window), then a renormalised top-k of
        ``cfg.num_experts`` SiLU experts."""
        norm = NormSpec(cfg.rms_norm_eps)
        moe = cls.moe_spec(cfg) if cfg.num_experts else None  # no experts: every layer dense
        layers = tuple(
            DecoderLayerSpec(
                AttentionSpec(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                              sliding_window=cfg.sliding_window(i)),
                cfg.intermediate_size, cfg.hidden_act, norm, moe=moe if cfg.is_sparse(i) else None,
            )
            for i in range(cfg.num_hidden_layers)
        )
        rope = RopeSpec(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                        cfg.rope_freq_factors)
        return DecoderSpec(cfg.vocab_size, cfg.hidden_size, layers, norm, {"default": rope},
                           tie_word_embeddings=cfg.tie_word_embeddings)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Mixtral's names renamed to the shared blocks', then loaded as any family's."""
        super().load_weights(mixtral_weight_names(weights))
