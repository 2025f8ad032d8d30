"""Rejection sampling of n-gram drafts preserves the model's distribution (a chi-square test), greedy is exact.

With fixed logit rows p_0..p_k (row j: the distribution after the j-th
verified position, the drafts so far being the context), sampling one token
at a time from p_j and stopping at the first token that differs from the
draft gives each emitted prefix ``e`` the probability

    prod_{j < len(e) - 1} p_j(d_j)  *  p_{len(e)-1}(e_last)

and ``verify_drafts`` must emit prefixes with exactly these probabilities.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from pagedllm.runner.draft_verifier import sampling_probs, verify_drafts
from pagedllm.step_record import SamplingSpec

V = 6
TRIALS = 12_000


def expected(probs: torch.Tensor, drafts: list[int]) -> dict[tuple[int, ...], float]:
    """Each emitted prefix's probability under one-token-at-a-time sampling from the rows ``probs``."""
    out: dict[tuple[int, ...], float] = {}
    reach = 1.0
    for j in range(len(drafts) + 1):
        for t in range(V):
            if j < len(drafts) and t == drafts[j]:
                continue
            out[(*drafts[:j], t)] = reach * float(probs[j, t])
        if j < len(drafts):
            reach *= float(probs[j, drafts[j]])
    return out


@pytest.mark.parametrize(
    "spec",
    [
        SamplingSpec(1.0, 0, 1.0, 0.0, None),
        SamplingSpec(1.5, 4, 0.95, 0.0, None),  # top-k and top-p cut the tail: p is what the sampler draws from
    ],
    ids=["plain", "top_k_top_p"],
)
@pytest.mark.parametrize("drafts", [[2], [2, 5]], ids=["k1", "k2"])
def test_emitted_tokens_follow_the_target_distribution(spec, drafts):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(len(drafts) + 1, V, generator=gen)
    logits[0, drafts[0]] += 1.0  # a draft likely enough to be accepted often, not always
    probs = sampling_probs(logits, spec)
    want = expected(probs, drafts)
    rng = random.Random(11)
    got = Counter(
        tuple(verify_drafts(logits, drafts, spec, tuple(rng.random() for _ in range(len(drafts) + 1))))
        for _ in range(TRIALS)
    )
    assert set(got) <= {e for e, p in want.items() if p > 0}, "emitted a prefix of probability 0"
    assert prefix_pvalue(got, want) > 1e-3


def prefix_pvalue(got: Counter, want: dict[tuple[int, ...], float]) -> float:
    """The chi-square p-value of the emitted prefixes ``got`` against their probabilities ``want``."""
    trials = sum(got.values())
    cats = [e for e, p in want.items() if p * trials >= 5]  # chi-square's rule of thumb; the rest pooled
    observed = [got[e] for e in cats]
    exp = [want[e] * trials for e in cats]
    rest_observed, rest_expected = trials - sum(observed), trials - sum(exp)
    if rest_expected >= 5:
        observed.append(rest_observed)
        exp.append(rest_expected)
    elif rest_observed > 20:
        return 0.0  # rare prefixes came out far more often than their probability
    total = sum(observed)
    exp = [x * total / sum(exp) for x in exp]  # the same total, as chisquare requires
    return float(chisquare(observed, exp).pvalue)


def test_the_threshold_fails_a_wrong_acceptance_rule():
    """The test above can fail: the classic mistake, resampling a rejected position from p itself instead of
    the residual max(p - q, 0) (the draft removed), gives the draft token twice its chances, and the same
    threshold rejects it."""
    drafts = [2, 5]
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(len(drafts) + 1, V, generator=gen)
    logits[0, drafts[0]] += 1.0
    probs = sampling_probs(logits, SamplingSpec(1.0, 0, 1.0, 0.0, None))
    rng = random.Random(11)

    def wrong_verify() -> list[int]:
        out: list[int] = []
        for j, d in enumerate(drafts):
            if rng.random() < float(probs[j, d]):
                out.append(d)
                continue
            return [*out, rng.choices(range(V), weights=probs[j].tolist())[0]]  # should exclude d
        return [*out, rng.choices(range(V), weights=probs[len(drafts)].tolist())[0]]

    got = Counter(tuple(wrong_verify()) for _ in range(TRIALS))
    assert prefix_pvalue(got, expected(probs, drafts)) < 1e-3


def test_sampling_probs_match_the_samplers_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    p = sampling_probs(logits, SamplingSpec(1.0, 2, 1.0, 0.0, None))[0]
    top2 = torch.softmax(torch.tensor([2.0, 1.0]), dim=0).double()
    assert torch.allclose(p[:2], top2) and float(p[2:].sum()) == 0.0
    p = sampling_probs(logits, SamplingSpec(1.0, 0, 1.0, 0.3, None))[0]  # min_p: >= 0.3 of the top (e^-1 = 0.37 is)
    assert [i for i in range(V) if p[i] > 0] == [0, 1]


def test_greedy_accepts_while_the_draft_is_the_argmax():
    logits = torch.zeros(4, V)
    logits[0, 3] = logits[1, 1] = logits[2, 5] = logits[3, 0] = 5.0
    spec = SamplingSpec(0.0, 0, 1.0, 0.0, None)
    u = (0.0,) * 4
    assert verify_drafts(logits, [3, 1, 5], spec, u) == [3, 1, 5, 0]  # all accepted, the bonus token
    assert verify_drafts(logits, [3, 2, 5], spec, u) == [3, 1]  # the second differs: the argmax instead
    assert verify_drafts(logits, [0, 1, 5], spec, u) == [3]


def test_a_certain_draft_is_always_accepted_and_an_impossible_one_never():
    logits = torch.full((2, V), -1e9)
    logits[0, 2] = 0.0  # p_0 is one-hot on 2
    logits[1] = 0.0
    spec = SamplingSpec(1.0, 0, 1.0, 0.0, None)
    rng = random.Random(3)
    for _ in range(50):
        u = (rng.random(), rng.random())
        assert verify_drafts(logits, [2], spec, u)[0] == 2
        assert verify_drafts(logits, [4], spec, u) == [2]


def _verify(logits: torch.Tensor, drafts: list[int], spec: SamplingSpec, outputs: tuple, masks: tuple = ()) -> list[int]:
    """The runner's verify of one sequence (``ModelRunner._verify_step``) over synthetic logits."""
    from pagedllm.runner.model_runner import ModelRunner
    from pagedllm.step_record import SequenceStep
    from pagedllm.step_result import StepResult

    step = SequenceStep("r", 5, (9, *drafts), (0,), spec, (0.0,) * (len(drafts) + 1),
                        output_token_ids=outputs, token_bitmasks=masks, num_draft_tokens=len(drafts))
    result = StepResult()
    ModelRunner._verify_step(object.__new__(ModelRunner), logits.clone(), step, result)
    assert result.error is None, result.error
    return [s.token_id for s in result.samples]


def test_verify_applies_penalties_per_row_with_the_drafts_before_it():
    """Drafts 3, 3. Row 0 prefers 3 (1.0 over 0.5): no 3 in the output yet, accepted. Row 1 prefers 3 by 0.7,
    but with draft 0 counted a frequency penalty of 1.0 makes 5 win: plain decoding emits 3, 5. Counting
    both drafts in row 0 would reject at once; skipping the penalty would accept both."""
    from pagedllm.step_record import LogitsRules

    logits = torch.full((3, 12), -5.0)
    logits[0, 3], logits[0, 5] = 1.0, 0.5
    logits[1, 3], logits[1, 5] = 1.2, 0.5
    logits[2, 3], logits[2, 6] = 1.0, 0.9
    spec = SamplingSpec(0.0, 0, 1.0, 0.0, None, LogitsRules(frequency_penalty=1.0))
    assert _verify(logits, [3, 3], spec, ((9,), (9, 3), (9, 3, 3))) == [3, 5]
    assert _verify(logits, [3, 3], SamplingSpec(0.0, 0, 1.0, 0.0, None), ()) == [3, 3, 3]


def test_verify_applies_each_rows_grammar_mask():
    """Row j's structured-output mask forbids what plain decoding's grammar would: draft 1 (token 4) is
    masked out of row 1, so the step emits draft 0 and row 1's best allowed token."""
    import numpy as np

    logits = torch.full((3, 40), -5.0)
    logits[0, 2] = logits[1, 4] = logits[2, 7] = 1.0
    logits[1, 33] = 0.5

    def mask(*allowed: int) -> bytes:
        words = np.zeros(2, dtype=np.int32)
        for t in allowed:
            words[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
        return words.tobytes()

    greedy = SamplingSpec(0.0, 0, 1.0, 0.0, 1)
    assert _verify(logits, [2, 4], greedy, (), (b"", mask(33, 5), b"")) == [2, 33]
    assert _verify(logits, [2, 4], greedy, (), (b"", b"", b"")) == [2, 4, 7]
