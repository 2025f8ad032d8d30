"""Gemma 4, text only (transformers' ``Gemma4ForCausalLM``, model_type ``gemma4_text``), dense (31B) and with
experts (26B-A4B), on the shared blocks and Gemma 4's layer (``layers/gemma4_layer.py``).

Where it differs from Gemma 3, each as transformers computes it:

- every RMSNorm multiplies by its weight as stored (float32, then cast),
  not by ``1 + w``; values are RMS-normed per head too, without a weight;
- scores are not scaled (q and k are normed instead) nor capped; logits are
  capped by ``final_logit_softcapping``;
- sliding layers rotate by the "local" table (``head_dim``, default RoPE);
  global layers have their own head size and kv heads and rotate by the
  "full" table, ``proportional`` RoPE over the whole global head with a
  ``partial_rotary_factor`` of it at non-zero frequencies; with
  ``attention_k_eq_v`` a global layer's values are its keys' projection;
- each layer ends multiplied by its ``layer_scalar``;
- with ``enable_moe_block``, every layer runs a mixture of experts beside
  the dense MLP, the two branches normed and summed;
- embeddings are scaled by ``sqrt(hidden_size)`` (rounded to the model's
  dtype); the LM head is usually tied to the embedding.

A Gemma4ForConditionalGeneration folder (the Hub's releases) runs its text
model: ``model.language_model.*`` loads as ``model.*``, and its vision and
audio towers and their embedders are not loaded (text prompts only).
Per-layer embeddings (E2B/E4B) and KV sharing between layers are refused
when the configuration is read (``loader/gemma4_config.py``). Tensor parallelism splits each layer's heads
(the same query heads in every layer; a global layer's own kv heads), the dense MLP and every expert
(``layers/gemma4_layer.py``). GGUF files of
llama.cpp's converter (architecture ``gemma4``) load under the same names
(``loader/gguf_gemma4.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagedllm.layers.decoder import CausalLM, DecoderSpec
from pagedllm.layers.fused_moe import MoESpec, moe_fused_projections
from pagedllm.layers.gemma4_attention import Gemma4AttentionShape, head_rows
from pagedllm.layers.gemma4_layer import Gemma4DecoderLayer, Gemma4LayerSpec
from pagedllm.layers.norm import NormSpec
from pagedllm.layers.parallel import TensorParallelGroup
from pagedllm.layers.rotary import RopeSpec
from pagedllm.layers.router import RouterSpec
from pagedllm.layers.self_attention import AttentionSpec
from pagedllm.layers.weights import FusedMap, fused_projections
from pagedllm.loader.model_config import ModelArchConfig

# a Gemma4ForConditionalGeneration checkpoint: where its text model's tensors sit, and the towers not loaded
_MULTIMODAL_TEXT_PREFIX = "model.language_model."
_MULTIMODAL_SKIPPED = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")


def text_model_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A Gemma4ForConditionalGeneration checkpoint's tensors as its text model's (``Gemma4ForCausalLM``'s)
    names; the vision and audio towers' tensors left out."""
    for name, tensor in weights:
        if name.startswith(_MULTIMODAL_SKIPPED):
            continue
        if name.startswith(_MULTIMODAL_TEXT_PREFIX):
            name = "model." + name.removeprefix(_MULTIMODAL_TEXT_PREFIX)
        yield name, tensor


class Gemma4ForCausalLM(CausalLM):
    """Gemma 4's decoder: two attention shapes, two RoPE tables, experts beside the MLP where configured."""

    supports_experts = True
    layer_class = Gemma4DecoderLayer

    @classmethod
    def moe_spec(cls, cfg: ModelArchConfig) -> MoESpec | None:
        """The experts every layer runs beside its MLP (None: a dense model): softmax, top-k, renormalised."""
        if not cfg.num_experts:
            return None
        router = RouterSpec(cfg.num_experts, cfg.num_experts_per_tok, renormalize=True)
        return MoESpec(router, cfg.moe_intermediate_size, cfg.hidden_act)

    @classmethod
    def decoder_spec(cls, cfg: ModelArchConfig) -> DecoderSpec:
        """Per layer: its attention shape and table (sliding: "local", global: "full"), the dense MLP, the experts."""
        if cfg.architecture != "gemma4":
            raise ValueError(f"Gemma4ForCausalLM cannot run a {cfg.architecture!r} model")
        norm = NormSpec(cfg.rms_norm_eps, float32_weight=True)
        moe = cls.moe_spec(cfg)
        layers = []
        for i in range(cfg.num_hidden_layers):
            num_kv_heads, head_dim = cfg.attention_shape(i)
            # no layer types (a configuration not read from a Gemma 4 checkpoint): every layer local
            is_global = bool(cfg.layer_types) and cfg.layer_types[i] == "full_attention"
            attention = AttentionSpec(cfg.hidden_size, cfg.num_attention_heads, num_kv_heads, head_dim,
                                      qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, scale=cfg.attn_scale,
                                      sliding_window=cfg.sliding_window(i))
            shape = Gemma4AttentionShape(cfg.attention_k_eq_v and is_global, cfg.cache_kv_heads, cfg.cache_head_dim,
                                         global_layer=is_global and bool(cfg.global_head_dim))
            layers.append(Gemma4LayerSpec(attention, cfg.intermediate_size, cfg.hidden_act, norm,
                                          rope_table="full" if is_global else "local", post_norms=True,
                                          mlp_bias=False, moe=moe, shape=shape))
        max_pos = cfg.max_position_embeddings
        global_head_dim = cfg.global_head_dim or cfg.head_dim
        local_theta = cfg.local_rope_theta if cfg.local_rope_theta is not None else cfg.rope_theta
        tables = {"full": RopeSpec(global_head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling),
                  "local": RopeSpec(cfg.head_dim, max_pos, local_theta, cfg.local_rope_scaling)}
        return DecoderSpec(cfg.vocab_size, cfg.hidden_size, tuple(layers), norm, tables,
                           embed_scale=cfg.hidden_size**0.5, final_logit_softcap=cfg.final_logit_softcapping,
                           tie_word_embeddings=cfg.tie_word_embeddings)

    @classmethod
    def checkpoint_fused_map(cls, cfg: ModelArchConfig, tp: TensorParallelGroup | None) -> FusedMap:
        """Only the dense MLP's gate/up (and the experts' parts) fuse: q, k and v are separate layers here,
        their sizes differing between sliding and global layers. Under tensor parallelism each layer's q, k and
        v take this rank's rows of the checkpoint's (entries of their own, each layer's head size), gate/up and
        the experts' gate/up this rank's intermediate rows."""
        sharded = tp is not None and tp.size > 1
        plan = tp.plan if sharded else None
        fused = {part: where for part, where in fused_projections(0, 0, cfg.intermediate_size, plan).items()
                 if part in ("gate_proj", "up_proj")}
        if sharded:
            fused = {**cls._attention_rows(cfg, tp), **fused}
        if cfg.num_experts:
            fused = {**moe_fused_projections(cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size,
                                             expert_start=plan.expert_intermediate[0] if sharded else None),
                     **fused}
        return fused

    @classmethod
    def _attention_rows(cls, cfg: ModelArchConfig, tp: TensorParallelGroup) -> FusedMap:
        """Each layer's q/k/v (``layers.{i}.self_attn.q_proj``...) -> this rank's rows of the whole model's
        tensor (``cfg``: this rank's shape)."""
        rows: FusedMap = {}
        for i, layer in enumerate(cls.decoder_spec(cfg).layers):
            head_dim = layer.attention.head_dim
            q_first, kv_first = head_rows(layer.shape, head_dim, tp)
            q_size, kv_size = layer.attention.num_heads * head_dim, layer.attention.num_kv_heads * head_dim
            for part, first, size in (("q_proj", q_first, q_size), ("k_proj", kv_first, kv_size),
                                      ("v_proj", kv_first, kv_size)):
                name = f"layers.{i}.self_attn.{part}"
                rows[name] = (name, 0, size, first)
        return rows

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As ``CausalLM.load_weights``; a Gemma4ForConditionalGeneration checkpoint's text model only."""
        if "Gemma4ForConditionalGeneration" in self.config.architectures:
            weights = text_model_weights(weights)
        super().load_weights(weights)
