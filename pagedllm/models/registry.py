"""Which model class runs which architecture: the one place that maps a config to a class."""

from __future__ import annotations

from torch import nn

from pagedllm.loader.model_config import ModelArchConfig
from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.models.llama import LlamaForCausalLM

# ModelArchConfig.architecture -> the class that implements it
MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}


def model_class(cfg: ModelArchConfig) -> type[nn.Module]:
    """The model class for ``cfg``'s architecture; ValueError if none implements it."""
    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        raise ValueError(f"no model implements architecture {cfg.architecture!r}; known: {sorted(MODEL_CLASSES)}")
    return cls
