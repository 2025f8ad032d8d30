"""The architecture facts a model needs, read from config.json or GGUF metadata."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class ModelArchConfig:
    """Shape and numerics of a Llama-family decoder.

    ``attention_bias`` adds biases to q/k/v (Qwen2); ``qk_norm`` applies an
    RMSNorm per head to q and k before RoPE (Qwen3).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {SUPPORTED_ARCHITECTURES}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("default", "llama3", None):
                raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, llama3)")


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 folds rope_theta and rope_scaling into rope_parameters
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(theta), scaling


def from_hf_config(cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelArchConfig:
    """Build from a Hugging Face ``config.json`` dictionary."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_ARCHITECTURES}")
    window = cfg.get("sliding_window")
    # Qwen2 configs carry a window but switch it off with use_sliding_window
    window_on = cfg.get("use_sliding_window", model_type == "mistral")
    if window_on and window is not None and window < cfg.get("max_position_embeddings", 2048):
        raise ValueError(f"sliding-window attention (window {window}) is not supported")
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    theta, scaling = _rope_settings(cfg)
    eos: list[int] = []
    for source in (generation_config or {}, cfg):
        value = source.get("eos_token_id")
        if value is not None:
            eos = value if isinstance(value, list) else [value]
            break
    return ModelArchConfig(
        architecture=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type == "qwen3",
        rope_scaling=scaling,
        eos_token_ids=tuple(eos),
    )


def from_hf_folder(path: str) -> ModelArchConfig:
    """Read ``config.json`` (and ``generation_config.json`` if present)."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{path!r} has no config.json")
    with open(config_path) as f:
        cfg = json.load(f)
    gen_path = os.path.join(path, "generation_config.json")
    gen = None
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            gen = json.load(f)
    return from_hf_config(cfg, gen)
