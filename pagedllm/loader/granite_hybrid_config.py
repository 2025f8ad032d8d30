"""Granite 4.0-H (``granitemoehybrid``) read from config.json or GGUF metadata: its Mamba-2 layers' shape.

``Mamba2Config`` is what a Mamba-2 mixer needs (``layers/mamba2.py``'s
``Mamba2Spec`` is built from it), held by ``ModelArchConfig.mamba``.

config.json, as transformers 5.25's ``GraniteMoeHybridConfig`` reads it:
``mamba_n_heads`` (128), ``mamba_n_groups`` (1), ``mamba_d_state`` (256),
``mamba_d_head`` ("auto": ``mamba_expand * hidden_size / mamba_n_heads``),
``mamba_d_conv`` (4), ``mamba_expand`` (2), ``mamba_chunk_size`` (256),
``mamba_conv_bias`` (true), ``mamba_proj_bias`` (false), ``time_step_limit``
((0, inf)), defaults in brackets. ``layer_types`` names each layer "mamba"
or "attention" (the published checkpoints) or, once transformers has saved
it, "linear_attention" / "full_attention"; here a Mamba layer is "mamba"
and an attention layer "full_attention". ``position_embedding_type`` "rope"
rotates the attention layers' q and k; anything else (Granite 4.0-H's
null, "nope") rotates none. The experts: ``num_local_experts`` (8; 0: no
experts, the shared MLP alone), ``num_experts_per_tok`` (2), each
``intermediate_size`` wide, the top-k logits softmaxed; a shared MLP of
``shared_intermediate_size`` (1024) added to every token; and Granite's
four multipliers.

GGUF ``granitehybrid``, as llama.cpp's converter writes it:
``ssm.conv_kernel``, ``ssm.state_size``, ``ssm.group_count``,
``ssm.inner_size`` and ``ssm.time_step_rank`` (the head count; llama.cpp's
reading of that key for Mamba-2); ``attention.head_count_kv`` one entry per
layer, 0 for a Mamba layer; ``rope.scaling.finetuned`` false (no RoPE) for
the hybrids. The converter keeps no chunk size (it changes no result) and
no time step limit (llama.cpp clamps none).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

# model_config imports this module, so the configuration is typed by a variable (a ModelArchConfig)
ArchConfig = TypeVar("ArchConfig")

HF_ARCHITECTURE = "granitemoehybrid"
GGUF_ARCHITECTURE = "granitehybrid"
_MAMBA_TYPES = ("mamba", "linear_attention")
_ATTENTION_TYPES = ("attention", "full_attention")
# GraniteMoeHybridConfig's defaults, for a config.json that leaves a key out
HF_DEFAULTS: dict[str, Any] = {
    "mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_head": "auto", "mamba_d_conv": 4,
    "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False,
    "num_local_experts": 8, "num_experts_per_tok": 2, "shared_intermediate_size": 1024,
}


@dataclass(frozen=True)
class Mamba2Config:
    """The Mamba-2 layers' shape: heads of ``head_dim``, ``state_size`` per head, B and C in ``num_groups``."""

    num_heads: int
    head_dim: int
    state_size: int
    num_groups: int
    conv_kernel: int
    intermediate_size: int
    chunk_size: int = 256
    conv_bias: bool = True
    proj_bias: bool = False
    dt_min: float = 0.0
    dt_max: float = math.inf

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "state_size", "num_groups", "conv_kernel", "chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Mamba-2: {name} must be a positive integer, got {value!r}")
        if self.num_heads * self.head_dim != self.intermediate_size:
            raise ValueError(f"Mamba-2: {self.num_heads} heads of {self.head_dim} do not make the inner size "
                             f"{self.intermediate_size}")
        if self.num_heads % self.num_groups:
            raise ValueError(f"Mamba-2: {self.num_heads} heads do not split into {self.num_groups} groups")
        if not 0.0 <= self.dt_min <= self.dt_max:
            raise ValueError(f"Mamba-2: time_step_limit must be 0 <= min <= max, got ({self.dt_min}, {self.dt_max})")


def _positive_int(cfg: dict[str, Any], key: str) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{HF_ARCHITECTURE}: {key} must be a positive integer, got {value!r}")
    return value


def _limit(value: object) -> float:
    """One end of ``time_step_limit``: a number, or transformers' JSON spelling of infinity
    (``{"__float__": "Infinity"}``)."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{HF_ARCHITECTURE}: time_step_limit holds {value!r}, not a number") from None


def _hf_layer_types(cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * num_layers
    if len(types) != num_layers or any(t not in _MAMBA_TYPES + _ATTENTION_TYPES for t in types):
        raise ValueError(f"{HF_ARCHITECTURE}: layer_types must name each of the {num_layers} layers one of "
                         f"{_MAMBA_TYPES + _ATTENTION_TYPES}, got {types!r}")
    return tuple("mamba" if t in _MAMBA_TYPES else "full_attention" for t in types)


def _hf_mamba(cfg: dict[str, Any], hidden: int) -> Mamba2Config:
    heads = _positive_int(cfg, "mamba_n_heads")
    inner = _positive_int(cfg, "mamba_expand") * hidden
    head_dim = inner // heads if cfg["mamba_d_head"] == "auto" else _positive_int(cfg, "mamba_d_head")
    limit = cfg.get("time_step_limit") or (0.0, math.inf)
    if len(limit) != 2:
        raise ValueError(f"{HF_ARCHITECTURE}: time_step_limit must be (min, max), got {limit!r}")
    return Mamba2Config(heads, head_dim, _positive_int(cfg, "mamba_d_state"), _positive_int(cfg, "mamba_n_groups"),
                        _positive_int(cfg, "mamba_d_conv"), inner, _positive_int(cfg, "mamba_chunk_size"),
                        bool(cfg["mamba_conv_bias"]), bool(cfg["mamba_proj_bias"]), _limit(limit[0]), _limit(limit[1]))


def hf_granite_hybrid_fields(config: ArchConfig, cfg: dict[str, Any]) -> ArchConfig:
    """``config`` with Granite 4.0-H's fields read from config.json ``cfg``; other architectures unchanged."""
    if config.architecture != HF_ARCHITECTURE:
        return config
    from pagedllm.loader.smollm3_granite_config import granite_multipliers_hf

    cfg = {**HF_DEFAULTS, **cfg}
    n = config.num_hidden_layers
    experts = int(cfg["num_local_experts"] or 0)
    fields: dict[str, Any] = dict(
        layer_types=_hf_layer_types(cfg, n), mamba=_hf_mamba(cfg, config.hidden_size),
        num_experts=experts, num_experts_per_tok=int(cfg["num_experts_per_tok"]) if experts else 0,
        moe_intermediate_size=config.intermediate_size if experts else 0, norm_topk_prob=bool(experts),
        shared_expert_intermediate_size=int(cfg["shared_intermediate_size"]), dense_layers=(),
        # without experts the shared MLP is the dense one: its width is the model's (what a tensor-parallel
        # rank's MLP rows are cut from)
        intermediate_size=config.intermediate_size if experts else int(cfg["shared_intermediate_size"]),
        **granite_multipliers_hf(cfg),
    )
    if cfg.get("position_embedding_type") != "rope":
        fields["nope_layers"] = tuple(range(n))
    return dataclasses.replace(config, **fields)


def gguf_granite_hybrid_fields(config: ArchConfig, key: Callable[[str], object],
                               tensor_names: Iterable[str]) -> ArchConfig:
    """``config`` (a GGUF file's; ``key(name)`` reads ``<arch>.<name>``) with Granite 4.0-H's fields."""
    if config.architecture != GGUF_ARCHITECTURE:
        return config
    n = config.num_hidden_layers
    kv = key("attention.head_count_kv")
    per_layer = list(kv) if isinstance(kv, (list, tuple)) else [int(kv)] * n
    if len(per_layer) != n:
        raise ValueError(f"GGUF {GGUF_ARCHITECTURE}.attention.head_count_kv has {len(per_layer)} entries for {n} "
                         "layers")
    names = set(tensor_names)
    needed = ("ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.inner_size", "ssm.time_step_rank")
    missing = [k for k in needed if key(k) is None]
    if missing:
        raise ValueError(f"GGUF {GGUF_ARCHITECTURE} file lacks {[f'{GGUF_ARCHITECTURE}.{k}' for k in missing]}")
    heads, inner = int(key("ssm.time_step_rank")), int(key("ssm.inner_size"))
    mamba = Mamba2Config(heads, inner // heads if heads else 0, int(key("ssm.state_size")),
                         int(key("ssm.group_count")), int(key("ssm.conv_kernel")), inner,
                         conv_bias=any(t.endswith("ssm_conv1d.bias") for t in names),
                         proj_bias=any(t.endswith("ssm_in.bias") for t in names))
    shared = int(key("expert_shared_feed_forward_length") or 0)
    fields: dict[str, Any] = dict(
        layer_types=tuple("mamba" if int(h) == 0 else "full_attention" for h in per_layer), mamba=mamba,
        shared_expert_intermediate_size=shared,
        norm_topk_prob=bool(config.num_experts),
        # without experts the shared MLP is the dense one (as the folder's fields say)
        intermediate_size=config.intermediate_size if config.num_experts or not shared else shared,
        moe_intermediate_size=config.intermediate_size if config.num_experts else 0,
    )
    from pagedllm.loader.smollm3_granite_config import granite_multipliers_gguf

    fields.update(granite_multipliers_gguf(key, n))
    return dataclasses.replace(config, **fields)
