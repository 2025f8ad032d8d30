"""The model's own sampling defaults: a Hugging Face folder's ``generation_config.json``, a GGUF file's
``general.sampling.*`` metadata.

Model authors publish the sampling they tuned for (Llama 3.1: temperature 0.6, top_p 0.9; Qwen2.5:
temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05) in ``generation_config.json``, and
llama.cpp's converter copies those keys into the GGUF file as ``general.sampling.temp`` /
``top_p`` / ``top_k`` / ``min_p`` / ``penalty_repeat``. As vLLM's ``--generation-config``,
``EngineConfig.generation_config`` says where they come from: "auto" (the model's own file or
metadata), "vllm" (none: ``SamplingParams``' own defaults) or a folder holding a
``generation_config.json``. What is read is vLLM's list (``MODEL_DEFAULT_FIELDS``: temperature, top_p,
top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens), values as written (transformers
5's ``GenerationConfig`` has no defaults of its own to drop, so vLLM's ``to_diff_dict`` keeps them all);
``do_sample`` is not read, as vLLM does not. A request's own values always win
(``sampling_params.with_defaults``).

A value ``SamplingParams`` refuses (a negative temperature) is a ValueError naming the file and the
key: the engine does not start with a default it cannot use. The model's end-of-turn tokens are not
read here (``model_config.py``, ``end_tokens.py``): they stop generation whatever this setting is.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from pagedllm.sampling_params import MODEL_DEFAULT_FIELDS, SamplingParams, with_defaults

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field
_HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# GGUF key (llama.cpp's converter writes them from generation_config.json) -> SamplingParams field
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}
# llama.cpp's samplers with no SamplingParams field: read past, with a log line naming them
_GGUF_UNSUPPORTED = ("general.sampling.sequence", "general.sampling.xtc_probability",
                     "general.sampling.xtc_threshold", "general.sampling.penalty_last_n",
                     "general.sampling.mirostat", "general.sampling.mirostat_tau", "general.sampling.mirostat_eta")
# GGUF stores these as float32: read back as the decimal the converter was given (0.6, not 0.6000000238)
_FLOAT32_DIGITS = 7
GENERATION_CONFIG_CHOICES = ("auto", "vllm")


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling defaults a model brings, and where they were read.

    Attributes:
        values: ``SamplingParams`` field -> value, each checked; empty when
            the model sets none (or ``generation_config="vllm"``).
        source: where they were read, as the log says it ("the model's
            generation_config.json", "the GGUF file's general.sampling
            metadata", a file's path); None when nothing was read.
        ignored: keys the source sets that no ``SamplingParams`` field takes
            (llama.cpp's mirostat, XTC...).
    """

    values: dict[str, Any] = field(default_factory=dict)
    source: str | None = None
    ignored: tuple[str, ...] = ()

    def apply(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the fields it leaves unset taken from these defaults (``with_defaults``)."""
        return with_defaults(params, self.values)

    def sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with these defaults: what a request that sets nothing samples with."""
        return SamplingParams(**self.values)

    def describe(self) -> str:
        """``temperature=0.6, top_p=0.9`` (in ``MODEL_DEFAULT_FIELDS``' order); "none" when empty."""
        shown = [f"{k}={self.values[k]}" for k in MODEL_DEFAULT_FIELDS if k in self.values]
        return ", ".join(shown) or "none"

    def report(self) -> dict[str, Any]:
        """What ``pagedllm env`` shows: the source and the values."""
        return {"source": self.source or "none (SamplingParams' own defaults)", "values": self.describe(),
                **({"ignored": ", ".join(self.ignored)} if self.ignored else {})}


def _checked(values: dict[str, Any], where: str) -> dict[str, Any]:
    """``values`` if ``SamplingParams`` takes each of them; ValueError naming ``where`` and the key otherwise."""
    for key, value in values.items():
        try:
            SamplingParams(**{key: value})
        except ValueError as e:
            raise ValueError(f"{where}: the sampling default {key}={value!r} is not usable ({e}); fix the file, "
                             "or pass generation_config='vllm' (--generation-config vllm) to ignore the "
                             "model's defaults") from None
    try:
        SamplingParams(**values)
    except ValueError as e:
        raise ValueError(f"{where}: the sampling defaults {values} do not go together ({e})") from None
    return values


def read_generation_config(path: str, where: str) -> dict[str, Any]:
    """The defaults of the ``generation_config.json`` at ``path`` (``where`` names it in errors)."""
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where} cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where} must hold a JSON object, got {type(config).__name__}")
    values = {name: config[key] for key, name in _HF_KEYS.items() if config.get(key) is not None}
    return _checked(values, where)


def gguf_sampling_defaults(metadata: dict[str, Any], where: str) -> tuple[dict[str, Any], tuple[str, ...]]:
    """(defaults, keys set but not taken) of a GGUF file's ``general.sampling.*`` metadata."""
    values: dict[str, Any] = {}
    for key, name in _GGUF_KEYS.items():
        value = metadata.get(key)
        if isinstance(value, float):
            value = float(f"{value:.{_FLOAT32_DIGITS}g}")
        if value is not None:
            values[name] = value
    ignored = tuple(k for k in _GGUF_UNSUPPORTED if metadata.get(k) is not None)
    return _checked(values, where), ignored


def _from_folder(folder: str) -> GenerationDefaults:
    """``generation_config=<folder>``: its ``generation_config.json``, which must exist."""
    path = os.path.join(os.path.expanduser(folder), GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"generation_config={folder!r} must be 'auto', 'vllm' or a folder holding "
                         f"{GENERATION_CONFIG_FILE}; {path} is not a file")
    return GenerationDefaults(read_generation_config(path, path), path)


def _from_model(model: str) -> GenerationDefaults:
    """``generation_config="auto"``: the model folder's ``generation_config.json``, or a GGUF file's metadata."""
    if model.endswith(".gguf"):
        from pagedllm.loader import gguf_loader

        where = "the GGUF file's general.sampling metadata"
        values, ignored = gguf_sampling_defaults(gguf_loader.metadata(gguf_loader.open_reader(model)), where)
        return GenerationDefaults(values, where if values else None, ignored)
    path = os.path.join(model, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        return GenerationDefaults()
    values = read_generation_config(path, path)
    return GenerationDefaults(values, f"the model's {GENERATION_CONFIG_FILE}" if values else None)


def load_generation_defaults(model: str, generation_config: str) -> GenerationDefaults:
    """The sampling defaults ``EngineConfig.generation_config`` selects for the (resolved) ``model`` path.

    Logs one line saying which defaults came from where (none: nothing is logged).
    """
    if generation_config == "vllm":
        return GenerationDefaults()
    defaults = _from_model(model) if generation_config == "auto" else _from_folder(generation_config)
    if defaults.values:
        logger.info("sampling defaults from %s: %s", defaults.source, defaults.describe())
    if defaults.ignored:
        logger.info("sampling settings of the model with no pagedllm equivalent, not applied: %s",
                    ", ".join(defaults.ignored))
    return defaults
