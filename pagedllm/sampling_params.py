"""Per-request sampling settings, with vLLM's names and defaults.

``SamplingParams`` is a pydantic model whose fields declare their own constraints (``Field(ge=..., le=...)``,
strict types: a count takes no bool or float), checked by pydantic's compiled core; what fields say about
each other (``best_of >= n``, ``min_tokens <= max_tokens``, a choice long enough for ``min_tokens``) and
what a string holds are checked after, in ``model_post_init``. A refusal is a ValueError of one line
naming the field and the value given. It is a ``BaseModel`` rather than a pydantic dataclass because it
is built once per request: a model with these 24 fields builds in a few microseconds, a dataclass in
about three times that (docs/configuration.md has the measurements).
"""

from __future__ import annotations

import enum
import json as _json
import math
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    InstanceOf,
    ValidationError,
)

from pagedllm.config_record import requirement

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


# the constrained types of SamplingParams' fields (pydantic checks them in its compiled core)
Count = Annotated[int, Field(ge=0, le=MAX_INT32)]
TokenId = Count
PositiveCount = Annotated[int, Field(ge=1, le=MAX_INT32)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
Seed = Annotated[int, Field(ge=INT64_RANGE[0], le=INT64_RANGE[1])]
Penalty = Annotated[float, Field(ge=-MAX_ADDITIVE_PENALTY, le=MAX_ADDITIVE_PENALTY, allow_inf_nan=False)]
Bias = Annotated[float, Field(ge=-MAX_FLOAT32, le=MAX_FLOAT32, allow_inf_nan=False)]


def _as_list(value: object) -> object:
    """A tuple as a list (vLLM takes either for a list field); anything else as it is."""
    return list(value) if isinstance(value, tuple) else value


AsList = BeforeValidator(_as_list)
TokenIds = Annotated[list[TokenId], AsList]
Words = Annotated[list[str], AsList]

# what a field must be, where pydantic's wording of a union would say only one member's
_REQUIREMENTS = {"stop": "must be a string or a list of strings"}
# the fields of integers, for the wording of a bound ("an integer >= 1")
_INT_FIELDS = frozenset({"n", "best_of", "top_k", "seed", "max_tokens", "stop_token_ids", "logprobs",
                         "prompt_logprobs", "min_tokens", "allowed_token_ids", "truncate_prompt_tokens"})


def _path(loc: tuple[Any, ...]) -> str:
    """``("stop_token_ids", 1)`` -> ``stop_token_ids[1]``, a dict's key -> ``logit_bias key``; a union
    member's name in the path (``list[int]``) is left out."""
    if loc[-1] == "[key]":
        return f"{loc[0]} key"
    text = str(loc[0])
    for part in loc[1:]:
        if isinstance(part, int) or not (str(part).isidentifier() or "[" in str(part)):
            text += f"[{part!r}]"
    return text


def _readable(error: ValidationError, given: dict[str, object]) -> str:
    """pydantic's report as one line: the first refused field, what it must be, and the value given."""
    e = error.errors(include_url=False)[0]
    loc, ctx = e["loc"], e.get("ctx", {})
    if not loc or e["type"] == "value_error":  # a check of ours: its message names its fields
        return str(ctx.get("error", e["msg"]))
    name = str(loc[0])
    if e["type"] == "unexpected_keyword_argument":
        return f"SamplingParams has no field {name!r}"
    whole = given.get(name, e["input"])
    path = _path(loc)
    if name in _REQUIREMENTS:
        return f"{name} {_REQUIREMENTS[name]}, got {_short(whole)}"
    what = requirement(e, "an integer" if name in _INT_FIELDS or path.endswith(" key") else "a number")
    if path == name:
        return f"{name} {what}, got {_short(whole)}"
    return f"{path} {what}, got {_short(e['input'])} (in {name}={_short(whole)})"


class SamplingParams(BaseModel):
    """How to sample a request's outputs.

    Attributes:
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
        thinking_token_budget: at most this many reasoning tokens (vLLM's
            name; >= 0, None: no limit): once the block opened by
            ``think_start_str`` (in the output, or left open by the prompt)
            has run this many tokens without closing, ``think_end_str`` is
            forced token by token and the answer follows
            (``pagedllm/thinking_budget.py``). With ``structured_outputs``
            and a block the prompt opened, the grammar holds from the block's end.
        think_start_str: the text that opens the reasoning block (Qwen3's ``<think>``).
        think_end_str: what is forced to close it: the closing marker (a block
            counts as closed once the model writes it), then the whitespace
            after it (Qwen3's ``</think>`` and a blank line).
        think_close_str: the closing marker, where more than whitespace
            follows it in ``think_end_str`` (None: ``think_end_str`` without
            its trailing whitespace). gpt-oss's: ``<|end|>``, with
            ``think_end_str`` ``<|end|><|start|>assistant<|channel|>final<|message|>``
            (the analysis message ends, the final one opens); ``think_end_str``
            must start with it.
        structured_outputs: a ``StructuredOutputsParams`` constraint (JSON
            schema, regex, choice, grammar, any JSON object) the output
            follows: tokens that would break it are masked before sampling
            (greedy too), and the output ends with finish_reason "stop" when
            the constraint is complete and the model's EOS is sampled, or
            "length" at ``max_tokens``.
        output_kind: a ``RequestOutputKind``: whole outputs (CUMULATIVE, the
            default), what is new in each (DELTA, for streaming), or the
            final one only (FINAL_ONLY).

    Fields may be set after construction (the server sets
    ``structured_outputs`` for a tool choice) and are not checked again then.

    The logits processors above (penalties, bias, allowed ids, bad words,
    min_tokens) change which token is sampled, greedy rows included; the
    logprobs reported stay those of the raw model distribution, as vLLM's
    default ``raw_logprobs``.
    """

    # strict: a count takes no bool, float or numeric string, a number no bool or string
    model_config = ConfigDict(strict=True, extra="forbid")

    n: PositiveCount = 1
    best_of: PositiveCount | None = None
    temperature: Annotated[float, Field(ge=0, le=MAX_FLOAT32, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=MAX_INT32)] = 0  # 0 or -1 disables
    min_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] = 0.0
    seed: Seed | None = None
    max_tokens: PositiveCount | None = 16
    stop: Annotated[str | list[str] | None, AsList] = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: NumLogprobs | None = None
    prompt_logprobs: NumLogprobs | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=MAX_FLOAT32, allow_inf_nan=False)] = 1.0
    min_tokens: Count = 0
    logit_bias: dict[TokenId, Bias] | None = None
    allowed_token_ids: Annotated[list[TokenId], AsList, Field(min_length=1)] | None = None
    bad_words: Words | None = None
    truncate_prompt_tokens: PositiveCount | None = None
    thinking_token_budget: Count | None = None
    think_start_str: str = "<think>"
    think_end_str: str = "</think>\n\n"
    think_close_str: str | None = None
    structured_outputs: InstanceOf[StructuredOutputsParams] | None = None
    output_kind: InstanceOf[RequestOutputKind] = RequestOutputKind.CUMULATIVE

    def __init__(self, **kwargs: Any) -> None:  # noqa: ANN401 (the fields' types)
        try:
            super().__init__(**kwargs)
        except ValidationError as e:
            raise ValueError(_readable(e, kwargs)) from None

    def model_post_init(self, context: Any, /) -> None:  # noqa: ANN401 (pydantic's hook)
        """What the fields say about each other, and the text checks; each field's own type and bounds were
        checked before (by pydantic, from the annotations above)."""
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        if self.stop is not None:
            for s in self.stop_strings:
                if not s:
                    raise ValueError("stop strings must not be empty")
                check_text("stop", s)
        if self.logit_bias:
            # vLLM clamps a bias into OpenAI's range rather than refusing it
            self.logit_bias = {t: min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, b)) for t, b in self.logit_bias.items()}
        if self.bad_words is not None:
            if any(not w.strip() for w in self.bad_words):
                raise ValueError("bad_words must not contain empty (or blank) strings")
            for w in self.bad_words:
                check_text("bad_words", w)
            self.bad_words = list(dict.fromkeys(self.bad_words))
        if self.thinking_token_budget is not None:
            for name in ("think_start_str", "think_end_str"):
                if not getattr(self, name).strip():
                    raise ValueError(f"{name} must not be empty (or blank) with thinking_token_budget")
                check_text(name, getattr(self, name))
            close = self.think_close_str
            if close is not None and (not close.strip() or not self.think_end_str.startswith(close)):
                raise ValueError("think_close_str must be non-blank and begin think_end_str")
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

    @property
    def has_logits_processors(self) -> bool:
        """Whether any penalty, bias, allowed-id, bad-word, min_tokens or thinking-budget setting is active."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.min_tokens or self.logit_bias or self.allowed_token_ids is not None or self.bad_words
            or self.thinking_token_budget is not None
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
        """``stop`` as a list (a new one each time: the caller may keep it)."""
        stop = self.stop
        return [] if stop is None else [stop] if isinstance(stop, str) else list(stop)


# the SamplingParams fields a model's generation_config.json (or a GGUF file's general.sampling.*) may default:
# vLLM's list, max_new_tokens read as max_tokens
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")


def with_defaults(params: SamplingParams, defaults: dict[str, Any]) -> SamplingParams:
    """``params`` with each field it leaves unset taken from ``defaults`` (the model's, ``MODEL_DEFAULT_FIELDS``).

    A field is set when it was passed to the constructor or assigned after
    (pydantic's ``model_fields_set``), even at its class default:
    ``SamplingParams(temperature=1.0)`` keeps 1.0 whatever the model says.
    The result is a new object, checked again as a whole (a ``min_tokens``
    above the model's ``max_tokens`` is a ValueError); ``params`` itself when
    nothing applies.
    """
    missing = {k: v for k, v in defaults.items() if k not in params.model_fields_set}
    if not missing:
        return params
    given = {k: getattr(params, k) for k in params.model_fields_set}
    return SamplingParams(**given, **missing)
