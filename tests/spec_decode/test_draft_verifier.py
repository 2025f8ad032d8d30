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
    cats = [e for e, p in want.items() if p * TRIALS >= 5]  # chi-square's rule of thumb; the rest pooled
    observed = [got[e] for e in cats]
    exp = [want[e] * TRIALS for e in cats]
    rest_observed, rest_expected = TRIALS - sum(observed), TRIALS - sum(exp)
    if rest_expected >= 5:
        observed.append(rest_observed)
        exp.append(rest_expected)
    else:
        assert rest_observed <= 20, "rare prefixes came out far more often than their probability"
    total = sum(observed)
    exp = [x * total / sum(exp) for x in exp]  # the same total, as chisquare requires
    assert chisquare(observed, exp).pvalue > 1e-3


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
