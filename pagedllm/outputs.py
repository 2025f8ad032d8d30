"""What ``generate`` and ``LLMEngine.step`` return, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One of a request's ``n`` outputs.

    ``finish_reason`` is None while running, then "stop" (EOS, a stop token or
    a stop string; ``stop_reason`` says which) or "length" (max_tokens or the
    context limit) or "abort".
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list | None = None
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
    prompt_logprobs: list | None = None
    metrics: dict = field(default_factory=dict)
