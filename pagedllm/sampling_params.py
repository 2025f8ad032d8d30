"""Per-request sampling settings, with vLLM's names and defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class SamplingParams:
    """How to sample a request's outputs.

    Args:
        n: number of outputs for the prompt.
        best_of: sample this many (>= n) and return the n with the highest
            cumulative logprob; None means n. The samples share the prompt's
            KV blocks (copy-on-write).
        temperature: 0 means greedy; higher flattens the distribution.
        top_p: keep the smallest set of tokens whose probability sums to top_p.
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens less likely than min_p times the most likely one.
        seed: per-request seed; the same seed gives the same outputs.
        max_tokens: most tokens to generate per output.
        stop: strings that end generation; they are cut from the text.
        stop_token_ids: token ids that end generation (kept in token_ids).
        ignore_eos: keep generating past the EOS token.
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: drop special tokens from the text.
        logprobs: return this many top logprobs per output token (plus the
            chosen token's); None returns none.
        prompt_logprobs: the same for every prompt token (disables prefix
            cache hits for the request: every position must be computed).
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None and (
            isinstance(self.best_of, bool) or not isinstance(self.best_of, int) or self.best_of < self.n
        ):
            raise ValueError(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS
            ):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disables), got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if self.stop is None:
            stops: list[str] = []
        elif isinstance(self.stop, str):
            stops = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            stops = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        self._stop_list = stops
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
            ):
                raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
            self.stop_token_ids = list(self.stop_token_ids)

    @property
    def num_samples(self) -> int:
        """Sequences to run: best_of if given, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list
