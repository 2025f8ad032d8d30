"""gpt-oss (transformers' ``GptOssForCausalLM``, GGUF architecture ``gpt-oss``) on the shared blocks.

Pre-norm layers (Llama's layout) with what gpt-oss does its own way
(``loader/gpt_oss_config.py`` reads the configuration):

- attention: biases on q, k, v and the output; attention sinks, one learned
  logit per query head in the softmax's denominator (``self_attn.sinks``,
  ``layers/attention.py``); even layers slide over the last
  ``sliding_window`` keys (128), odd ones see every key (``layer_types``);
  RoPE rotates halves with YaRN (factor 32 over 4,096 positions, not truncated);
- every MLP is a mixture of experts (``layers/fused_moe.py``): a router with
  a bias, the ``top_k`` largest logits then a softmax over those only, experts
  with biases on their projections and the clamped SwiGLU
  (``layers/activation.py``: gate clamped above at ``swiglu_limit``, up to
  ``[-limit, limit]``, ``(up + 1) * gate * sigmoid(alpha * gate)``).

Checkpoints. A Hugging Face folder holds each layer's experts stacked:
``mlp.experts.gate_up_proj`` ``[experts, hidden, 2 * inter]`` with gate and up
interleaved by columns (gate in the even ones), ``gate_up_proj_bias``
``[experts, 2 * inter]`` likewise, ``down_proj`` ``[experts, inter, hidden]``
and ``down_proj_bias``; the router is ``mlp.router``. ``load_weights`` hands
them on per expert, as ``[rows, cols]`` weights of the usual orientation and
gate and up apart (``mlp.experts.{e}.gate_proj.weight``...), and the router
as ``mlp.gate``. A folder of MXFP4 blocks (``*_blocks`` / ``*_scales``, the
released checkpoints) is refused: llama.cpp's converter turns it into a GGUF
file that keeps the experts in MXFP4 blocks, which loads. A GGUF file holds
``ffn_{gate,up,down}_exps`` ``[experts, rows, cols]`` (gate and up already
apart: the converter splits the interleaved columns), their biases
``[experts, rows]`` (split per expert here), ``ffn_gate_inp`` with its bias
and ``attn_sinks``.
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

# the Hugging Face folder's stacked experts (and a GGUF file's stacked expert biases)
_STACKED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias|"
                      r"gate_proj\.bias|up_proj\.bias|down_proj\.bias)$")
_MXFP4_PARTS = ("_blocks", "_scales")


class GptOssForCausalLM(CausalLM):
    """gpt-oss's decoder: pre-norm layers with sinks, alternating windows and a mixture of experts in every layer."""

    supports_experts = True

    @classmethod
    def moe_spec(cls, cfg: ModelArchConfig) -> MoESpec:
        """The router (with a bias; top-k, then softmax) and experts (biases, clamped SwiGLU) of every layer."""
        router = RouterSpec(cfg.num_experts, cfg.num_experts_per_tok, order="topk_softmax", bias=True)
        return MoESpec(router, cfg.moe_intermediate_size, cfg.hidden_act, expert_bias=True,
                       swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit)

    @classmethod
    def decoder_spec(cls, cfg: ModelArchConfig) -> DecoderSpec:
        """Per layer: attention with biases on q/k/v/o, sinks and the layer's window, then the experts (every
        layer of gpt-oss is sparse; a dense one would take the gated MLP); one RoPE table (YaRN)."""
        norm = NormSpec(cfg.rms_norm_eps)
        moe = cls.moe_spec(cfg) if cfg.num_experts else None
        layers = tuple(
            DecoderLayerSpec(
                AttentionSpec(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                              qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                              sliding_window=cfg.sliding_window(i), sinks=cfg.attention_sinks),
                cfg.intermediate_size, cfg.hidden_act, norm, moe=moe if cfg.is_sparse(i) else None,
            )
            for i in range(cfg.num_hidden_layers)
        )
        rope = RopeSpec(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                        cfg.rope_freq_factors)
        return DecoderSpec(cfg.vocab_size, cfg.hidden_size, layers, norm, {"default": rope},
                           tie_word_embeddings=cfg.tie_word_embeddings)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's stacked experts and router as the shared block's per-expert names, then loaded."""
        super().load_weights(gpt_oss_per_expert(weights))


def gpt_oss_per_expert(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's stacked experts (a Hugging Face folder's, or a GGUF file's biases) one expert at a time,
    gate and up apart, weights as ``[out, in]``; ``mlp.router`` as ``mlp.gate``. Other tensors pass through."""
    for name, tensor in weights:
        if name.endswith(_MXFP4_PARTS) and ".experts." in name:
            raise ValueError(f"{name}: gpt-oss folders with MXFP4 expert blocks do not load; convert the folder "
                             "with llama.cpp's convert_hf_to_gguf.py (the GGUF file keeps the MXFP4 blocks)")
        m = _STACKED.match(name)
        if m is None:
            yield name.replace(".mlp.router.", ".mlp.gate."), tensor
            continue
        owner, kind = m.groups()
        yield from _per_expert(owner, kind, tensor, name)


def _per_expert(owner: str, kind: str, tensor: torch.Tensor, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    want = 3 if kind in ("gate_up_proj", "down_proj") else 2
    if tensor.dim() != want:
        raise ValueError(f"{name}: gpt-oss's stacked experts must have {want} dimensions, got {tuple(tensor.shape)}")
    for e in range(tensor.shape[0]):
        t = tensor[e]
        if kind == "gate_up_proj":  # [hidden, 2 * inter], gate in the even columns
            yield f"{owner}.{e}.gate_proj.weight", t[:, 0::2].t().contiguous()
            yield f"{owner}.{e}.up_proj.weight", t[:, 1::2].t().contiguous()
        elif kind == "gate_up_proj_bias":
            yield f"{owner}.{e}.gate_proj.bias", t[0::2].contiguous()
            yield f"{owner}.{e}.up_proj.bias", t[1::2].contiguous()
        elif kind == "down_proj":  # [inter, hidden]
            yield f"{owner}.{e}.down_proj.weight", t.t().contiguous()
        elif kind == "down_proj_bias":
            yield f"{owner}.{e}.down_proj.bias", t
        else:  # a GGUF file's [experts, rows] biases of gate_proj / up_proj / down_proj
            yield f"{owner}.{e}.{kind}", t
