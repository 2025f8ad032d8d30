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
        """The checkpoint's fused ``qkv_proj`` / ``gate_up_proj`` split into q/k/v and gate/up, then loaded."""
        if self.tp is not None and self.tp.plan.size > 1:
            # the split needs the whole model's head counts; a rank holds only its own (ShardPlan.local_config)
            raise ValueError("phi3 checkpoints (fused qkv_proj / gate_up_proj) do not load with tensor "
                             "parallelism yet; run them in one process")
        super().load_weights(self._split(weights))

    def _split(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.config
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        return split_fused_checkpoint(weights, {
            "qkv_proj": (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)),
            "gate_up_proj": (("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size)),
        })
