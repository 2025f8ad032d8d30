"""``runner/prompt_scoring.py``: prompt logprobs a few rows of logits at a time.

The expected values come from ``token_logprobs`` over the whole logits at once
(the runner's computation before issue 53): each row's reductions are its own,
so the passes must give the same bits. The LM head is a lookup of fixed logits
(or a random linear map where only the calls matter).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pagedllm.runner.prompt_scoring import PROMPT_LOGITS_ROWS, score_prompt_rows
from pagedllm.runner.sampler import token_logprobs

VOCAB = 1000
HIDDEN = 16


def _weight() -> torch.Tensor:
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))


def _head() -> tuple[Callable[[torch.Tensor], torch.Tensor], list[torch.Tensor]]:
    """A random LM head, and the hidden rows of each call to it."""
    weight = _weight()
    calls: list[torch.Tensor] = []

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        calls.append(hidden)
        return hidden @ weight.T

    return compute_logits, calls


def test_passes_give_the_whole_logits_bits() -> None:
    num_rows = 2 * PROMPT_LOGITS_ROWS + 17
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(num_rows, VOCAB, generator=gen) * 4
    targets = torch.randint(0, VOCAB, (num_rows,), generator=gen).tolist()
    calls: list[int] = []

    def lookup(hidden: torch.Tensor) -> torch.Tensor:
        # "hidden" row r holds r: the head returns the fixed logits of those rows, whatever the pass
        calls.append(hidden.shape[0])
        return logits[hidden[:, 0].long()]

    hidden = torch.arange(num_rows, dtype=torch.float32).unsqueeze(1)
    got = score_prompt_rows(lookup, hidden, targets, 5)
    assert got.error is None
    assert calls == [PROMPT_LOGITS_ROWS, PROMPT_LOGITS_ROWS, 17]
    assert got.logprobs == token_logprobs(logits, torch.tensor(targets), [5] * num_rows)


def test_a_failing_pass_still_runs_every_lm_head_pass() -> None:
    # a target past the vocabulary fails the reductions of the first pass; the LM head is still called
    # for every pass (under tensor parallelism each call is a collective every rank makes)
    num_rows = PROMPT_LOGITS_ROWS + 3
    hidden = torch.randn(num_rows, HIDDEN)
    targets = [VOCAB + 5] + [1] * (num_rows - 1)
    compute_logits, calls = _head()
    got = score_prompt_rows(compute_logits, hidden, targets, 2)
    assert got.error is not None and len(calls) == 2


def test_a_rank_without_logits_gets_nothing_and_no_error() -> None:
    calls: list[int] = []

    def gathered_elsewhere(hidden: torch.Tensor) -> None:
        calls.append(hidden.shape[0])

    num_rows = PROMPT_LOGITS_ROWS + 1
    got = score_prompt_rows(gathered_elsewhere, torch.zeros(num_rows, HIDDEN), [0] * num_rows, 1)
    assert got.logprobs == [] and got.error is None and calls == [PROMPT_LOGITS_ROWS, 1]


def test_rows_and_targets_must_match() -> None:
    compute_logits, _ = _head()
    with pytest.raises(ValueError, match="hidden rows"):
        score_prompt_rows(compute_logits, torch.zeros(3, HIDDEN), [1, 2], 1)
