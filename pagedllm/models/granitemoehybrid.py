"""Granite 4.0-H (transformers' ``GraniteMoeHybridForCausalLM``, GGUF architecture ``granitehybrid``).

A hybrid: most layers mix tokens with Mamba-2 (``layers/mamba2.py``), a
few with attention (no RoPE unless ``position_embedding_type`` is "rope";
scores scaled by ``attention_multiplier``); every layer's MLP is a mixture
of experts routed as GraniteMoE's (the top-k router logits, then a softmax
over those) plus a shared MLP added to every token, or the shared MLP alone
where the model has no experts. Granite's multipliers as ``granitemoe.py``
applies them. The layers are ``layers/hybrid_decoder.py``'s.

Weights. A folder stores the experts stacked (``block_sparse_moe.input_linear``
/ ``output_linear`` / ``router.layer``, as GraniteMoE: renamed by
``granitemoe_weight_names``) and the shared MLP with gate and up in one
tensor, ``shared_mlp.input_linear.weight`` ``[2 * shared, hidden]``, and
``shared_mlp.output_linear.weight``: they load as the block's
``shared_expert`` (or, with no experts, as the layer's dense MLP). The Mamba
tensors keep their names. llama.cpp's converter writes ``A`` as
``-exp(A_log)`` (``ssm_a``, ``[heads, 1]``), ``D`` as ``[heads, 1]``, the
conv as ``[channels, width]`` and the gated norm as ``[groups, inner /
groups]``: they are taken back to the module's names and shapes here
(``A_log = log(-A)``, exact to float32 rounding).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch

from pagedllm.layers.decoder import CausalLM, DecoderSpec
from pagedllm.layers.fused_moe import MoESpec
from pagedllm.layers.granite_moe_names import granitemoe_weight_names
from pagedllm.layers.hybrid_decoder import HybridDecoderLayer, HybridLayerSpec
from pagedllm.layers.mamba2 import Mamba2Spec
from pagedllm.layers.norm import NormSpec
from pagedllm.layers.parallel import TensorParallelGroup
from pagedllm.layers.rotary import RopeSpec
from pagedllm.layers.router import RouterSpec
from pagedllm.layers.self_attention import AttentionSpec
from pagedllm.layers.weights import FusedMap
from pagedllm.loader.model_config import ModelArchConfig

_SHARED = ".shared_mlp."


def mamba_spec(cfg: ModelArchConfig) -> Mamba2Spec:
    """The Mamba-2 mixers' shape of ``cfg`` (ValueError where the checkpoint has none)."""
    m = cfg.mamba
    if m is None:
        raise ValueError(f"{cfg.architecture}: the configuration has no Mamba-2 fields")
    return Mamba2Spec(cfg.hidden_size, m.num_heads, m.head_dim, m.state_size, m.num_groups, m.conv_kernel,
                      m.intermediate_size, m.chunk_size, m.proj_bias, m.conv_bias, cfg.rms_norm_eps, m.dt_min,
                      m.dt_max)


def _dense_width(cfg: ModelArchConfig) -> int:
    """The dense MLP's width of a model without experts: its shared MLP's."""
    return cfg.shared_expert_intermediate_size or cfg.intermediate_size


def granite_hybrid_weight_names(weights: Iterable[tuple[str, torch.Tensor]],
                                has_experts: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """A folder's or GGUF file's tensors under the model's names and shapes (module docstring)."""
    for name, tensor in granitemoe_weight_names(weights):
        owner, shared, part = name.partition(_SHARED)
        target = f"{owner}.mlp.shared_expert" if has_experts else f"{owner}.mlp"
        if shared and part == "input_linear.weight":
            if tensor.dim() != 2 or tensor.shape[0] % 2:
                raise ValueError(f"{name}: expected [2 * shared, hidden], got {tuple(tensor.shape)}")
            gate, up = tensor.chunk(2)
            yield f"{target}.gate_proj.weight", gate
            yield f"{target}.up_proj.weight", up
        elif shared and part == "output_linear.weight":
            yield f"{target}.down_proj.weight", tensor
        elif shared:
            raise ValueError(f"unexpected Granite shared MLP tensor {name!r}")
        elif name.endswith(".mamba.A"):  # GGUF: A = -exp(A_log)
            yield name + "_log", torch.log(-tensor.float().reshape(-1))
        elif name.endswith((".mamba.D", ".mamba.dt_bias", ".mamba.norm.weight")):
            yield name, tensor.reshape(-1)
        elif name.endswith(".mamba.conv1d.weight") and tensor.dim() == 2:  # GGUF: [channels, width]
            yield name, tensor.unsqueeze(1)
        else:
            yield name, tensor


class GraniteMoeHybridForCausalLM(CausalLM):
    """Granite 4.0-H: Mamba-2 and attention layers, mixture-of-experts MLPs with a shared expert."""

    supports_experts = True
    layer_class = HybridDecoderLayer

    @classmethod
    def decoder_spec(cls, cfg: ModelArchConfig) -> DecoderSpec:
        """Per layer: its mixer (Mamba-2 where ``layer_types`` says "mamba"), then the experts and the shared MLP
        (or the shared MLP alone), each branch scaled by ``residual_multiplier``."""
        norm = NormSpec(cfg.rms_norm_eps)
        # no layer_types: every layer attention (as the plumbing reads it); a Mamba layer needs the Mamba fields
        kinds = cfg.layer_types or ("full_attention",) * cfg.num_hidden_layers
        mamba = mamba_spec(cfg) if "mamba" in kinds else None
        moe = None
        if cfg.num_experts:
            moe = MoESpec(RouterSpec(cfg.num_experts, cfg.num_experts_per_tok, order="topk_softmax"),
                          cfg.moe_intermediate_size, cfg.hidden_act,
                          shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
        residual = None if cfg.residual_multiplier == 1.0 else cfg.residual_multiplier
        layers = tuple(
            HybridLayerSpec(
                AttentionSpec(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                              qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, scale=cfg.attn_scale),
                _dense_width(cfg), cfg.hidden_act, norm, residual_multiplier=residual, moe=moe,
                mamba=mamba if kinds[i] == "mamba" else None,
            )
            for i in range(cfg.num_hidden_layers)
        )
        rope = RopeSpec(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                        cfg.rope_freq_factors)
        spec = DecoderSpec(cfg.vocab_size, cfg.hidden_size, layers, norm, {"default": rope},
                           tie_word_embeddings=cfg.tie_word_embeddings,
                           embed_scale=None if cfg.embedding_multiplier == 1.0 else cfg.embedding_multiplier,
                           logits_scaling=None if cfg.logits_scaling == 1.0 else cfg.logits_scaling)
        mamba_layers = (i for i in range(cfg.num_hidden_layers) if kinds[i] == "mamba")
        return spec.without_rope({*cfg.nope_layers, *mamba_layers})

    @staticmethod
    def checkpoint_fused_map(cfg: ModelArchConfig, tp: TensorParallelGroup | None) -> FusedMap:
        """As any family's, the dense MLP (no experts) being the shared MLP's width."""
        if not cfg.num_experts:
            cfg = dataclasses.replace(cfg, intermediate_size=_dense_width(cfg))
        return CausalLM.checkpoint_fused_map(cfg, tp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The stacked experts split, the shared MLP split into gate and up, GGUF's Mamba tensors reshaped."""
        super().load_weights(granite_hybrid_weight_names(weights, bool(self.config.num_experts)))
