"""The config.json fields of Qwen3-Next and Qwen3.5 / Qwen3.6 (dense and MoE): their Gated DeltaNet layers.

model_type ``qwen3_next`` (``Qwen3NextConfig``), ``qwen3_5_text``
(``Qwen3_5TextConfig``) and ``qwen3_5_moe_text`` (``Qwen3_5MoeTextConfig``),
read as transformers' classes read them:

- ``linear_num_key_heads``, ``linear_num_value_heads``, ``linear_key_head_dim``,
  ``linear_value_head_dim``, ``linear_conv_kernel_dim``: the Gated DeltaNet
  layers' shape (required: every saved config carries them);
- ``layer_types`` ("linear_attention" / "full_attention"), else every
  ``full_attention_interval``-th layer (4) full, as the config classes derive it;
- ``partial_rotary_factor`` in ``rope_parameters`` (else top level, else
  0.25): the part of each attention head RoPE rotates;
- q/k norms always (per head, ``(1 + w)``); Qwen3.5-MoE's router always
  renormalises its top-k and every layer is sparse (its class reads no
  ``norm_topk_prob``, ``decoder_sparse_step`` nor ``mlp_only_layers``);
  Qwen3-Next's experts read those as Qwen3-MoE's do (``loader/moe_config.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

# model_config imports this module, so the configuration is typed by a variable (a ModelArchConfig)
ArchConfig = TypeVar("ArchConfig")

# config.json model_type -> ModelArchConfig.architecture
GATED_DELTA_MODEL_TYPES = {"qwen3_next": "qwen3_next", "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
_LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim")
_FULL_ATTENTION_INTERVAL = 4
_PARTIAL_ROTARY_FACTOR = 0.25


def gated_delta_dict(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """config.json with what the config class fills in where it leaves a key out (Qwen3.5-MoE has no dense
    ``intermediate_size``: its experts' size stands in, unread)."""
    if arch == "qwen3_5_moe" and cfg.get("intermediate_size") is None:
        return {**cfg, "intermediate_size": cfg.get("moe_intermediate_size")}
    return cfg


def _positive(cfg: dict[str, Any], key: str, arch: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{arch}: config.json {key} must be a positive integer, got {value!r}")
    return value


def _layer_types(cfg: dict[str, Any], arch: str) -> tuple[str, ...]:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        interval = cfg.get("full_attention_interval") or _FULL_ATTENTION_INTERVAL
        if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
            raise ValueError(f"{arch}: full_attention_interval must be a positive integer, got {interval!r}")
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n))
    bad = sorted(set(types) - {"full_attention", "linear_attention"})
    if bad:
        raise ValueError(f"{arch}: layer_types {bad} are not 'full_attention' / 'linear_attention'")
    return tuple(types)


def hf_gated_delta_fields(config: ArchConfig, cfg: dict[str, Any]) -> ArchConfig:
    """``config`` with the Gated DeltaNet models' fields of config.json ``cfg`` (other architectures: as it is)."""
    arch = config.architecture
    if arch not in GATED_DELTA_MODEL_TYPES.values():
        return config
    linear = {key: _positive(cfg, key, arch) for key in _LINEAR_KEYS}
    params = cfg.get("rope_parameters") or {}
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or _PARTIAL_ROTARY_FACTOR)
    extra: dict[str, Any] = {}
    if arch == "qwen3_5_moe" and config.num_experts:
        extra = dict(norm_topk_prob=True, dense_layers=())
    return dataclasses.replace(config, layer_types=_layer_types(cfg, arch), qk_norm=True,
                               partial_rotary_factor=float(partial), **linear, **extra)
