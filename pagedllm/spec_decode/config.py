"""``SpeculativeConfig``: which draft method, how many tokens, validated when built (vLLM's names)."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Annotated, Any

from pydantic import Field

from pagedllm.config_record import NonNegativeInt, PositiveFloat, PositiveInt, config_record

# methods this engine runs; vLLM's other names are refused with a clear message
METHODS = ("ngram", "suffix", "draft_model")
_LATER_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator")
# each method's own keys and their defaults: given with the other method they are refused (never ignored)
# (ngram: a 1- or 2-token match drafts mostly noise: on the bundled model min 3 turned a 2% loss on free
# text into break-even and kept the gain on code, docs/speculative-decoding.md, measurements)
NGRAM_DEFAULTS = {"prompt_lookup_min": 3, "prompt_lookup_max": 4}
SUFFIX_DEFAULTS: dict[str, int | float] = {
    "suffix_decoding_max_tree_depth": 24,  # vLLM's
    # vLLM's default is 10000; here a tree node is a Python object (~70-300 bytes, up to max_tree_depth
    # nodes per output token), so the default keeps the global tree to tens of MB (docs/speculative-decoding.md)
    "suffix_decoding_max_cached_requests": 64,
    "suffix_decoding_max_spec_factor": 1.0,  # vLLM's
    "suffix_decoding_min_token_prob": 0.1,  # vLLM's
}


@config_record(prefix="speculative_config.")
class SpeculativeConfig:
    """How a decoding sequence drafts tokens that one step then verifies.

    Each method's own keys default to None and are filled in for that
    method (``NGRAM_DEFAULTS``, ``SUFFIX_DEFAULTS``); one given for the other
    method is a ValueError.

    Attributes:
        method: "ngram" (prompt lookup: the tokens that followed the latest
            earlier occurrence of the sequence's last n tokens), "suffix"
            (suffix decoding: suffix trees over the request and over earlier
            outputs, ``suffix_proposer.py``) or "draft_model" (a smaller model
            with the same tokenizer drafts greedily: ``spec_decode/draft_model.py``).
        model: the draft model (a path, as ``EngineConfig.model``); required
            with "draft_model", refused with other methods.
        num_speculative_tokens: most draft tokens per step (k).
        prompt_lookup_min: ngram: shortest n-gram matched.
        prompt_lookup_max: ngram: longest n-gram matched (tried first).
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
        suffix_decoding_max_tree_depth: suffix: deepest path of the suffix
            trees; a match and its draft fit in it together (k must be smaller).
        suffix_decoding_max_cached_requests: suffix: finished outputs the
            global tree holds (oldest evicted first); 0: no global tree.
        suffix_decoding_max_spec_factor: suffix: a match of n tokens drafts
            at most factor * n tokens.
        suffix_decoding_min_token_prob: suffix: a draft stops before a token
            whose estimated probability (from the tree's counts) is lower.
    """

    method: str = "ngram"
    model: str | None = None
    num_speculative_tokens: PositiveInt = 4
    prompt_lookup_min: PositiveInt | None = None
    prompt_lookup_max: PositiveInt | None = None
    max_batch_size: PositiveInt | None = None
    cost_model: bool = True
    max_failures: PositiveInt = 3
    backoff_steps: NonNegativeInt = 16
    suffix_decoding_max_tree_depth: Annotated[int, Field(ge=2)] | None = None
    suffix_decoding_max_cached_requests: NonNegativeInt | None = None
    suffix_decoding_max_spec_factor: PositiveFloat | None = None
    suffix_decoding_min_token_prob: Annotated[float, Field(ge=0, le=1)] | None = None

    def __post_init__(self) -> None:
        if self.method in _LATER_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not implemented yet; supported: {METHODS}")
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; supported: {METHODS}")
        own = {"ngram": NGRAM_DEFAULTS, "suffix": SUFFIX_DEFAULTS}.get(self.method, {})
        other = [name for d in (NGRAM_DEFAULTS, SUFFIX_DEFAULTS) if d is not own for name in d]
        given = sorted(name for name in other if getattr(self, name) is not None)
        if given:
            raise ValueError(f"speculative_config keys {given} do not apply to method {self.method!r}")
        for name, default in own.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)  # frozen: filled in once, here
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative method 'draft_model' needs a 'model' (the draft model's path)")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"speculative_config.model is the draft model of method 'draft_model', not {self.method!r}")
        if self.method == "ngram":
            self._check_ngram()
        elif self.method == "suffix":
            self._check_suffix()

    def _check_ngram(self) -> None:
        if self.prompt_lookup_min > self.prompt_lookup_max:  # type: ignore[operator]
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    def _check_suffix(self) -> None:
        if self.num_speculative_tokens >= self.suffix_decoding_max_tree_depth:  # type: ignore[operator]
            # a match of at least one token and the draft below it share the tree's depth
            raise ValueError(
                f"speculative_config.num_speculative_tokens ({self.num_speculative_tokens}) must be < "
                f"suffix_decoding_max_tree_depth ({self.suffix_decoding_max_tree_depth})"
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
        return cls(**value)
