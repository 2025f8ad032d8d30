"""Sampler on small hand-made logits.

Every expected token is derived here, by hand or from a plain-Python
reference (``math.exp``, explicit loops), never from the sampler's output.
The sampler draws the token at the inverse CDF of the given uniform ``u``:
token ``i`` (in the order the CDF is built) is picked when
``cdf[i-1] <= u * total < cdf[i]``.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedllm.runner.sampler import Sampler, SamplingTensors, logit_stats, token_logprobs

VOCAB = 6
# distinct probabilities (no ties) so that "sorted order" is unambiguous
PROBS = [0.05, 0.25, 0.35, 0.15, 0.02, 0.18]
# descending: 2 (0.35), 1 (0.25), 5 (0.18), 3 (0.15), 0 (0.05), 4 (0.02)
# cumulative in that order: 0.35, 0.60, 0.78, 0.93, 0.98, 1.00
ARGMAX = 2
LOGITS = [math.log(p) for p in PROBS]


def make_tensors(
    temperatures,
    uniforms,
    top_ks=None,
    top_ps=None,
    min_ps=None,
    vocab=VOCAB,
) -> SamplingTensors:
    """SamplingTensors the way the model runner builds them."""
    b = len(temperatures)
    top_ks = [vocab] * b if top_ks is None else [k if k > 0 else vocab for k in top_ks]
    top_ps = [1.0] * b if top_ps is None else top_ps
    min_ps = [0.0] * b if min_ps is None else min_ps
    return SamplingTensors(
        temperatures=torch.tensor(temperatures, dtype=torch.float32),
        top_ks=torch.tensor(top_ks, dtype=torch.int64),
        top_ps=torch.tensor(top_ps, dtype=torch.float32),
        min_ps=torch.tensor(min_ps, dtype=torch.float32),
        uniforms=torch.tensor(uniforms, dtype=torch.float64),
        any_random=any(t > 0 for t in temperatures),
    )


def sample(logits_rows, **kwargs) -> list[int]:
    logits = torch.tensor(logits_rows, dtype=torch.float32)
    return Sampler()(logits, make_tensors(**kwargs)).tolist()


def reference_distribution(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> list[float]:
    """vLLM's semantics in plain Python: temperature, top-k, top-p, min-p, renormalise."""
    scaled = [x / temperature for x in logits]
    m = max(scaled)
    weights = [math.exp(x - m) for x in scaled]
    total = sum(weights)
    probs = [w / total for w in weights]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep = set(order[:top_k] if top_k > 0 else order)
    # top-p on the distribution left after top-k
    kept_total = sum(probs[i] for i in keep)
    mass = 0.0
    nucleus = set()
    for i in order:
        if i not in keep:
            continue
        nucleus.add(i)
        mass += probs[i] / kept_total
        if mass >= top_p:
            break
    keep &= nucleus
    biggest = max(probs[i] for i in keep)
    keep = {i for i in keep if probs[i] >= min_p * biggest}
    total = sum(probs[i] for i in keep)
    return [probs[i] / total if i in keep else 0.0 for i in range(len(probs))]


# --- greedy ----------------------------------------------------------------


def test_greedy_rows_take_the_argmax():
    rows = [
        LOGITS,
        [0.0, 0.0, 0.0, 0.0, 0.0, 5.0],
        [9.0, -1.0, 3.0, 8.9, 0.0, 0.0],
        [-5.0, -4.0, -3.0, -2.0, -1.5, -1.6],
    ]
    # the uniforms of greedy rows must not matter
    got = sample(rows, temperatures=[0.0] * 4, uniforms=[0.99, 0.0, 0.5, 0.7])
    assert got == [2, 5, 0, 4]


def test_sampler_returns_int64_tokens_one_per_row():
    logits = torch.tensor([LOGITS, LOGITS, LOGITS], dtype=torch.float32)
    out = Sampler()(logits, make_tensors(temperatures=[0.0, 1.0, 0.5], uniforms=[0.0, 0.3, 0.9]))
    assert out.dtype == torch.int64
    assert out.shape == (3,)


# --- inverse CDF -------------------------------------------------------------

# cumulative in vocab order: 0.05, 0.30, 0.65, 0.80, 0.82, 1.00
@pytest.mark.parametrize(
    "u, token",
    [
        (0.0, 0),
        (0.01, 0),
        (0.049, 0),
        (0.051, 1),
        (0.29, 1),
        (0.31, 2),
        (0.64, 2),
        (0.66, 3),
        (0.79, 3),
        (0.81, 4),
        (0.821, 5),
        (0.999999, 5),
    ],
)
def test_inverse_cdf_picks_the_hand_computed_token(u, token):
    assert sample([LOGITS], temperatures=[1.0], uniforms=[u]) == [token]


def test_inverse_cdf_many_rows_at_once():
    us = [0.01, 0.2, 0.5, 0.7, 0.815, 0.9]
    assert sample([LOGITS] * 6, temperatures=[1.0] * 6, uniforms=us) == [0, 1, 2, 3, 4, 5]


# --- top-k ----------------------------------------------------------------------


@pytest.mark.parametrize("u", [0.0, 0.1, 0.5, 0.9, 0.999999])
def test_top_k_1_always_returns_the_argmax(u):
    assert sample([LOGITS], temperatures=[1.0], uniforms=[u], top_ks=[1]) == [ARGMAX]
    # even at a high temperature that makes the distribution almost flat
    assert sample([LOGITS], temperatures=[50.0], uniforms=[u], top_ks=[1]) == [ARGMAX]


def test_top_k_2_keeps_only_the_two_most_likely():
    # kept: 2 (0.35) and 1 (0.25), renormalised: 2 -> 0.5833, 1 -> 0.4167 (sorted order)
    assert sample([LOGITS], temperatures=[1.0], uniforms=[0.58], top_ks=[2]) == [2]
    assert sample([LOGITS], temperatures=[1.0], uniforms=[0.59], top_ks=[2]) == [1]
    assert sample([LOGITS], temperatures=[1.0], uniforms=[0.999999], top_ks=[2]) == [1]
    for u in [i / 200 for i in range(200)]:
        assert sample([LOGITS], temperatures=[1.0], uniforms=[u], top_ks=[2])[0] in (1, 2)


def test_top_k_of_vocab_size_is_no_filter():
    # top_k disabled (0) beside a row with top_k=1: the first row keeps the
    # whole vocabulary, walked in vocabulary order whatever its neighbour does
    got = sample(
        [LOGITS, LOGITS], temperatures=[1.0, 1.0], uniforms=[0.999999, 0.999999], top_ks=[0, 1]
    )
    # vocabulary-order CDF ends on the last token, 5 (p=0.18)
    assert got == [5, ARGMAX]


# --- top-p ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "top_p, allowed",
    [
        (0.3, [2]),  # 0.35 already reaches 0.3
        (0.5, [2, 1]),  # 0.35 < 0.5 <= 0.60
        (0.7, [2, 1, 5]),  # 0.60 < 0.7 <= 0.78
        (0.9, [2, 1, 5, 3]),  # 0.78 < 0.9 <= 0.93
        (0.95, [2, 1, 5, 3, 0]),  # 0.93 < 0.95 <= 0.98
        (0.99, [2, 1, 5, 3, 0, 4]),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_top_p(top_p, allowed):
    last = allowed[-1]
    # a uniform close to 1 lands on the least likely token still allowed
    assert sample([LOGITS], temperatures=[1.0], uniforms=[0.999999], top_ps=[top_p]) == [last]
    # u = 0 lands on the most likely one
    assert sample([LOGITS], temperatures=[1.0], uniforms=[0.0], top_ps=[top_p]) == [ARGMAX]
    # no uniform ever reaches a token outside the nucleus
    us = [i / 500 for i in range(500)] + [1 - 1e-12]
    got = sample([LOGITS] * len(us), temperatures=[1.0] * len(us), uniforms=us, top_ps=[top_p] * len(us))
    assert set(got) == set(allowed)


def test_top_p_renormalises_inside_the_nucleus():
    # top_p = 0.5 keeps 2 (0.35) and 1 (0.25): renormalised 0.35/0.60 = 0.5833
    assert sample([LOGITS], temperatures=[1.0], uniforms=[0.58], top_ps=[0.5]) == [2]
    assert sample([LOGITS], temperatures=[1.0], uniforms=[0.59], top_ps=[0.5]) == [1]


def test_top_p_always_keeps_the_most_likely_token():
    # the top token alone has 0.35 < top_p for tiny top_p too
    assert sample([LOGITS], temperatures=[1.0], uniforms=[0.999999], top_ps=[1e-6]) == [ARGMAX]


def test_top_k_then_top_p():
    # top_k=3 keeps 2, 1, 5 (mass 0.78), renormalised 0.4487, 0.3205, 0.2308;
    # top_p=0.7: 0.4487 < 0.7 <= 0.7692, so 2 and 1 stay
    got = sample([LOGITS], temperatures=[1.0], uniforms=[0.999999], top_ks=[3], top_ps=[0.7])
    assert got == [1]
    expected = reference_distribution(LOGITS, top_k=3, top_p=0.7)
    assert [i for i, p in enumerate(expected) if p > 0] == [1, 2]


# --- min-p ----------------------------------------------------------------------


def test_min_p_drops_tokens_below_min_p_times_the_max():
    # threshold 0.5 * 0.35 = 0.175: keep 1 (0.25), 2 (0.35), 5 (0.18)
    # renormalised in vocab order: cdf 0, 0.25/0.78, 0.60/0.78, same, same, 1
    kept = {1, 2, 5}
    assert sample([LOGITS], temperatures=[1.0], uniforms=[0.0], min_ps=[0.5]) == [1]
    assert sample([LOGITS], temperatures=[1.0], uniforms=[0.3], min_ps=[0.5]) == [1]  # 0.3 < 0.3205
    assert sample([LOGITS], temperatures=[1.0], uniforms=[0.33], min_ps=[0.5]) == [2]
    assert sample([LOGITS], temperatures=[1.0], uniforms=[0.76], min_ps=[0.5]) == [2]  # < 0.7692
    assert sample([LOGITS], temperatures=[1.0], uniforms=[0.78], min_ps=[0.5]) == [5]
    assert sample([LOGITS], temperatures=[1.0], uniforms=[0.999999], min_ps=[0.5]) == [5]
    us = [i / 500 for i in range(500)] + [1 - 1e-12]
    got = sample([LOGITS] * len(us), temperatures=[1.0] * len(us), uniforms=us, min_ps=[0.5] * len(us))
    assert set(got) == kept


def test_min_p_one_keeps_only_the_argmax():
    for u in (0.0, 0.5, 0.999999):
        assert sample([LOGITS], temperatures=[1.0], uniforms=[u], min_ps=[1.0]) == [ARGMAX]


# --- temperature --------------------------------------------------------------


def test_temperature_scales_logits_before_softmax():
    # u = 0.7. At T=1 the vocab-order cdf is 0.05, 0.30, 0.65, 0.80, ... -> token 3.
    # At T=0.5, probs ~ p^2 / sum = 0.0103, 0.2574, 0.5045, 0.0927, 0.0016, 0.1334,
    # cdf 0.0103, 0.2677, 0.7722, ... -> token 2.
    # At T=2, probs ~ sqrt(p) / sum: cdf 0.0986, 0.3190, 0.5798, 0.7506 -> token 3 at 0.7,
    # and at u = 0.6 (T=1: token 2) token 3.
    assert sample([LOGITS], temperatures=[1.0], uniforms=[0.7]) == [3]
    assert sample([LOGITS], temperatures=[0.5], uniforms=[0.7]) == [2]
    assert sample([LOGITS], temperatures=[1.0], uniforms=[0.6]) == [2]
    assert sample([LOGITS], temperatures=[2.0], uniforms=[0.6]) == [3]


def test_tiny_temperature_is_almost_greedy():
    for u in (0.0, 0.3, 0.7, 0.999999):
        assert sample([LOGITS], temperatures=[1e-3], uniforms=[u]) == [ARGMAX]


# --- against the reference -------------------------------------------------------


def expected_token(dist: list[float], u: float, sorted_order: bool) -> int:
    order = sorted(range(len(dist)), key=lambda i: -dist[i]) if sorted_order else range(len(dist))
    cum = 0.0
    last = None
    for i in order:
        if dist[i] == 0:
            continue
        cum += dist[i]
        last = i
        if u < cum:
            return i
    return last


def test_random_settings_match_the_reference():
    rng = random.Random(1234)
    checked = 0
    for _ in range(300):
        logits = [rng.uniform(-3, 3) for _ in range(VOCAB)]
        t = rng.choice([0.3, 0.7, 1.0, 1.5])
        k = rng.choice([0, 1, 2, 4])
        p = rng.choice([1.0, 0.5, 0.8, 0.95])
        m = rng.choice([0.0, 0.0, 0.1, 0.3])
        u = rng.random()
        dist = reference_distribution(logits, t, k, p, m)
        # skip draws that sit within float noise of a CDF boundary
        order = sorted(range(VOCAB), key=lambda i: -dist[i])
        sorted_path = k > 0 or p < 1.0
        cums, c = [], 0.0
        for i in order if sorted_path else range(VOCAB):
            c += dist[i]
            cums.append(c)
        if any(abs(u - c) < 1e-4 for c in cums):
            continue
        got = sample([logits], temperatures=[t], uniforms=[u], top_ks=[k], top_ps=[p], min_ps=[m])
        assert got == [expected_token(dist, u, sorted_path)], (logits, t, k, p, m, u)
        checked += 1
    assert checked > 250


# --- statistics -----------------------------------------------------------------


def frequency_check(dist: list[float], counts: list[int], n: int) -> None:
    # each count is Binomial(n, p): mean n*p, sd sqrt(n*p*(1-p)). A 5 sd band
    # fails a correct sampler with probability < 6e-7 per token (normal tail),
    # and the uniforms are seeded anyway. With n = 20000 the band is at most
    # 5 * sqrt(20000 * 0.25) = 354 counts, i.e. 1.8 percentage points, so a
    # sampler off by a few points on any token fails.
    for i, p in enumerate(dist):
        if p == 0:
            assert counts[i] == 0, (i, counts)
            continue
        sd = math.sqrt(n * p * (1 - p))
        assert abs(counts[i] - n * p) <= 5 * sd, (i, counts[i], n * p, sd)


@pytest.mark.parametrize(
    "settings",
    [
        dict(),
        dict(temperature=0.5),
        dict(temperature=2.0),
        dict(top_k=3),
        dict(top_p=0.7),
        dict(min_p=0.3),
        dict(temperature=1.3, top_k=4, top_p=0.9),
    ],
)
def test_20000_draws_reproduce_the_distribution(settings):
    n = 20000
    gen = torch.Generator().manual_seed(7)
    uniforms = torch.rand(n, generator=gen, dtype=torch.float64).tolist()
    t = settings.get("temperature", 1.0)
    k = settings.get("top_k", 0)
    p = settings.get("top_p", 1.0)
    m = settings.get("min_p", 0.0)
    got = sample(
        [LOGITS] * n,
        temperatures=[t] * n,
        uniforms=uniforms,
        top_ks=[k] * n,
        top_ps=[p] * n,
        min_ps=[m] * n,
    )
    counts = [0] * VOCAB
    for tok in got:
        counts[tok] += 1
    dist = reference_distribution(LOGITS, t, k, p, m)
    if not settings:
        assert dist == pytest.approx(PROBS)
    frequency_check(dist, counts, n)


# --- batches -----------------------------------------------------------------------


def test_mixed_greedy_and_random_rows_in_one_batch():
    other = [1.0, 4.0, 0.5, 3.9, -2.0, 0.0]  # argmax 1
    rows = [LOGITS, LOGITS, other, LOGITS, other, LOGITS]
    temps = [0.0, 1.0, 0.0, 0.5, 1.0, 0.0]
    us = [0.999999, 0.7, 0.0, 0.7, 0.0, 0.5]
    got = sample(rows, temperatures=temps, uniforms=us)
    # row 0: greedy -> 2 (its uniform is ignored); row 1: T=1, u=0.7 -> 3 (see
    # the temperature test); row 2: greedy -> 1; row 3: T=0.5, u=0.7 -> 2;
    # row 4: `other` at T=1 has vocab-order cdf 0.0248, 0.5234, ...: u=0 -> 0;
    # row 5: greedy -> 2
    assert got == [2, 3, 1, 2, 0, 2]
    for i in range(len(rows)):
        assert sample([rows[i]], temperatures=[temps[i]], uniforms=[us[i]]) == [got[i]]


def test_mixed_greedy_and_filtered_rows_in_one_batch():
    other = [1.0, 4.0, 0.5, 3.9, -2.0, 0.0]  # argmax 1
    rows = [LOGITS, other, other, LOGITS, LOGITS]
    temps = [0.0, 0.0, 1.0, 1.0, 1.0]
    us = [0.999999, 0.999999, 0.999999, 0.2, 0.999999]
    got = sample(
        rows, temperatures=temps, uniforms=us, top_ks=[1, 0, 0, 2, 0], top_ps=[0.1, 1.0, 0.4, 1.0, 0.7]
    )
    # greedy rows ignore top-k/top-p and uniforms: 2 and 1;
    # row 2: `other` at T=1 is 1 (0.4986), 3 (0.4511), ...: top_p 0.4 keeps only 1;
    # row 3: top_k=2 keeps 2 then 1 (0.5833 / 0.4167 in sorted order), u=0.2 -> 2;
    # row 4: top_p 0.7 keeps 2, 1, 5: u close to 1 -> 5
    assert got == [2, 1, 1, 2, 5]


def test_a_rows_token_does_not_depend_on_the_other_rows():
    # alone: vocab-order cdf 0.05, 0.30, 0.65, 0.80 -> u = 0.7 picks 3
    assert sample([LOGITS], temperatures=[1.0], uniforms=[0.7]) == [3]
    # the same row next to a row that uses top_p must still pick 3
    got = sample([LOGITS, LOGITS], temperatures=[1.0, 1.0], uniforms=[0.7, 0.7], top_ps=[1.0, 0.5])
    assert got[0] == 3


def test_all_greedy_batch_with_sort_settings_is_argmax():
    rows = [LOGITS, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]
    got = sample(rows, temperatures=[0.0, 0.0], uniforms=[0.5, 0.5], top_ks=[2, 0], top_ps=[0.5, 0.1])
    assert got == [2, 5]


def test_sampler_does_not_modify_the_logits():
    logits = torch.tensor([LOGITS, LOGITS], dtype=torch.float32)
    before = logits.clone()
    Sampler()(logits, make_tensors(temperatures=[0.5, 1.0], uniforms=[0.3, 0.9], top_ks=[2, 0], top_ps=[1.0, 0.7]))
    assert torch.equal(logits, before)


def test_token_logprobs_rank_and_top_only_when_asked():
    """Rows that asked for logprobs get rank and top-k; the others their token's logprob only."""
    logits = torch.tensor([[2.0, 0.5, 1.0, -1.0], [0.1, 0.2, 3.0, 0.0], [1.0, 1.0, 0.0, 5.0]])
    tokens = torch.tensor([2, 2, 0])
    out = token_logprobs(logits, tokens, [None, 2, 0])
    # independent of the implementation: log p = logit - log(sum(exp(logits)))
    for row, t in enumerate(out):
        want = logits[row, tokens[row]].item() - math.log(sum(math.exp(v) for v in logits[row].tolist()))
        assert t.logprob == pytest.approx(want, abs=1e-6)
        assert t.token_id == tokens[row].item()
    assert out[0].rank is None and out[0].top == ()
    # row 1: token 2 is the most likely; top 2 are tokens 2 then 1
    assert out[1].rank == 1
    assert [tid for tid, _ in out[1].top] == [2, 1]
    assert out[1].top[0][1] == pytest.approx(out[1].logprob, abs=1e-6)
    # row 2: token 0 ties with token 1 behind token 3, so rank 2; no alternatives asked
    assert out[2].rank == 2 and out[2].top == ()


# --- logit_stats: the native argmax + logsumexp ---------------------------------
@pytest.mark.parametrize(("rows", "vocab"), [(1, 7), (3, 8), (5, 49152), (40, 1003), (2, 17)])
def test_logit_stats_match_torch(rows: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    stats = logit_stats(logits)
    assert stats.argmax.tolist() == logits.argmax(dim=-1).tolist()
    torch.testing.assert_close(stats.lse, torch.logsumexp(logits, dim=-1), rtol=1e-6, atol=1e-5)


def test_logit_stats_ties_masks_and_nan_follow_torch() -> None:
    logits = torch.randn(5, 43)  # 43: vector lanes for 0..39 (40 with AVX2 x 8), a scalar tail after
    # ties: the first index wins, across lanes and between the lanes and the tail
    logits[0, :] = 0.0
    logits[0, [11, 3, 37]] = 5.0  # 3 and 11 share a lane (AVX2 and AVX-512 alike)
    logits[1, :] = 0.0
    logits[1, [41, 33]] = 2.0
    logits[2, :] = float("-inf")  # every token masked
    logits[3, ::2] = float("-inf")  # half masked
    logits[4, 11] = float("nan")  # a broken row: torch ranks NaN first
    stats = logit_stats(logits)
    want_lse = torch.logsumexp(logits, dim=-1)
    assert stats.argmax.tolist() == logits.argmax(dim=-1).tolist() == [3, 33, 0, stats.argmax[3].item(), 11]
    torch.testing.assert_close(stats.lse[[0, 1, 3]], want_lse[[0, 1, 3]])
    assert stats.lse[2].item() == float("-inf") == want_lse[2].item()
    assert torch.isnan(stats.lse[4]) and torch.isnan(want_lse[4])


def test_logit_stats_nan_among_masked_logits_follows_torch() -> None:
    logits = torch.full((2, 21), float("-inf"))
    logits[0, 5] = float("nan")  # nothing finite: the NaN must not hide behind the -inf max
    logits[1, 3] = 1.0
    stats = logit_stats(logits)
    assert stats.argmax.tolist() == logits.argmax(dim=-1).tolist() == [5, 3]
    assert torch.isnan(stats.lse[0]) and stats.lse[1].item() == pytest.approx(1.0)
