"""Per-request sampling settings, with vLLM's names and defaults."""

from __future__ import annotations

import enum
import json as _json
import math
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
# bounds of what the engine's tensors and counters hold: counts and token ids
# go into int32/int64 tensors, settings into float32 ones; a value past them
# is refused here rather than overflowing inside a step shared with others
MAX_INT32 = 2**31 - 1
INT64_RANGE = (-(2**63), 2**63 - 1)
MAX_FLOAT32 = 3.4028234663852886e38
# vLLM's limits: OpenAI's range for the two additive penalties, and the bias
# range OpenAI documents (vLLM clamps into it rather than refusing)
MAX_ADDITIVE_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0


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


# the constraint kinds of StructuredOutputsParams, in vLLM's names
CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint the output must follow (vLLM's ``StructuredOutputsParams``); exactly one kind.

    Args:
        json: a JSON schema (a dict, or its text); the output is a JSON
            document that validates against it.
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar in EBNF (GBNF, the format of
            llama.cpp and xgrammar) with a ``root`` rule.
        json_object: True: the output is any JSON object.
        disable_any_whitespace: JSON output without whitespace between
            tokens (by default any whitespace is allowed there, as in vLLM).

    Only the form is checked here; whether a schema, regex or grammar
    compiles is checked when the request is added to an engine (ValueError).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = f"got {', '.join(given)}" if given else "got none"
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(CONSTRAINT_KINDS)} ({what})"
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be a bool, got {_short(self.disable_any_whitespace)}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_dict(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {_short(value)}")
            if value is not None:
                check_text(f"structured_outputs.{name}", value)
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                isinstance(c, str) and c for c in self.choice
            ):
                raise ValueError(
                    f"structured_outputs.choice must be a non-empty list of non-empty strings, got {_short(self.choice)}"
                )
            for c in self.choice:
                check_text("structured_outputs.choice", c)
            object.__setattr__(self, "choice", list(self.choice))
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be true when given, got {_short(self.json_object)}")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``CONSTRAINT_KINDS``."""
        return next(k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """A hashable identity of the constraint: equal keys compile to the same grammar.

        A schema's key keeps its property order (it is the order of the output's keys).
        """
        kind = self.kind
        if kind == "json":
            text = _json.dumps(self.json, ensure_ascii=False)
        elif kind == "choice":
            text = _json.dumps(self.choice, ensure_ascii=False)
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(self, kind)
        return kind, text, self.disable_any_whitespace


def _schema_dict(schema: object) -> dict[str, Any]:
    """A JSON schema given as a dict or as its text, as a dict; ValueError otherwise."""
    if isinstance(schema, str):
        try:
            schema = _json.loads(schema)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs.json must be a JSON schema object, got {_short(schema)}")
    try:
        _json.dumps(schema)
    except (TypeError, ValueError) as e:
        raise ValueError(f"structured_outputs.json is not JSON data: {e}") from None
    return schema


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request carries (vLLM's names).

    CUMULATIVE: every output so far, whole (the default; ``LLM.generate``'s shape).
    DELTA: only what is new since the request's previous output: the text (the
        last ``longest stop string - 1`` characters held back until the output
        finishes, since a stop string may yet cut them), the token ids and their
        logprobs; a streaming client formats each as it comes.
    FINAL_ONLY: one output, when the request finishes.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


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
        presence_penalty: in [-2, 2]; subtracted once from the logit of every
            token that already appears in the output (> 0 favours new tokens).
        frequency_penalty: in [-2, 2]; subtracted from a token's logit once
            per time it appears in the output.
        repetition_penalty: positive (> 0); tokens seen in the prompt or the output have
            positive logits divided by it and negative ones multiplied (> 1
            discourages repeats); 1 disables.
        min_tokens: EOS and ``stop_token_ids`` cannot be sampled (and stop
            strings do not end the output) until this many tokens were
            generated; at most ``max_tokens``.
        logit_bias: {token id: bias} added to those logits before sampling;
            biases are clamped to [-100, 100] as vLLM does, ids must be in
            the vocabulary (checked when the request is added).
        allowed_token_ids: only these tokens may be sampled (non-empty, in
            the vocabulary).
        bad_words: words that must not be generated: each is tokenized with
            and without a leading space, and the last token of a tokenized
            word is banned whenever the output ends with its other tokens
            (a one-token word is always banned).
        truncate_prompt_tokens: keep only the last k prompt tokens (>= 1).
        structured_outputs: a ``StructuredOutputsParams`` constraint (JSON
            schema, regex, choice, grammar, any JSON object) the output
            follows: tokens that would break it are masked before sampling
            (greedy too), and the output ends with finish_reason "stop" when
            the constraint is complete and the model's EOS is sampled, or
            "length" at ``max_tokens``.
        output_kind: a ``RequestOutputKind``: whole outputs (CUMULATIVE, the
            default), what is new in each (DELTA, for streaming), or the
            final one only (FINAL_ONLY).

    The logits processors above (penalties, bias, allowed ids, bad words,
    min_tokens) change which token is sampled, greedy rows included; the
    logprobs reported stay those of the raw model distribution, as vLLM's
    default ``raw_logprobs``.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
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
        self._check_logits_processors()
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be StructuredOutputsParams, got {type(self.structured_outputs).__name__}"
            )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {_short(self.output_kind)}")
        self._check_choice_reaches_min_tokens()

    def _check_choice_reaches_min_tokens(self) -> None:
        """ValueError when ``min_tokens`` is more than any ``choice`` can take.

        A token the grammar allows is at least one byte of text and EOS is
        banned until ``min_tokens``, so a choice of k bytes ends within k
        tokens: past every choice's length the request could only dead-end.
        Below that it may still (the tokenizer may write a choice in fewer
        tokens); that sequence then ends with finish reason "no_valid_token".
        """
        if self.structured_outputs is None or self.structured_outputs.choice is None or not self.min_tokens:
            return
        longest = max(len(c.encode()) for c in self.structured_outputs.choice)
        if self.min_tokens > longest:
            raise ValueError(
                f"min_tokens={self.min_tokens} is more tokens than any structured_outputs.choice can take (the "
                f"longest is {longest} bytes, and every token is at least one byte)"
            )

    def _check_logits_processors(self) -> None:
        """Validate (and normalise) the penalty, bias, allowed-id, bad-word and min_tokens settings."""
        check_float("presence_penalty", self.presence_penalty, -MAX_ADDITIVE_PENALTY, MAX_ADDITIVE_PENALTY)
        check_float("frequency_penalty", self.frequency_penalty, -MAX_ADDITIVE_PENALTY, MAX_ADDITIVE_PENALTY)
        check_float("repetition_penalty", self.repetition_penalty, 0.0, low_open=True)
        check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, none_ok=True)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {_short(self.logit_bias)}")
            bias: dict[int, float] = {}
            for token, value in self.logit_bias.items():
                check_int("logit_bias token id", token, 0)
                check_float("logit_bias value", value, -MAX_FLOAT32)
                bias[token] = float(min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, value)))
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids:
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {_short(ids)}")
            if not all(_is_int(t) and 0 <= t <= MAX_INT32 for t in ids):
                raise ValueError(f"allowed_token_ids must be integers in [0, {MAX_INT32}], got {_short(ids)}")
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
                raise ValueError(f"bad_words must be a list of strings, got {_short(words)}")
            if any(not w.strip() for w in words):
                raise ValueError("bad_words must not contain empty (or blank) strings")
            for w in words:
                check_text("bad_words", w)
            self.bad_words = list(dict.fromkeys(words))

    @property
    def has_logits_processors(self) -> bool:
        """Whether any penalty, bias, allowed-id, bad-word or min_tokens setting is active."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.min_tokens or self.logit_bias or self.allowed_token_ids is not None or self.bad_words
        )

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
