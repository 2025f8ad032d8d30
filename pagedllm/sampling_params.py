"""Per-request sampling settings, with vLLM's names and defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
# bounds of what the engine's tensors and counters hold: counts and token ids
# go into int32/int64 tensors, settings into float32 ones; a value past them
# is refused here rather than overflowing inside a step shared with others
MAX_INT32 = 2**31 - 1
INT64_RANGE = (-(2**63), 2**63 - 1)
MAX_FLOAT32 = 3.4028234663852886e38


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_int(name: str, value: object, low: int, high: int = MAX_INT32, none_ok: bool = False) -> None:
    """Raise ValueError unless ``value`` is an integer in ``[low, high]`` (or None when allowed)."""
    if value is None and none_ok:
        return
    if not _is_int(value) or not low <= value <= high:
        suffix = " or None" if none_ok else ""
        raise ValueError(f"{name} must be an integer in [{low}, {high}]{suffix}, got {_short(value)}")


def check_float(name: str, value: object, low: float, high: float = MAX_FLOAT32, low_open: bool = False) -> None:
    """Raise ValueError unless ``value`` is a finite number in ``[low, high]`` (``(low, high]`` if ``low_open``)."""
    if not _is_number(value) or value > high or value < low or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low}, {high:g}]"
        raise ValueError(f"{name} must be a finite number in {interval}, got {_short(value)}")


def check_text(name: str, text: str) -> None:
    """Raise ValueError for a string that is not valid Unicode text (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid UTF-8 text: {e.reason} at position {e.start}") from None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
        check_int("n", self.n, 1)
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise ValueError(f"best_of must be an integer >= n ({self.n}), got {_short(self.best_of)}")
        check_int("best_of", self.best_of, 1, none_ok=True)
        check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS, none_ok=True)
        check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS, none_ok=True)
        check_float("temperature", self.temperature, 0.0)
        check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        check_int("top_k", self.top_k, -1)  # 0 or -1 disables
        check_float("min_p", self.min_p, 0.0, 1.0)
        check_int("seed", self.seed, *INT64_RANGE, none_ok=True)
        check_int("max_tokens", self.max_tokens, 1, none_ok=True)
        if self.stop is None:
            stops: list[str] = []
        elif isinstance(self.stop, str):
            stops = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            stops = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {_short(self.stop)}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        for s in stops:
            check_text("stop", s)
        self._stop_list = stops
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise ValueError(f"stop_token_ids must be a list of token ids, got {_short(self.stop_token_ids)}")
            if not all(_is_int(t) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids):
                raise ValueError(
                    f"stop_token_ids must be a list of integers in [0, {MAX_INT32}], got {_short(self.stop_token_ids)}"
                )
            self.stop_token_ids = list(self.stop_token_ids)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {_short(getattr(self, name))}")

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
