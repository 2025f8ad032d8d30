"""Tiny random mixture-of-experts checkpoints of the families Mixtral, Qwen2-MoE, OLMoE and GraniteMoE.

Each is made with transformers' own config class and model, seeded, and
saved by ``save_pretrained`` with SmolLM2's tokenizer, as
``tests/conftest.py``'s ``save_tiny_models`` saves the dense ones. The
shapes are small (hidden 64, 2 layers, 4 query heads on 2 KV heads) with a
few experts each, and chosen so that each family's routing is exercised:
top-2 of 4 or 8 experts, Qwen2-MoE's shared expert with its sigmoid gate and
unnormalised top-k, OLMoE's q/k norms over whole projections, GraniteMoE's
multipliers far from 1. Norm weights are drawn at random (transformers
starts them at one), so a norm loaded into the wrong place shows.

What ``save_pretrained`` writes for the experts (transformers 5.25 keeps
them fused, ``experts.gate_up_proj`` ``[E, 2I, H]``, and saves the
checkpoint layout each family was published in):

- Mixtral: ``block_sparse_moe.gate.weight`` and, per expert,
  ``block_sparse_moe.experts.{e}.w1/w2/w3.weight`` (gate, down, up);
- Qwen2-MoE and OLMoE: ``mlp.gate.weight`` and
  ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``; Qwen2-MoE adds
  ``mlp.shared_expert.{gate,up,down}_proj.weight`` and
  ``mlp.shared_expert_gate.weight`` ``[1, H]``;
- GraniteMoE: ``block_sparse_moe.router.layer.weight`` and the experts
  stacked, ``block_sparse_moe.input_linear.weight`` ``[E, 2I, H]`` (gate rows
  then up rows) and ``block_sparse_moe.output_linear.weight`` ``[E, H, I]``.
"""

from __future__ import annotations

from pathlib import Path

import torch

MOE_ARCHS = ("mixtral", "qwen2_moe", "olmoe", "granitemoe")
# GraniteMoE's multipliers, each far from 1 so that each one moves the output
GRANITEMOE_MULTIPLIERS = dict(embedding_multiplier=6.0, residual_multiplier=0.4, attention_multiplier=0.05,
                              logits_scaling=3.0)
_COMMON = dict(
    vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def moe_config(arch: str, **overrides: object):  # noqa: ANN201
    """transformers' config of the tiny ``arch`` model (one of ``MOE_ARCHS``), keys replaced by ``overrides``."""
    from transformers import GraniteMoeConfig, MixtralConfig, OlmoeConfig, Qwen2MoeConfig

    if arch == "mixtral":
        cls, keys = MixtralConfig, dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                                        rms_norm_eps=1e-5)
    elif arch == "qwen2_moe":
        # Qwen2-MoE's defaults kept where they matter: q/k/v biases, top-k left unnormalised
        cls, keys = Qwen2MoeConfig, dict(intermediate_size=128, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                                         norm_topk_prob=False, rms_norm_eps=1e-6)
    elif arch == "olmoe":
        cls, keys = OlmoeConfig, dict(intermediate_size=48, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                                      rms_norm_eps=1e-5)
    elif arch == "granitemoe":
        cls, keys = GraniteMoeConfig, dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                           rms_norm_eps=1e-6, **GRANITEMOE_MULTIPLIERS)
    else:
        raise ValueError(f"no tiny MoE config for {arch!r}; known: {MOE_ARCHS}")
    return cls(**{**_COMMON, **keys, **overrides})


def save_tiny_moe(arch: str, path: Path, tokenizer, **overrides: object) -> str:  # noqa: ANN001
    """The tiny ``arch`` model (seeded random weights, norm weights in [0.5, 1.5)) saved to ``path``;
    ``overrides`` replace keys of its config."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(moe_config(arch, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)
