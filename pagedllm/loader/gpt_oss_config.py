"""gpt-oss's configuration, read from config.json or GGUF metadata.

Each reader takes the ``ModelArchConfig`` the generic reading made
(``model_config.from_hf_config``, ``gguf_loader.read_config``) and returns
it with gpt-oss's fields set; any other architecture passes through.

config.json, as transformers 5's ``GptOssConfig`` reads it:

- ``layer_types``: "sliding_attention" / "full_attention" per layer; without
  it, even layers slide and odd ones attend to everything. Sliding layers
  see the last ``sliding_window`` keys (default 128).
- ``attention_bias`` (default true): biases on q, k, v and the output.
- every layer's attention has sinks (``self_attn.sinks``, one logit per query
  head, ``layers/attention.py``).
- RoPE: ``rope_parameters`` (or ``rope_scaling`` and ``rope_theta``), by
  default YaRN of factor 32 over 4,096 original positions, ``beta_fast`` 32,
  ``beta_slow`` 1, ``truncate`` false, theta 150,000 (``GptOssConfig``'s).
- the experts' clamped SwiGLU (``swiglu_alpha`` 1.702, ``swiglu_limit`` 7.0;
  ``hidden_act`` "silu" in the file names the unclamped function, which
  gpt-oss does not compute): ``hidden_act`` is read as "swiglu_oai".
- ``rms_norm_eps`` 1e-5 and 131,072 positions by default.

GGUF (architecture ``gpt-oss``), as llama.cpp's converter writes it:
``gpt-oss.attention.sliding_window``; llama.cpp slides the even layers (its
pattern of 2), as transformers' default. No key records YaRN's
``truncate``: the converter drops it, and gpt-oss's own configuration (every
released one) says false, which is what the model was trained with; a file
is read with false (llama.cpp's ggml rounds the correction range, which is
transformers' ``truncate`` true: the difference is in a few of the 32
frequencies of a 64-wide head). No key records the SwiGLU's constants
either (llama.cpp's graph fixes them at 1.702 and 7.0, as here). The
sinks are ``blk.N.attn_sinks.weight``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

# model_config imports this module, so the configuration is typed by a variable (a ModelArchConfig)
ArchConfig = TypeVar("ArchConfig")

HF_ARCHITECTURE, GGUF_ARCHITECTURE = "gpt_oss", "gpt-oss"
_DEFAULT_WINDOW = 128  # GptOssConfig.sliding_window
_DEFAULT_THETA = 150000.0  # GptOssConfig.default_theta
_DEFAULT_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
_DEFAULTS = {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072}
_SWIGLU_ALPHA, _SWIGLU_LIMIT = 1.702, 7.0
_LAYER_TYPES = ("full_attention", "sliding_attention")


def _default_layer_types(num_layers: int) -> tuple[str, ...]:
    """Even layers slide, odd ones are global (``GptOssConfig.__post_init__``; llama.cpp's pattern of 2)."""
    return tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers))


def _windows(types: tuple[str, ...], window: object, max_position: int) -> dict[str, Any]:
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"gpt-oss: sliding_window must be a positive number of tokens, got {window!r}")
    bad = sorted(set(types) - set(_LAYER_TYPES))
    if bad:
        raise ValueError(f"gpt-oss: unsupported layer types {bad}; supported: {_LAYER_TYPES}")
    # a window as long as the positions RoPE covers never masks anything: full attention
    effective = window if window < max_position else None
    return {"layer_types": types,
            "sliding_windows": tuple(effective if t == "sliding_attention" else None for t in types)}


def _swiglu(cfg: dict[str, Any]) -> dict[str, Any]:
    alpha, limit = cfg.get("swiglu_alpha", _SWIGLU_ALPHA), cfg.get("swiglu_limit", _SWIGLU_LIMIT)
    for name, value in (("swiglu_alpha", alpha), ("swiglu_limit", limit)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"gpt-oss: {name} must be a positive number, got {value!r}")
    return {"hidden_act": "swiglu_oai", "swiglu_alpha": float(alpha), "swiglu_limit": float(limit)}


def hf_gpt_oss_fields(config: ArchConfig, cfg: dict[str, Any]) -> ArchConfig:
    """``config`` with gpt-oss's fields read from config.json ``cfg``; other architectures unchanged."""
    if config.architecture != HF_ARCHITECTURE:
        return config
    fields: dict[str, Any] = {k: v for k, v in _DEFAULTS.items() if k not in cfg}
    max_position = fields.get("max_position_embeddings", config.max_position_embeddings)
    n = config.num_hidden_layers
    types = cfg.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != n):
        raise ValueError(f"gpt-oss: layer_types must list one type for each of the {n} layers, got {types!r}")
    fields.update(_windows(tuple(types) if types is not None else _default_layer_types(n),
                           cfg.get("sliding_window", _DEFAULT_WINDOW), max_position))
    fields["attention_bias"] = bool(cfg.get("attention_bias", True))
    params = cfg.get("rope_parameters") or {}
    if not cfg.get("rope_scaling") and "rope_type" not in params and "type" not in params:
        fields["rope_scaling"] = dict(_DEFAULT_YARN)
    if "rope_theta" not in params and "rope_theta" not in cfg:
        fields["rope_theta"] = _DEFAULT_THETA
    fields.update(_swiglu(cfg))
    fields["attention_sinks"] = True
    return dataclasses.replace(config, **fields)


def gguf_gpt_oss_fields(config: ArchConfig, key: Callable[[str], object]) -> ArchConfig:
    """``config`` with gpt-oss's fields from GGUF metadata (``key(name)`` reads ``gpt-oss.{name}``)."""
    if config.architecture != GGUF_ARCHITECTURE:
        return config
    window = key("attention.sliding_window")
    fields = _windows(_default_layer_types(config.num_hidden_layers),
                      int(window) if window is not None else _DEFAULT_WINDOW, config.max_position_embeddings)
    if config.rope_scaling is not None and config.rope_scaling.get("rope_type") == "yarn":
        fields["rope_scaling"] = {**config.rope_scaling, "truncate": False}
    fields.update(_swiglu({}))
    fields["attention_sinks"] = True
    return dataclasses.replace(config, **fields)
