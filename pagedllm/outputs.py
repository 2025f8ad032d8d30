"""What ``generate`` and ``LLMEngine.step`` return, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability under the model, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per position: {token_id: Logprob} for the chosen token and the top alternatives
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of a request's ``n`` outputs.

    ``finish_reason`` is None while running, then "stop" (EOS, a stop token or
    a stop string; ``stop_reason`` says which) or "length" (max_tokens or the
    context limit) or "abort", or "no_valid_token" (its sampling settings left
    no token to sample: ``allowed_token_ids``, ``bad_words``, ``min_tokens``
    and a structured output that exclude each other only as it runs).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step: its prompt and every output so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # first entry None (nothing precedes the first token), then one per token
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: dict = field(default_factory=dict)
    # set when the request failed on its own inside a step (finished, outputs "abort"); the others went on
    error: str | None = None
    # a pooling request's pooled final hidden states, once finished (pagedllm/pooling/)
    pooled: list[float] | None = None


@dataclass
class BeamSearchSequence:
    """One finished beam: ``tokens`` holds prompt and output ids, as in vLLM."""

    tokens: list[int]
    text: str
    cum_logprob: float
    score: float  # cum_logprob / generated_len ** length_penalty
    finish_reason: str

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[-self.num_output_tokens :] if self.num_output_tokens else []

    num_output_tokens: int = 0


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]
