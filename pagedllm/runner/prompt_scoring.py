"""Prompt logprobs a few rows at a time.

A step that scores prompt tokens (``SamplingParams.prompt_logprobs``, or
``echo`` with ``logprobs`` on the server) needs, for each scored token, the
log-probability of the next prompt token, its rank and the top candidates:
a reduction over a full-vocabulary row of logits. The LM head and those
reductions run on at most ``PROMPT_LOGITS_ROWS`` rows at a time and keep
only their results, so a chunk never holds more than that many rows of
logits (``PROMPT_LOGITS_ROWS x vocab`` float32: 25 MB at 49,152), where one
pass over a 6k-token prompt held ~1.2 GB (issue 53). Each row's values do
not depend on which rows share its pass: the reductions are per row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from pagedllm.runner.sampler import token_logprobs
from pagedllm.step_result import TokenLogprobs

# rows of logits one pass computes and reduces
PROMPT_LOGITS_ROWS = 128


@dataclass
class ScoredPrompt:
    """One sequence's scored prompt tokens in this step, or the error that scoring them raised."""

    logprobs: list[TokenLogprobs] = field(default_factory=list)
    error: Exception | None = None


def score_prompt_rows(
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
    hidden: torch.Tensor,
    targets: Sequence[int],
    num_top: int,
) -> ScoredPrompt:
    """Logprobs, ranks and top ``num_top`` of ``targets[j]`` under the logits of ``hidden[j]``.

    ``hidden`` ``[len(targets), hidden_size]``: the final hidden states of the
    positions before the targets. ``compute_logits`` is the model's LM head
    (``None`` on tensor-parallel ranks but 0): every rank calls it for the same
    passes in the same order, whatever fails, since each call gathers across
    ranks. An error of the reductions (this sequence's own) is returned in
    ``ScoredPrompt.error``; one of the LM head propagates (the step's).
    """
    if hidden.shape[0] != len(targets):
        raise ValueError(f"{hidden.shape[0]} hidden rows for {len(targets)} scored tokens")
    scored = ScoredPrompt()
    for start in range(0, len(targets), PROMPT_LOGITS_ROWS):
        stop = min(start + PROMPT_LOGITS_ROWS, len(targets))
        logits = compute_logits(hidden[start:stop])  # [rows, vocab]
        if logits is None or scored.error is not None:
            continue  # a rank but 0 (it took its part in the gather), or this sequence already failed
        try:
            ids = torch.tensor(targets[start:stop], dtype=torch.int64)
            scored.logprobs += token_logprobs(logits.cpu(), ids, [num_top] * len(ids))
        except Exception as e:  # this sequence's alone: the others keep theirs
            scored.error = e
    return scored
