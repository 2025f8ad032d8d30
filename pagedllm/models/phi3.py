"""Phi-3 (transformers' ``Phi3ForCausalLM``: Phi-3-mini, Phi-3.5-mini, Phi-4-mini) on the shared blocks.

Llama's pre-norm layers, with what Phi-3 does its own way:

- the checkpoint stores q/k/v as one ``qkv_proj`` and gate/up as one
  ``gate_up_proj`` (gate rows first), as a GGUF file of it stores
  ``attn_qkv`` and ``ffn_up``: ``load_weights`` splits each into its parts
  by rows, so they load through the same fused map as every family's
  (quantized blocks, weight-only rounding and GGUF kernels alike);
- RoPE may be ``longrope`` (short and long factors, an attention factor on
  cos and sin) and may rotate only part of each head
  (``partial_rotary_factor``, Phi-4-mini's 0.75), which the native q/k pass
  does not do: such layers rotate in torch (``layers/qk_rotary.py``);
- ``sliding_window``, when set, masks every layer (Phi-3-mini's 2047);
- no biases; the LM head is tied to the embedding where the config says
  (Phi-4-mini).

Under tensor parallelism the fused tensors are split by the whole model's
sizes (the shard plan's), then each rank takes its q, k, v rows and its gate
and up rows of the parts, from a folder and a GGUF file alike.

Which of longrope's factor sets a token uses is transformers' choice for its
sequence (``layers/rotary.py``: one table of both sets, a row per token).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagedllm.layers.decoder import CausalLM, DecoderLayerSpec, DecoderSpec
from pagedllm.layers.norm import NormSpec
from pagedllm.layers.rotary import RopeSpec
from pagedllm.layers.self_attention import AttentionSpec
from pagedllm.layers.weights import split_fused_checkpoint
from pagedllm.loader.model_config import ModelArchConfig


class Phi3ForCausalLM(CausalLM):
    """Phi-3's decoder: Llama's layers with fused checkpoint projections, LongRoPE and partial rotation."""

    @classmethod
    def decoder_spec(cls, cfg: ModelArchConfig) -> DecoderSpec:
        """Pre-normed layers, one RoPE table of ``rope_theta``, the longrope scaling and the rotated part."""
        rope = RopeSpec(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                        partial_rotary_factor=cfg.partial_rotary_factor)
        norm = NormSpec(cfg.rms_norm_eps)
        layers = tuple(
            DecoderLayerSpec(
                AttentionSpec(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                              sliding_window=cfg.sliding_window(i), rotary_dim=rope.rotary_dim),
                cfg.intermediate_size, cfg.hidden_act, norm,
            )
            for i in range(cfg.num_hidden_layers)
        )
        return DecoderSpec(cfg.vocab_size, cfg.hidden_size, layers, norm, {"default": rope},
                           tie_word_embeddings=cfg.tie_word_embeddings)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's fused ``qkv_proj`` / ``gate_up_proj`` split into q/k/v and gate/up, then loaded.

        The split is by the whole model's rows, whatever this process holds: a tensor-parallel rank's config
        has its own head counts only, so its sizes come from its shard plan; each part then goes through the
        fused map like any family's separate q/k/v, which takes this rank's rows of it.
        """
        super().load_weights(self._split(weights))

    def _split(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.config
        if self.tp is not None and self.tp.plan.size > 1:
            plan = self.tp.plan
            q_size, kv_size, intermediate = plan.total_q_size, plan.total_kv_size, plan.total_intermediate
        else:
            q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            intermediate = cfg.intermediate_size
        return split_fused_checkpoint(weights, {
            "qkv_proj": (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)),
            "gate_up_proj": (("gate_proj", intermediate), ("up_proj", intermediate)),
        })
