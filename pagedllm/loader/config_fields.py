"""config.json fields that change a model's arithmetic: which families honour them, and refusing the rest by name.

``model_config.from_hf_config`` reads what each family's transformers class
reads (head counts and sizes, ``head_dim``, ``rms_norm_eps``, RoPE,
``hidden_act``, ``attention_bias``, ``mlp_bias`` where Llama reads it,
``tie_word_embeddings``, sliding windows...). A config.json may also carry
a field of another family (a softcap, a q/k-norm switch, a partial
rotation, Granite's multipliers) that the family it names does not
compute: ``check_unread_fields`` refuses such a field, by name, whenever
its value would change the result, instead of running a different model
than the checkpoint describes. A field at its neutral value (``null``,
``false``, ``1.0``) is accepted: many checkpoints carry ``"mlp_bias":
false`` or ``"pretraining_tp": 1``.

``pretraining_tp`` is honoured without code: transformers 4 computed the
same products in slices, transformers 5 no longer reads it.

Mixtures of experts are counted here (``num_experts``); the registry refuses
them, naming the architecture, for a family that computes no experts. The
fields of the experts that change the arithmetic (a router's scoring and
scaling, shared experts, grouped top-k, dense layers) are refused by name
where the family does not compute them; Qwen3-MoE honours its own
(``norm_topk_prob``, ``decoder_sparse_step``, ``mlp_only_layers``), and so
do Mixtral, Qwen2-MoE, OLMoE and GraniteMoE theirs (``loader/moe_families_config.py``). Gemma 4's own
fields (per-layer embeddings, KV sharing, global layers' shapes, its experts)
are read or refused by name in ``loader/gemma4_config.py``; the fields here
that its transformers class does not read (``query_pre_attn_scalar``, a score
softcap) are refused for it like for any other.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

# field -> (its neutral values, the families (ModelArchConfig.architecture) whose transformers class computes it);
# a field set to anything else in a config.json of another of the families below is refused
_FIELDS: dict[str, tuple[tuple[Any, ...], tuple[str, ...]]] = {
    "mlp_bias": ((None, False), ("llama",)),
    "attention_bias": ((None, False), ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma3", "gemma4", "olmo2", "olmoe",
                                       "granitemoe")),
    "attn_logit_softcapping": ((None,), ("gemma3",)),  # gemma3: read and ignored, as transformers does
    "final_logit_softcapping": ((None,), ("gemma3", "gemma4")),
    "query_pre_attn_scalar": ((None,), ("gemma3",)),
    "use_qk_norm": ((None, False), ()),
    "qk_layernorm": ((None, False), ()),
    "clip_qkv": ((None,), ()),
    # Qwen2MoeConfig writes 0 when use_sliding_window is off (its reading refuses the window on)
    "sliding_window": ((None,), ("mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3", "gemma4", "mixtral", "qwen2_moe")),
    "use_sliding_window": ((None, False), ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe")),
    "embedding_multiplier": ((None, 1, 1.0), ("granitemoe",)),
    "residual_multiplier": ((None, 1, 1.0), ("granitemoe",)),
    "attention_multiplier": ((None,), ("granitemoe",)),
    "logits_scaling": ((None, 1, 1.0), ("granitemoe",)),
    "scale_emb": ((None, 1, 1.0), ()),
    "scale_depth": ((None, 1, 1.0), ()),
    "no_rope_layers": ((None,), ()),
    # mixtures of experts (loader/moe_config.py reads the counts and sizes): Qwen3-MoE's dense layers, and the
    # routers and shared experts of other families, refused where the family named does not compute them
    "norm_topk_prob": ((None, False), ("qwen3_moe", "qwen2_moe", "olmoe", "gemma4")),  # gemma4: always renormalised
    "decoder_sparse_step": ((None, 1), ("qwen3_moe", "qwen2_moe")),
    "mlp_only_layers": ((None, []), ("qwen3_moe", "qwen2_moe")),
    "shared_expert_intermediate_size": ((None, 0), ("qwen2_moe",)),
    "n_shared_experts": ((None, 0), ()),
    "routed_scaling_factor": ((None, 1, 1.0), ()),
    "scoring_func": ((None, "softmax"), ()),
    "topk_method": ((None, "greedy"), ()),
    "n_group": ((None, 1), ()),
    "topk_group": ((None, 1), ()),
    "first_k_dense_replace": ((None, 0), ()),
    "moe_layer_freq": ((None, 1), ()),
}
# the families this table was written for (other families read their config.json in their own way)
AUDITED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3", "gemma4", "olmo2", "mixtral",
                         "qwen2_moe", "olmoe", "granitemoe")
# the GGUF metadata (under "<arch>.") that changes the arithmetic of these architectures' files, with its neutral
# values: the loader reads none of it for them, so a file that sets it is refused
_GGUF_KEYS: dict[str, tuple[Any, ...]] = {
    "attention.sliding_window": (0,),  # OLMo 3 is written as "olmo2" with windows
    "attention.sliding_window_pattern": (),
    "attention.clamp_kqv": (),
    "attention.scale": (),
    "attn_logit_softcapping": (),
    "final_logit_softcapping": (),
    "logit_scale": (1.0,),
    "embedding_scale": (1.0,),
    "residual_scale": (1.0,),
    # mixtures of experts: a softmax router (llama.cpp's gating function 1), unscaled weights, no shared or
    # leading dense experts; the expert counts, sizes and expert_weights_norm are read (loader/moe_config.py)
    "expert_gating_func": (0, 1),  # 0: none given, the architecture's own (softmax here)
    "expert_weights_scale": (0.0, 1.0),
    "expert_shared_count": (0,),
    "expert_shared_feed_forward_length": (0,),
    "leading_dense_block_count": (0,),
    "expert_group_count": (0, 1),
    "expert_group_used_count": (0, 1),
}
AUDITED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3moe", "olmo2", "qwen2moe", "olmoe")
# GGUF keys of the table above that an architecture computes (Qwen2-MoE's shared expert)
_GGUF_HONOURED: dict[str, tuple[str, ...]] = {"expert_shared_feed_forward_length": ("qwen2moe",)}
# how config.json says "mixture of experts" (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek, gpt-oss)
_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def check_unread_fields(cfg: dict[str, Any], arch: str) -> None:
    """ValueError naming the first config.json field that ``arch``'s model would not compute as set.

    Only for the families of ``AUDITED_ARCHITECTURES``; any other
    architecture is the registry's to accept or refuse.
    """
    if arch not in AUDITED_ARCHITECTURES:
        return
    for name, (neutral, honoured_by) in _FIELDS.items():
        value = cfg.get(name)
        if arch in honoured_by or any(value == n and type(value) is type(n) for n in neutral):
            continue
        allowed = " or ".join(json.dumps(n) for n in neutral)
        raise ValueError(f"config.json sets {name}={json.dumps(value)}, which the {arch!r} architecture does not "
                         f"compute; leave it out or set it to {allowed}")
    _check_partial_rotation(cfg, arch)
    if "layer_norm_eps" in cfg and "rms_norm_eps" not in cfg:
        # these families normalise by RMSNorm with rms_norm_eps; a LayerNorm epsilon is another model's
        raise ValueError(f"config.json sets layer_norm_eps but no rms_norm_eps; the {arch!r} architecture uses "
                         "RMSNorm with rms_norm_eps")


def check_unread_gguf_metadata(key: Callable[[str], object], arch: str, head_dim: int) -> None:
    """ValueError naming the first GGUF metadata key (``key(name)`` reads ``<arch>.<name>``, None if absent) that
    a file of ``arch`` sets and the loader does not compute: a partial rotation (``rope.dimension_count`` short of
    the head), windows, caps and scales of other architectures. Only for ``AUDITED_GGUF_ARCHITECTURES``."""
    if arch not in AUDITED_GGUF_ARCHITECTURES:
        return
    rotated = key("rope.dimension_count")
    if rotated is not None and int(rotated) != head_dim:
        raise ValueError(f"GGUF {arch}.rope.dimension_count={rotated} rotates part of each head of {head_dim}: "
                         "partial rotations are not supported for this architecture")
    for name, neutral in _GGUF_KEYS.items():
        value = key(name)
        if value is not None and value not in neutral and arch not in _GGUF_HONOURED.get(name, ()):
            raise ValueError(f"GGUF {arch}.{name}={value!r} is not computed for architecture {arch!r} "
                             "(this file is another model than the architecture's loader reads)")
    if key("attention.layer_norm_epsilon") is not None and key("attention.layer_norm_rms_epsilon") is None:
        raise ValueError(f"GGUF {arch}.attention.layer_norm_epsilon without layer_norm_rms_epsilon: architecture "
                         f"{arch!r} uses RMSNorm")


def _check_partial_rotation(cfg: dict[str, Any], arch: str) -> None:
    """A ``partial_rotary_factor`` under the default RoPE is refused: the default frequencies rotate the whole
    head (transformers' default ignores the factor). A scaled RoPE reads it (``proportional`` rotates part of
    the head), and its table refuses what it cannot compute when it is built (``layers/rotary.py``)."""
    factor = cfg.get("partial_rotary_factor")
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = params.get("rope_type", params.get("type")) or "default"
    if factor not in (None, 1, 1.0) and kind == "default":
        raise ValueError(f"config.json sets partial_rotary_factor={json.dumps(factor)} with the default RoPE, which "
                         f"rotates whole heads in the {arch!r} architecture; leave it out or set it to 1.0")


def num_experts(cfg: dict[str, Any]) -> int:
    """How many experts a config.json's MLPs route between; 0 for a dense model."""
    for key in _EXPERT_COUNT_KEYS:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0
