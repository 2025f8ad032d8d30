"""SmolLM3's layers without RoPE and Granite's multipliers, read from config.json or GGUF metadata.

Each reader takes the ``ModelArchConfig`` the generic reading made
(``model_config.from_hf_config``, ``gguf_loader.read_config``) and returns
it with these families' fields set; any other architecture passes through.

config.json, as transformers 5's config classes read it:

- SmolLM3 (``SmolLM3Config``): ``no_rope_layers[i]`` is 1 where layer ``i``
  rotates q and k, 0 where it does not; without the list, every
  ``no_rope_layer_interval``-th layer (default 4) skips RoPE. A layer whose
  ``layer_types`` entry is "sliding_attention" attends through
  ``sliding_window`` (the mask transformers builds for it; its default
  layer types mark the NoPE layers sliding when ``use_sliding_window``).
  ``rope_theta`` defaults to 2,000,000 (``SmolLM3Config.default_theta``),
  and the other keys ``SmolLM3Config`` defaults unlike Llama's (tied
  embeddings, 32,768 positions, 4 KV heads) to its values.
- Granite (``GraniteConfig``, and ``GraniteMoeConfig`` alike): ``embedding_multiplier``,
  ``residual_multiplier``, ``logits_scaling`` and ``attention_multiplier``
  (the score scale in place of ``head_dim ** -0.5``), each 1.0 by default.

GGUF, as llama.cpp's converter writes them and llama.cpp reads them:

- ``smollm3``: no key records the NoPE layers; llama.cpp skips RoPE in every
  fourth layer (``(i + 1) % 4 == 0``, a constant of its SmolLM3 graph), and
  so do we. A checkpoint with another pattern cannot be told apart in GGUF.
- ``granite`` (and ``granitemoe``, under its own prefix): ``granite.logit_scale`` (required, as llama.cpp requires it),
  ``granite.residual_scale``, ``granite.embedding_scale`` and
  ``granite.attention.scale``; the converter leaves out a multiplier that is
  0 or missing, and llama.cpp then does not scale (``head_dim ** -0.5`` for
  the scores). ``granite.rope.scaling.finetuned`` false turns RoPE off in
  every layer (llama.cpp's switch for Granite; absent means on).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

# model_config imports this module, so the configuration is typed by a variable (a ModelArchConfig)
ArchConfig = TypeVar("ArchConfig")

_SMOLLM3_DEFAULT_THETA = 2_000_000.0  # SmolLM3Config.default_theta
_SMOLLM3_NOPE_INTERVAL = 4  # SmolLM3Config.no_rope_layer_interval's default; llama.cpp's constant step
# SmolLM3Config's defaults where they differ from the Llama reading's, for a config.json that leaves them out
_SMOLLM3_DEFAULTS = {"tie_word_embeddings": True, "max_position_embeddings": 32768, "num_key_value_heads": 4}
# Granite 3.x and its mixture of experts (GraniteMoE): the same four multipliers, the same keys
GRANITE_ARCHITECTURES = ("granite", "granitemoe")
_GRANITE_MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "logits_scaling", "attention_multiplier")


def hf_family_fields(config: ArchConfig, cfg: dict[str, Any]) -> ArchConfig:
    """``config`` with SmolLM3's or Granite's fields read from config.json ``cfg``; others unchanged."""
    if config.architecture == "smollm3":
        config = dataclasses.replace(config, **{k: v for k, v in _SMOLLM3_DEFAULTS.items() if k not in cfg})
        return dataclasses.replace(config, **_smollm3_hf(cfg, config.max_position_embeddings))
    if config.architecture in GRANITE_ARCHITECTURES:
        return dataclasses.replace(config, **_granite_hf(cfg))
    return config


def _smollm3_hf(cfg: dict[str, Any], max_pos: int) -> dict[str, Any]:
    n = cfg["num_hidden_layers"]
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = cfg.get("no_rope_layer_interval", _SMOLLM3_NOPE_INTERVAL)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
            raise ValueError(f"smollm3: no_rope_layer_interval must be a positive integer, got {interval!r}")
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if not isinstance(flags, list) or len(flags) < n or any(f not in (0, 1) for f in flags[:n]):
        raise ValueError(f"smollm3: no_rope_layers must list 1 (RoPE) or 0 (none) for each of the {n} layers, "
                         f"got {flags!r}")
    fields: dict[str, Any] = {"nope_layers": tuple(i for i in range(n) if not flags[i])}
    params = cfg.get("rope_parameters") or {}
    if "rope_theta" not in params and "rope_theta" not in cfg:
        fields["rope_theta"] = _SMOLLM3_DEFAULT_THETA
    fields.update(_smollm3_windows(cfg, flags[:n], max_pos))
    return fields


def _smollm3_windows(cfg: dict[str, Any], flags: list[int], max_pos: int) -> dict[str, Any]:
    """``sliding_windows`` / ``layer_types`` as SmolLM3Config derives them and its masks apply them."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is None:
        sliding = bool(cfg.get("use_sliding_window")) and window is not None
        types = ["sliding_attention" if sliding and not has_rope else "full_attention" for has_rope in flags]
    if "sliding_attention" not in types:
        return {"layer_types": tuple(types)}
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"smollm3: sliding_attention layers need a positive sliding_window, got {window!r}")
    if window >= max_pos:  # a window as long as every position masks nothing
        window = None
    return {"layer_types": tuple(types),
            "sliding_windows": tuple(window if t == "sliding_attention" else None for t in types)}


def _granite_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    values = {name: cfg.get(name, 1.0) for name in _GRANITE_MULTIPLIERS}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"granite: {name} must be a number, got {value!r}")
    scale = float(values.pop("attention_multiplier"))
    if not scale > 0:
        raise ValueError(f"granite: attention_multiplier must be positive, got {scale!r}")
    return {**{name: float(v) for name, v in values.items()}, "attn_scale": scale}


def gguf_family_fields(config: ArchConfig, key: Callable[[str], object]) -> ArchConfig:
    """``config`` with SmolLM3's or Granite's fields from GGUF metadata; ``key(name)`` reads ``{arch}.{name}``."""
    if config.architecture == "smollm3":
        n = config.num_hidden_layers
        nope = tuple(i for i in range(n) if (i + 1) % _SMOLLM3_NOPE_INTERVAL == 0)
        return dataclasses.replace(config, nope_layers=nope)
    if config.architecture in GRANITE_ARCHITECTURES:
        return dataclasses.replace(config, **_granite_gguf(key, config.num_hidden_layers))
    return config


def _granite_gguf(key: Callable[[str], object], num_layers: int) -> dict[str, Any]:
    logit_scale = key("logit_scale")
    if logit_scale is None:
        raise ValueError("GGUF granite file lacks granite.logit_scale (llama.cpp requires it too)")
    fields: dict[str, Any] = {"logits_scaling": float(logit_scale)}
    # 0 or absent: llama.cpp does not scale
    for gguf_key, name in (("embedding_scale", "embedding_multiplier"), ("residual_scale", "residual_multiplier")):
        value = key(gguf_key)
        if value not in (None, 0.0):
            fields[name] = float(value)
    attention_scale = key("attention.scale")
    if attention_scale not in (None, 0.0):
        fields["attn_scale"] = float(attention_scale)
    if key("rope.scaling.finetuned") is False:
        fields["nope_layers"] = tuple(range(num_layers))
    return fields


def granite_multipliers_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite's four multipliers read from config.json (Granite 4.0-H's reading, ``granite_hybrid_config.py``)."""
    return _granite_hf(cfg)


def granite_multipliers_gguf(key: Callable[[str], object], num_layers: int) -> dict[str, Any]:
    """Granite's multipliers (and its RoPE switch) read from GGUF metadata, as for ``granite``."""
    return _granite_gguf(key, num_layers)
