"""Which model class runs which architecture: the one table from a checkpoint's architecture name to a family.

A checkpoint names its architecture in one of two ways: a Hugging Face
folder by config.json's ``architectures`` (``"LlamaForCausalLM"``), a GGUF
file by ``general.architecture`` (``"llama"``). ``Family`` lists both kinds
of name for one model class; ``MODEL_REGISTRY`` holds the families this
package implements, and ``model_class`` is how the runner (and through it
both loaders' configurations) finds the class. A name no family lists is a
ValueError that names it and the supported ones.

A family is a ``CausalLM`` subclass (``layers/decoder.py``) written from
the shared blocks; adding one that differs from Llama only in parameters
needs no layer code, only its ``decoder_spec`` and an entry here (or, for a
family defined outside this package, ``MODEL_REGISTRY.with_family``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from pagedllm.loader.model_config import ModelArchConfig
from pagedllm.models.gemma2 import Gemma2ForCausalLM
from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.models.gemma4 import Gemma4ForCausalLM
from pagedllm.models.gpt_oss import GptOssForCausalLM
from pagedllm.models.granitemoe import GraniteMoeForCausalLM
from pagedllm.models.granitemoehybrid import GraniteMoeHybridForCausalLM
from pagedllm.models.lfm2 import Lfm2ForCausalLM
from pagedllm.models.llama import (
    GraniteForCausalLM,
    LlamaForCausalLM,
    Qwen2ForCausalLM,
    SmolLM3ForCausalLM,
)
from pagedllm.models.mixtral import MixtralForCausalLM
from pagedllm.models.olmo2 import Olmo2ForCausalLM
from pagedllm.models.olmoe import OlmoeForCausalLM
from pagedllm.models.phi3 import Phi3ForCausalLM
from pagedllm.models.qwen2_moe import Qwen2MoeForCausalLM
from pagedllm.models.qwen3_moe import Qwen3MoeForCausalLM
from pagedllm.models.qwen3_next import Qwen3NextForCausalLM


@dataclass(frozen=True)
class Family:
    """One model class and the architecture names it runs.

    ``hf_architectures``: config.json ``architectures`` entries.
    ``gguf_architectures``: GGUF ``general.architecture`` values (empty: the
    family loads from Hugging Face folders only). ``config_types``: the
    loader's reading of config.json's model_type (``ModelArchConfig.architecture``),
    used only for a config.json that lists no ``architectures``.
    ``gguf_expert_architectures``: GGUF architectures this family runs when
    the file has experts, and another family when it has none (llama.cpp
    writes Mixtral as "llama" with an expert count).
    """

    model_class: type[nn.Module]
    hf_architectures: tuple[str, ...]
    gguf_architectures: tuple[str, ...] = ()
    config_types: tuple[str, ...] = ()
    gguf_expert_architectures: tuple[str, ...] = ()


class ModelRegistry:
    """Families by architecture name; immutable (``with_family`` returns a new registry)."""

    def __init__(self, families: Iterable[Family]) -> None:
        self.families: tuple[Family, ...] = tuple(families)
        for kind in ("hf_architectures", "gguf_architectures", "config_types", "gguf_expert_architectures"):
            names = [name for family in self.families for name in getattr(family, kind)]
            repeated = sorted({name for name in names if names.count(name) > 1})
            if repeated:
                raise ValueError(f"{kind} {repeated} are registered to more than one family")

    def with_family(self, family: Family) -> ModelRegistry:
        """This registry plus ``family``; ValueError if it claims a name already registered."""
        return ModelRegistry((*self.families, family))

    def supported(self, checkpoint_format: str, experts: bool = False) -> list[str]:
        """The architecture names of one checkpoint format ("hf" or "gguf"), sorted; with ``experts``, those of
        the families that compute mixtures of experts only."""
        kinds = ("gguf_architectures",) if checkpoint_format == "gguf" else ("hf_architectures",)
        if experts and checkpoint_format == "gguf":
            kinds = (*kinds, "gguf_expert_architectures")
        return sorted({name for family in self.families for kind in kinds for name in getattr(family, kind)
                       if not experts or getattr(family.model_class, "supports_experts", False)})

    def model_class(self, cfg: ModelArchConfig) -> type[nn.Module]:
        """The model class for ``cfg``'s architecture; ValueError naming it and the supported ones if none.

        A mixture of experts (``cfg.num_experts`` > 0) is refused, naming it,
        unless its family computes routed MLPs (``supports_experts``). A GGUF
        file with experts is looked up first among ``gguf_expert_architectures``:
        llama.cpp writes Mixtral as architecture "llama" with an expert count,
        which the Llama family does not run and Mixtral's does.
        """
        try:
            found = self._dense_or_sparse(cfg)
        except ValueError:
            if not cfg.num_experts:
                raise
            found = None  # an unknown architecture with experts: refused as a mixture of experts below
        if cfg.num_experts and not getattr(found, "supports_experts", False):
            fmt = "gguf" if cfg.checkpoint_format == "gguf" else "hf"
            name = cfg.architecture if fmt == "gguf" else list(cfg.architectures) or cfg.architecture
            raise ValueError(f"architecture {name!r} with {cfg.num_experts} experts is a mixture of experts: "
                             f"mixture-of-experts models are not supported for it; mixture-of-experts "
                             f"architectures supported: {self.supported(fmt, experts=True)}")
        return found

    def _dense_or_sparse(self, cfg: ModelArchConfig) -> type[nn.Module]:
        if cfg.checkpoint_format == "gguf":
            found = self._find("gguf_expert_architectures", (cfg.architecture,)) if cfg.num_experts else None
            found = found or self._find("gguf_architectures", (cfg.architecture,))
            if found is None:
                raise ValueError(f"unsupported GGUF architecture {cfg.architecture!r}; supported: "
                                 f"{self.supported('gguf')}")
            return found
        names = cfg.architectures
        found = self._find("hf_architectures", names) if names else self._find("config_types", (cfg.architecture,))
        if found is None:
            given = list(names) if names else f"model_type {cfg.architecture!r}"
            raise ValueError(f"unsupported architecture {given}; supported: {self.supported('hf')}")
        return found

    def _find(self, kind: str, names: Iterable[str]) -> type[nn.Module] | None:
        for name in names:  # config.json lists the most specific class first
            for family in self.families:
                if name in getattr(family, kind):
                    return family.model_class
        return None


MODEL_REGISTRY = ModelRegistry((
    Family(LlamaForCausalLM, ("LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM",
                               # a pooling runner's cross-encoders: the decoder, score.weight read apart
                               "LlamaForSequenceClassification", "Qwen3ForSequenceClassification"),
           ("llama", "mistral", "qwen3"), ("llama", "mistral", "qwen3")),
    Family(Qwen2ForCausalLM, ("Qwen2ForCausalLM", "Qwen2ForSequenceClassification"), ("qwen2",), ("qwen2",)),
    Family(Gemma3ForCausalLM, ("Gemma3ForCausalLM",), ("gemma3",), ("gemma3",)),
    Family(Gemma4ForCausalLM, ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"), ("gemma4",), ("gemma4",)),
    Family(Gemma2ForCausalLM, ("Gemma2ForCausalLM",), ("gemma2",), ("gemma2",)),
    Family(Phi3ForCausalLM, ("Phi3ForCausalLM",), ("phi3",), ("phi3",)),
    Family(SmolLM3ForCausalLM, ("SmolLM3ForCausalLM",), ("smollm3",), ("smollm3",)),
    Family(GraniteForCausalLM, ("GraniteForCausalLM",), ("granite",), ("granite",)),
    Family(Olmo2ForCausalLM, ("Olmo2ForCausalLM",), ("olmo2",), ("olmo2",)),
    Family(Lfm2ForCausalLM, ("Lfm2ForCausalLM",), ("lfm2",), ("lfm2",)),
    Family(Qwen3MoeForCausalLM, ("Qwen3MoeForCausalLM",), ("qwen3moe",), ("qwen3_moe",)),
    Family(MixtralForCausalLM, ("MixtralForCausalLM",), (), ("mixtral",), gguf_expert_architectures=("llama",)),
    Family(Qwen2MoeForCausalLM, ("Qwen2MoeForCausalLM",), ("qwen2moe",), ("qwen2_moe",)),
    Family(OlmoeForCausalLM, ("OlmoeForCausalLM",), ("olmoe",), ("olmoe",)),
    Family(GraniteMoeForCausalLM, ("GraniteMoeForCausalLM",), ("granitemoe",), ("granitemoe",)),
    Family(GptOssForCausalLM, ("GptOssForCausalLM",), ("gpt-oss",), ("gpt_oss",)),
    Family(Qwen3NextForCausalLM, ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"),
           ("qwen3next", "qwen35", "qwen35moe"), ("qwen3_next", "qwen3_5", "qwen3_5_moe")),
    Family(GraniteMoeHybridForCausalLM, ("GraniteMoeHybridForCausalLM",), ("granitehybrid",), ("granitemoehybrid",)),
))


def model_class(cfg: ModelArchConfig) -> type[nn.Module]:
    """The model class ``MODEL_REGISTRY`` gives ``cfg``'s architecture; ValueError if none implements it."""
    return MODEL_REGISTRY.model_class(cfg)
