"""``SpeculativeConfig``: which draft method, how many tokens, validated when built (vLLM's names)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

# methods this engine runs; vLLM's other names are refused with a clear message
METHODS = ("ngram", "draft_model")
_LATER_METHODS = ("suffix", "eagle", "eagle3", "medusa", "mlp_speculator")
# keys that only prompt lookup reads: refused with another method rather than ignored
_NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")


def _int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"speculative_config.{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How a decoding sequence drafts tokens that one step then verifies.

    Args:
        method: "ngram" (prompt lookup: the tokens that followed the latest
            earlier occurrence of the sequence's last n tokens) or
            "draft_model" (a smaller model with the same tokenizer drafts
            greedily: ``engine/draft_model.py``).
        model: the draft model (a path, as ``EngineConfig.model``); required
            with "draft_model", refused with other methods.
        num_speculative_tokens: most draft tokens per step (k).
        prompt_lookup_min: shortest n-gram matched.
        prompt_lookup_max: longest n-gram matched (tried first).
        max_batch_size: speculate only while at most this many sequences
            run; None (the default): the cost model decides from measured
            step times and acceptance (``cost_model.py``), which turns
            drafting off where a batch is compute-bound.
        cost_model: draft only as many of the proposed tokens as the cost
            model expects to pay (``cost_model.py``); False: verify every
            proposal (to measure speculation itself, or in tests that need
            drafts to run whatever this machine's timings say).
        max_failures: a sequence whose proposals were rejected whole this
            many times in a row stops proposing for ``backoff_steps`` steps.
        backoff_steps: decode steps such a sequence runs without proposing.
    """

    method: str = "ngram"
    model: str | None = None
    num_speculative_tokens: int = 4
    # a 1- or 2-token match drafts mostly noise: on the bundled model min 3 turned a 2% loss on free
    # text into break-even and kept the gain on code (docs/speculative-decoding.md, measurements)
    prompt_lookup_min: int = 3
    prompt_lookup_max: int = 4
    max_batch_size: int | None = None
    cost_model: bool = True
    max_failures: int = 3
    backoff_steps: int = 16

    def __post_init__(self) -> None:
        if self.method in _LATER_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not implemented yet; supported: {METHODS}")
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; supported: {METHODS}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative method 'draft_model' needs a 'model' (the draft model's path)")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"speculative_config.model is the draft model of method 'draft_model', not {self.method!r}")
        _int("num_speculative_tokens", self.num_speculative_tokens, 1)
        _int("prompt_lookup_min", self.prompt_lookup_min, 1)
        _int("prompt_lookup_max", self.prompt_lookup_max, 1)
        if not isinstance(self.cost_model, bool):
            raise ValueError(f"speculative_config.cost_model must be true or false, got {self.cost_model!r}")
        if self.max_batch_size is not None:
            _int("max_batch_size", self.max_batch_size, 1)
        _int("max_failures", self.max_failures, 1)
        _int("backoff_steps", self.backoff_steps, 0)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """A config from itself, a dict of its fields, or their JSON text (the CLI's); None stays None.

        ValueError for unknown keys, a missing method or bad values.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        if "method" not in value:
            raise ValueError(f"speculative_config needs a 'method' (supported: {METHODS})")
        given = sorted(k for k in _NGRAM_KEYS if k in value)
        if given and value["method"] != "ngram":
            raise ValueError(f"speculative_config {given} are prompt lookup's ('ngram'), not {value['method']!r}'s")
        return cls(**value)
