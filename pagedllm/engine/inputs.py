"""What a request brings in, checked once for the offline API and the server: its prompt and its logits rules.

``LLMEngine.process_prompt`` (the offline API, and the engine thread for
every request) and the server's ``PromptEncoder`` (before a request is
queued, off the engine thread) apply the same rules through this module:

- a text prompt is valid UTF-8 and not empty; token ids are integers inside the vocabulary, not none;
- ``truncate_prompt_tokens`` keeps the last k token ids (the text stays as given);
- the prompt leaves room for output, and for ``max_tokens`` when given, in ``max_model_len``
  (``ContextLengthError``);
- logit bias, allowed ids and bad words name tokens of the vocabulary, and ``min_tokens`` does not ban
  every allowed token, nor bad words every allowed one (``logits_rules``, which also builds the
  runner's ``LogitsRules``); a structured output can start with a token they leave (``check_first_token``).

Plain Python: the server's handlers call it without the runner.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from pagedllm.sampling_params import SamplingParams, check_text
from pagedllm.step_record import LogitsRules
from pagedllm.thinking_budget import ThinkingBudget, marker_pieces

if TYPE_CHECKING:
    from pagedllm.structured_output.grammar_state import RequestGrammar


class ContextLengthError(ValueError):
    """The prompt, or the prompt plus max_tokens, does not fit in max_model_len."""


class PromptTokenizer(Protocol):
    """What prompt checks need of a tokenizer (pagedllm's ``Tokenizer`` has it)."""

    eos_token_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def check_prompt_text(text: str) -> None:
    """ValueError unless ``text`` is a non-empty, valid Unicode prompt."""
    if not text:
        raise ValueError("the prompt is empty")
    check_text("the prompt", text)


def check_prompt_token_ids(ids: object, vocab_size: int) -> list[int]:
    """``ids`` as a list, after checking it is a non-empty list of ids inside the vocabulary."""
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("prompt_token_ids must be a list of integers")
    if not ids:
        raise ValueError("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return list(ids)


def truncate_prompt(ids: list[int], params: SamplingParams | None) -> list[int]:
    """The last ``params.truncate_prompt_tokens`` ids of ``ids``; all of them without the setting."""
    keep = params.truncate_prompt_tokens if params is not None else None
    return ids if keep is None else ids[-keep:]


def check_prompt_len(num_prompt_tokens: int, params: SamplingParams | None, max_model_len: int) -> None:
    """Raise ContextLengthError unless the prompt (plus ``params.max_tokens``) fits in ``max_model_len``."""
    if num_prompt_tokens >= max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens (max_model_len). However, the "
            f"prompt has {num_prompt_tokens} tokens, which leaves no room for output. Please reduce "
            "the length of the prompt."
        )
    if params is not None and params.max_tokens is not None and num_prompt_tokens + params.max_tokens > max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens (max_model_len). However, "
            f"{num_prompt_tokens + params.max_tokens} tokens were requested ({num_prompt_tokens} in the "
            f"prompt, {params.max_tokens} in the completion). Please reduce the length of the prompt or "
            "of max_tokens."
        )


def _check_vocab(name: str, ids: Iterable[int], vocab_size: int) -> None:
    bad = sorted({t for t in ids if not 0 <= t < vocab_size})
    if bad:
        raise ValueError(f"{name} has token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})")


def bad_word_token_ids(words: list[str], encode: Callable[[str], list[int]]) -> list[tuple[int, ...]]:
    """The token sequences ``words`` ban, as vLLM derives them.

    Each word (its leading spaces stripped) is tokenized as is, and with a
    leading space: the spaced form is banned too when it starts with another
    token and has as many tokens (a word inside text, where most tokenizers
    fold the space into the word's first token).
    """
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(encode(word.lstrip()))
        if not bare:
            raise ValueError(f"bad_words entry {word!r} tokenizes to no token")
        out.append(bare)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


def always_banned(bad_words: Iterable[tuple[int, ...]]) -> set[int]:
    """The tokens ``bad_words`` ban at every step: those of one-token words (a longer word's last token is
    banned only after its other tokens)."""
    return {word[0] for word in bad_words if len(word) == 1}


def first_usable_token_ids(rules: LogitsRules) -> set[int] | None:
    """The tokens ``rules`` let a sequence sample first (``min_tokens`` bans included); None: any."""
    if not rules.allowed_token_ids:
        return None
    usable = set(rules.allowed_token_ids) - always_banned(rules.bad_words)
    return usable - set(rules.min_tokens_banned) if rules.min_tokens else usable


def _check_something_allowed(
    allowed: tuple[int, ...], bad_words: tuple[tuple[int, ...], ...], min_tokens_banned: tuple[int, ...]
) -> None:
    """ValueError when ``allowed_token_ids`` leave no token to sample, at any step or until ``min_tokens``."""
    if not allowed:
        return  # the whole vocabulary: bad_words cannot ban it all
    usable = set(allowed) - always_banned(bad_words)
    if not usable:
        raise ValueError(
            f"allowed_token_ids {list(allowed)[:5]} are all banned by bad_words: no token is left to sample"
        )
    if min_tokens_banned and not usable - set(min_tokens_banned):
        raise ValueError(
            "min_tokens would ban every token in allowed_token_ids that bad_words leave (EOS and stop_token_ids)"
        )


def logits_rules(
    params: SamplingParams, encode: Callable[[str], list[int]], eos_token_ids: Iterable[int], vocab_size: int,
    pieces: Callable[[tuple[str, ...]], Mapping[int, str]] | None = None,
) -> LogitsRules | None:
    """The logits processors of ``params`` for a model with ``vocab_size`` tokens; None when it has none.

    ``encode`` tokenizes without special tokens (for ``bad_words``); ``pieces``
    gives the tokens that can spell some markers (``thinking_budget.marker_pieces``;
    needed for ``thinking_token_budget``). Raises
    ValueError for a token id outside the vocabulary, and for ``min_tokens``
    that would ban every allowed token.
    """
    # a yes/no reranker's pooling request reads these ids' logits (pooling/params.py), not logits processors
    _check_vocab("pooled_logit_ids", getattr(params, "pooled_logit_ids", ()), vocab_size)
    if not params.has_logits_processors:
        return None
    bias = tuple(sorted((params.logit_bias or {}).items()))
    _check_vocab("logit_bias", (t for t, _ in bias), vocab_size)
    allowed = tuple(sorted(set(params.allowed_token_ids or ())))
    _check_vocab("allowed_token_ids", allowed, vocab_size)
    bad_words = tuple(bad_word_token_ids(params.bad_words or [], encode))
    _check_vocab("bad_words", (t for w in bad_words for t in w), vocab_size)
    # vLLM masks the EOS ids even with ignore_eos: min_tokens is about length
    banned: tuple[int, ...] = ()
    if params.min_tokens:
        banned = tuple(sorted({t for t in (*eos_token_ids, *(params.stop_token_ids or ())) if 0 <= t < vocab_size}))
    _check_something_allowed(allowed, bad_words, banned)
    thinking = thinking_budget(params, encode, vocab_size, pieces)
    return LogitsRules(
        presence_penalty=float(params.presence_penalty),
        frequency_penalty=float(params.frequency_penalty),
        repetition_penalty=float(params.repetition_penalty),
        logit_bias=bias,
        allowed_token_ids=allowed,
        bad_words=bad_words,
        min_tokens=params.min_tokens,
        min_tokens_banned=banned,
        thinking=thinking,
    )


def thinking_budget(
    params: SamplingParams, encode: Callable[[str], list[int]], vocab_size: int,
    pieces: Callable[[tuple[str, ...]], Mapping[int, str]] | None,
) -> ThinkingBudget | None:
    """``thinking_token_budget`` with its markers and forced tokens (not yet knowing the prompt); None without a budget.

    ValueError for a marker that tokenizes to nothing. With ``structured_outputs`` the engine
    starts the grammar where the block ends (``ThinkingBudget.grammar_start``).
    """
    if params.thinking_token_budget is None:
        return None
    if pieces is None:
        raise ValueError("thinking_token_budget needs the tokenizer's token texts, which this engine was not given")
    # the closing marker the model may write itself, then what else is forced after it (whitespace, or harmony's
    # next message header)
    close_str = params.think_close_str if params.think_close_str is not None else params.think_end_str.rstrip()
    if not params.think_end_str.startswith(close_str):  # checked at construction; the fields may be set later
        raise ValueError(f"think_close_str {close_str!r} must begin think_end_str {params.think_end_str!r}")
    suffix = params.think_end_str[len(close_str) :]
    start_str = params.think_start_str.strip()  # the whitespace around the opening marker may tokenize either way
    forced = tuple(encode(close_str)) + (tuple(encode(suffix)) if suffix else ())
    _check_vocab("think_start_str / think_end_str", forced, vocab_size)
    return ThinkingBudget(params.thinking_token_budget, start_str, close_str, forced, pieces((start_str, close_str)))


def check_first_token(rules: LogitsRules | None, grammar: RequestGrammar | None) -> None:
    """ValueError when a structured output cannot start with any token ``allowed_token_ids`` leave."""
    usable = first_usable_token_ids(rules) if rules is not None else None
    if grammar is None or usable is None or grammar.allows_first(usable):
        return
    raise ValueError(
        "allowed_token_ids leave no token that can start the structured output (after what bad_words and "
        "min_tokens ban): no token is left to sample"
    )


class InputProcessor:
    """The prompt and logits-rule checks of one model: its tokenizer, vocabulary and context length.

    Reads only what it was given at construction, so any thread may call it.
    """

    def __init__(self, tokenizer: PromptTokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._token_texts: Sequence[str] | None = None  # every token's text, decoded on the first thinking budget
        self._pieces: dict[tuple[str, ...], Mapping[int, str]] = {}  # markers -> marker_pieces (a few per server)

    def process_prompt(self, prompt: str | dict, params: SamplingParams | None = None) -> tuple[str | None, list[int]]:
        """Text or token ids -> (text or None, validated token ids), truncated and checked against the context."""
        if isinstance(prompt, str):
            check_text("the prompt", prompt)
            text, ids = prompt, (self.tokenizer.encode(prompt) if prompt else [])
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        elif isinstance(prompt, dict) and "prompt" in prompt:
            return self.process_prompt(prompt["prompt"], params)
        else:
            raise ValueError(
                "a prompt must be a string, {'prompt': str} or {'prompt_token_ids': list[int]}, "
                f"got {type(prompt).__name__}"
            )
        ids = truncate_prompt(check_prompt_token_ids(ids, self.vocab_size), params)
        check_prompt_len(len(ids), params, self.max_model_len)
        return text, ids

    def logits_rules(self, params: SamplingParams) -> LogitsRules | None:
        """The request's logits processors against this tokenizer and vocabulary (``logits_rules``)."""
        return logits_rules(
            params,
            lambda word: self.tokenizer.encode(word, add_special_tokens=False),
            self.tokenizer.eos_token_ids,
            self.vocab_size,
            self.marker_pieces,
        )

    def marker_pieces(self, markers: tuple[str, ...]) -> Mapping[int, str]:
        """The tokens that can spell part of ``markers`` (``thinking_budget.marker_pieces``), computed once per markers.

        Two threads asking at once may both compute it; either result is the same.
        """
        found = self._pieces.get(markers)
        if found is None:
            if self._token_texts is None:
                self._token_texts = token_texts(self.tokenizer, self.vocab_size)
            found = self._pieces[markers] = marker_pieces(self._token_texts, markers)
        return found


def token_texts(tokenizer: PromptTokenizer, vocab_size: int) -> list[str]:
    """Each token id's text alone (special tokens as their text; ids past the tokenizer's vocabulary: empty)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a ``tokenizers.Tokenizer``: decodes in Rust, at once
    if backend is not None:
        num_tokens = min(backend.get_vocab_size(with_added_tokens=True), vocab_size)
        texts = list(backend.decode_batch([[i] for i in range(num_tokens)], skip_special_tokens=False))
    else:
        texts = [tokenizer.decode([i], skip_special_tokens=False) for i in range(vocab_size)]  # type: ignore[attr-defined]
    return texts + [""] * (vocab_size - len(texts))
