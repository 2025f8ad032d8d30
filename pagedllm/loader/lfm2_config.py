"""LFM2's config.json (transformers' ``Lfm2Config``), read into the shared ``ModelArchConfig``.

Where its keys differ from Llama's, as ``Lfm2Config`` reads them:

- ``norm_eps`` is the RMSNorm epsilon (default 1e-5);
- ``layer_types`` ("conv" / "full_attention" per layer), else derived from
  ``full_attn_idxs`` (default: every layer attention);
- the MLP's width: with ``block_auto_adjust_ff_dim`` (default True)
  ``int(2 * intermediate_size / 3)``, times ``block_ffn_dim_multiplier``
  when set, rounded up to a multiple of ``block_multiple_of`` (``Lfm2MLP``);
  ``block_ff_dim`` replaces ``intermediate_size`` where present;
- the short conv: ``conv_L_cache`` taps (default 3), ``conv_bias`` on the
  conv and both its projections (default False);
- a GGUF file (llama.cpp's converter, ``lfm2``): ``attention.head_count_kv``
  per layer, 0 for a conv layer; ``shortconv.l_cache`` the conv's taps; the
  conv's biases are not written (LFM2's checkpoints have none);
- q and k are RMS-normed per head (``q_layernorm`` / ``k_layernorm``);
  ``tie_embedding`` is ``tie_word_embeddings`` (default True); RoPE theta
  defaults to 1e6.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

# model_config imports this module, so the configuration is typed by a variable (a ModelArchConfig)
ArchConfig = TypeVar("ArchConfig")

_DEFAULTS = {"rms_norm_eps": 1e-5, "tie_word_embeddings": True, "max_position_embeddings": 128_000}
_DEFAULT_THETA = 1_000_000.0
_DEFAULT_CONV_WIDTH = 3


def _mlp_width(cfg: dict[str, Any]) -> int:
    width = int(cfg.get("block_ff_dim") or cfg["intermediate_size"])
    if not cfg.get("block_auto_adjust_ff_dim", True):
        return width
    width = int(2 * width / 3)
    multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        width = int(multiplier * width)
        step = int(cfg.get("block_multiple_of", 256))
        width = step * ((width + step - 1) // step)
    return width


def lfm2_hf_dict(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json ``cfg`` with LFM2's keys under the names the shared reading takes (see the module docstring)."""
    out = {**_DEFAULTS, **cfg}
    if "norm_eps" in cfg:
        out["rms_norm_eps"] = cfg["norm_eps"]
    if "tie_embedding" in cfg:
        out["tie_word_embeddings"] = cfg["tie_embedding"]
    n = cfg.get("num_hidden_layers")
    if cfg.get("layer_types") is None and isinstance(n, int):
        attn = cfg.get("full_attn_idxs")
        attn = range(n) if attn is None else attn
        out["layer_types"] = ["full_attention" if i in attn else "conv" for i in range(n)]
    bad = sorted(set(out.get("layer_types") or ()) - {"conv", "full_attention"})
    if bad:
        raise ValueError(f"lfm2: layer_types must be 'conv' or 'full_attention', got {bad}")
    if "intermediate_size" in out or "block_ff_dim" in out:
        out["intermediate_size"] = _mlp_width(out)
    params = out.get("rope_parameters") or {}
    if out.get("rope_theta") is None and not params.get("rope_theta"):
        out["rope_theta"] = _DEFAULT_THETA
    return out


def lfm2_fields(config: ArchConfig, cfg: dict[str, Any]) -> ArchConfig:
    """``config`` with LFM2's short conv and per-head q/k norms (``cfg``: ``lfm2_hf_dict``'s); others unchanged."""
    if config.architecture != "lfm2":  # type: ignore[attr-defined]
        return config
    width = cfg.get("conv_L_cache", _DEFAULT_CONV_WIDTH)
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= 8:
        raise ValueError(f"lfm2: conv_L_cache must be an integer 1..8, got {width!r}")
    return dataclasses.replace(config, qk_norm=True, conv_kernel_size=width, conv_bias=bool(cfg.get("conv_bias")),
                               layer_types=tuple(cfg["layer_types"]))


def lfm2_gguf_fields(config: ArchConfig, key: Callable[[str], object]) -> ArchConfig:
    """``config`` read from an ``lfm2`` GGUF file with its layer kinds and short conv (``key(name)`` reads
    ``lfm2.<name>``, None if absent)."""
    per_layer = key("attention.head_count_kv")
    n = config.num_hidden_layers  # type: ignore[attr-defined]
    if not isinstance(per_layer, list) or len(per_layer) != n:
        raise ValueError(f"lfm2 GGUF: attention.head_count_kv must list {n} layers (0 for a conv layer), "
                         f"got {per_layer!r}")
    width = key("shortconv.l_cache")
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= 8:
        raise ValueError(f"lfm2 GGUF: shortconv.l_cache must be an integer 1..8, got {width!r}")
    types = tuple("full_attention" if int(h) else "conv" for h in per_layer)
    return dataclasses.replace(config, layer_types=types, conv_kernel_size=width, conv_bias=False)
