"""Turns the scheduler's plan (live ``Sequence`` objects) into the runner's plain ``StepRecord``."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pagedllm.engine.scheduler import ScheduledSequence, SchedulerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.step_record import LogitsRules, SamplingSpec, SequenceStep, StepRecord

# below this, dividing logits by the temperature overflows: greedy
MIN_TEMPERATURE = 1e-5


def sampling_spec(
    params: SamplingParams, num_top_logprobs: int | None, rules: LogitsRules | None = None
) -> SamplingSpec:
    """The sampling settings of ``params`` as the sampler applies them."""
    temperature = params.temperature if params.temperature >= MIN_TEMPERATURE else 0.0
    return SamplingSpec(temperature, params.top_k, params.top_p, params.min_p, num_top_logprobs, rules)


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


def logits_rules(
    params: SamplingParams, encode: Callable[[str], list[int]], eos_token_ids: Iterable[int], vocab_size: int
) -> LogitsRules | None:
    """The logits processors of ``params`` for a model with ``vocab_size`` tokens; None when it has none.

    ``encode`` tokenizes without special tokens (for ``bad_words``). Raises
    ValueError for a token id outside the vocabulary, and for ``min_tokens``
    that would ban every allowed token.
    """
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
        if allowed and set(allowed) <= set(banned):
            raise ValueError("min_tokens would ban every token in allowed_token_ids (EOS and stop_token_ids)")
    return LogitsRules(
        presence_penalty=float(params.presence_penalty),
        frequency_penalty=float(params.frequency_penalty),
        repetition_penalty=float(params.repetition_penalty),
        logit_bias=bias,
        allowed_token_ids=allowed,
        bad_words=bad_words,
        min_tokens=params.min_tokens,
        min_tokens_banned=banned,
    )


def _prompt_scoring(s: ScheduledSequence, params: SamplingParams) -> tuple[int | None, tuple[int, ...]]:
    """Whether this step scores prompt tokens, and which.

    The step computes positions ``c .. c+k-1`` (a whole prompt, or one chunk
    of it); their logits score prompt tokens ``c+1 .. c+k``, those that
    exist. Every chunk that scores some does; a one-token prompt gets its
    empty list on its first chunk.
    """
    first = s.num_computed_tokens
    prompt_len = s.seq.num_prompt_tokens
    if params.prompt_logprobs is None or not (first == 0 or first < prompt_len - 1):
        return None, ()
    last = min(first + s.num_new_tokens, prompt_len - 1)  # exclusive
    return params.prompt_logprobs, tuple(s.seq.token_ids[first + 1 : last + 1])


def _history(s: ScheduledSequence, rules: LogitsRules | None) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """The prompt and each sampled row's output, when the rules need them (copied: the record is plain data)."""
    if rules is None or not s.samples:
        return (), ()
    prompt = tuple(s.seq.prompt_token_ids) if rules.needs_prompt else ()
    outputs = tuple(tuple(seq.output_token_ids) for seq in (s.seq, *s.forks)) if rules.needs_output else ()
    return prompt, outputs


def build_step_record(
    output: SchedulerOutput,
    params: list[SamplingParams],
    num_top: list[int | None],
    rules: list[LogitsRules | None] | None = None,
    bitmasks: list[tuple[bytes, ...]] | None = None,
) -> StepRecord:
    """The record of one step: ``params[i]``, ``num_top[i]``, ``rules[i]``, ``bitmasks[i]`` are ``output.scheduled[i]``'s.

    The uniforms each sampling row needs are drawn here, once, from its
    sequence's own stream; greedy rows draw nothing, so a seeded stream is
    never disturbed by them. ``rules`` (None: no request has any) are the
    requests' logits processors (``logits_rules``); ``bitmasks`` (None: no
    request has a constraint) the structured-output masks of each sampled
    row, as the engine's grammar state filled them (empty for a sequence
    without a constraint or that does not sample).
    """
    num = len(output.scheduled)
    rules = [None] * num if rules is None else rules
    bitmasks = [()] * num if bitmasks is None else bitmasks
    if len(params) != num or len(num_top) != num or len(rules) != num or len(bitmasks) != num:
        raise ValueError("a step needs one SamplingParams, num_top, rules and bitmasks per scheduled sequence")
    steps = []
    for s, p, top, rule, masks in zip(output.scheduled, params, num_top, rules, bitmasks):
        spec = sampling_spec(p, top, rule)
        uniforms: tuple[float, ...] = ()
        if s.samples:
            uniforms = tuple(seq.rng.random() if spec.temperature > 0 else 0.0 for seq in (s.seq, *s.forks))
        if masks and len(masks) != len(uniforms):
            raise ValueError("a constrained sequence needs one bitmask per sampled row")
        scored, targets = _prompt_scoring(s, p)
        prompt_ids, output_ids = _history(s, rule)
        c = s.num_computed_tokens
        steps.append(SequenceStep(
            request_id=s.seq.request_id,
            num_computed_tokens=c,
            token_ids=tuple(s.seq.token_ids[c : c + s.num_new_tokens]),
            block_table=tuple(s.seq.block_table),
            sampling=spec,
            uniforms=uniforms,
            prompt_logprobs=scored,
            prompt_targets=targets,
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            token_bitmasks=tuple(masks),
        ))
    return StepRecord(tuple(steps), tuple(output.blocks_to_copy))
