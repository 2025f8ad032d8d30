"""Turns the scheduler's plan (live ``Sequence`` objects) into the runner's plain ``StepRecord``."""

from __future__ import annotations

from pagedllm.engine.scheduler import ScheduledSequence, SchedulerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.step_record import SamplingSpec, SequenceStep, StepRecord

# below this, dividing logits by the temperature overflows: greedy
MIN_TEMPERATURE = 1e-5


def sampling_spec(params: SamplingParams, num_top_logprobs: int | None) -> SamplingSpec:
    """The sampling settings of ``params`` as the sampler applies them."""
    temperature = params.temperature if params.temperature >= MIN_TEMPERATURE else 0.0
    return SamplingSpec(temperature, params.top_k, params.top_p, params.min_p, num_top_logprobs)


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


def build_step_record(
    output: SchedulerOutput, params: list[SamplingParams], num_top: list[int | None]
) -> StepRecord:
    """The record of one step: ``params[i]`` and ``num_top[i]`` belong to ``output.scheduled[i]``.

    The uniforms each sampling row needs are drawn here, once, from its
    sequence's own stream; greedy rows draw nothing, so a seeded stream is
    never disturbed by them.
    """
    if len(params) != len(output.scheduled) or len(num_top) != len(output.scheduled):
        raise ValueError("a step needs one SamplingParams and one num_top per scheduled sequence")
    steps = []
    for s, p, top in zip(output.scheduled, params, num_top):
        spec = sampling_spec(p, top)
        uniforms: tuple[float, ...] = ()
        if s.samples:
            uniforms = tuple(seq.rng.random() if spec.temperature > 0 else 0.0 for seq in (s.seq, *s.forks))
        scored, targets = _prompt_scoring(s, p)
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
        ))
    return StepRecord(tuple(steps), tuple(output.blocks_to_copy))
