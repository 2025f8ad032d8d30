"""A yes/no reranker's pooling requests bring back the LM head's logits of chosen ids at the last prompt token,
taken in the runner (``runner/pooled_rows.py``): the rows that ask share one LM-head call, a middle chunk
brings nothing, the others keep their hidden-state shares; the params refuse what they cannot mean."""

from __future__ import annotations

import pytest
import torch

from pagedllm.engine.inputs import logits_rules
from pagedllm.pooling.heads import yes_no_score
from pagedllm.pooling.params import PoolingSamplingParams, engine_params
from pagedllm.runner.pooled_rows import pooled_shares
from pagedllm.step_record import SamplingSpec, SequenceStep

GREEDY = SamplingSpec(0.0, 0, 1.0, 0.0, None)


def _step(num_computed: int, num_new: int, num_prompt: int, pooling: str, ids: tuple[int, ...] = ()) -> SequenceStep:
    return SequenceStep("r", num_computed, tuple(range(num_new)), (0,), GREEDY, num_prompt_tokens=num_prompt,
                        pooling=pooling, pooled_logit_ids=ids)


def test_logit_rows_share_one_head_call() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(11, 8)
    head = torch.randn(5, 8)
    calls = []

    def compute_logits(rows: torch.Tensor) -> torch.Tensor:
        calls.append(rows.shape[0])
        return rows @ head.T

    steps = [_step(0, 3, 3, "LAST", (4, 1)),   # rows 0-2: a whole prompt, logits of ids 4 and 1 at row 2
             _step(0, 4, 9, "LAST", (4, 1)),   # rows 3-6: a first chunk, nothing yet
             _step(0, 2, 2, "MEAN"),           # rows 7-8: hidden-state sum
             _step(5, 2, 7, "LAST", (2, 3))]   # rows 9-10: the last chunk, row 10
    shares = pooled_shares(hidden, steps, compute_logits)
    assert calls == [2]
    want = hidden @ head.T
    assert shares[0] == pytest.approx(want[2, [4, 1]].tolist(), abs=1e-6)
    assert shares[1] is None
    assert shares[2] == pytest.approx(hidden[7:9].sum(dim=0).tolist(), abs=1e-6)
    assert shares[3] == pytest.approx(want[10, [2, 3]].tolist(), abs=1e-6)
    # a tensor-parallel rank but 0 gets no logits back: its shares are None
    assert pooled_shares(hidden, steps[:1], lambda rows: None) == {0: None}


def test_params_refuse_what_they_cannot_mean() -> None:
    assert engine_params("LAST", None, (7, 9)).pooled_logit_ids == (7, 9)
    with pytest.raises(ValueError, match="LAST"):
        PoolingSamplingParams(pooling_type="MEAN", pooled_logit_ids=(1, 2), max_tokens=1)
    with pytest.raises(ValueError, match="pooled_logit_ids"):
        logits_rules(engine_params("LAST", None, (3, 100)), lambda w: [], [], 100)
    assert logits_rules(engine_params("LAST", None, (3, 99)), lambda w: [], [], 100) is None


def test_yes_no_score() -> None:
    no, yes = 0.3, 1.7
    assert yes_no_score(torch.tensor([no, yes])) == pytest.approx(1 / (1 + torch.exp(torch.tensor(no - yes)).item()))
    with pytest.raises(ValueError):
        yes_no_score(torch.zeros(3))
