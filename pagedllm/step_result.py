"""What the runner hands back for one step: plain data, read by the engine (the reply to ``step_record``).

The engine imports this module, never the runner, for the shape of a
step's results; a tensor-parallel worker's rank 0 returns the same objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprobs:
    """A chosen token with its log-probability, its rank (1 = most likely) and the top alternatives."""

    token_id: int
    logprob: float
    rank: int | None  # None when the request did not ask for logprobs (not computed)
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), most likely first


@dataclass
class StepResult:
    """What one step produced for one scheduled sequence."""

    samples: list[TokenLogprobs] = field(default_factory=list)  # [seq, *forks] when it sampled
    prompt_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs_start: int = 1  # the prompt position of prompt_logprobs[0]
    # set when this sequence alone failed (its sampling settings); the step's other results stand
    error: Exception | None = None
    # a pooling prefill's share (runner/pooled_rows.py): the final hidden state of its last prompt token
    # ("LAST"), its first ("CLS"), or the sum over this step's tokens ("MEAN"); None when the step has none
    pooled: list[float] | None = None
    pooled_start: int = 0  # the first prompt position this step ran (a MEAN sum starts again at 0)
