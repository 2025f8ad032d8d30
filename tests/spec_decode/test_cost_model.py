"""The speculation cost model: step times fitted from timings, and the number of drafts that pays."""

from __future__ import annotations

import random

import pytest

from pagedllm.engine.sequence import Sequence
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.cost_model import (
    AcceptanceEstimate,
    best_num_drafts,
    expected_extra_tokens,
)
from pagedllm.spec_decode.speculator import PROBE_EVERY, Speculator
from pagedllm.step_time import StepTimeModel

MS = 1e-3


def machine(a: float, b: float, delta: float, c: float):
    """A synthetic machine: a step of B decodes and K drafts takes a + b B (+ delta + c K if K)."""
    return lambda num_decodes, num_drafts: a + b * num_decodes + ((delta + c * num_drafts) if num_drafts else 0.0)


def fitted(step_time, shapes) -> StepTimeModel:
    times = StepTimeModel()
    for num_decodes, num_drafts in shapes:
        times.observe(num_decodes, num_drafts, 0, step_time(num_decodes, num_drafts))
    return times


def varied_shapes(seed: int = 0, n: int = 200) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(1, 64), rng.choice([0, 0, rng.randint(1, 16)])) for _ in range(n)]


def test_the_fit_recovers_a_machine_from_its_timings():
    step_time = machine(4 * MS, 0.2 * MS, 1.5 * MS, 0.5 * MS)
    times = fitted(step_time, varied_shapes())
    # no step had prompt tokens: their coefficient stays at the ridge's prior
    for got, want in zip(times.coefficients, (4 * MS, 0.2 * MS, 1.5 * MS, 0.5 * MS, 0.0), strict=True):
        assert got == pytest.approx(want, rel=0.02, abs=2e-5)
    assert times.predict(8, 12) == pytest.approx(step_time(8, 12), rel=0.01)


def test_the_fit_follows_a_machine_that_changes():
    slow, fast = machine(8 * MS, 0.4 * MS, 2 * MS, 1 * MS), machine(4 * MS, 0.2 * MS, 1 * MS, 0.5 * MS)
    times = fitted(slow, varied_shapes(1))
    for num_decodes, num_drafts in varied_shapes(2, 400):  # older steps are forgotten
        times.observe(num_decodes, num_drafts, 0, fast(num_decodes, num_drafts))
    assert times.predict(4, 8) == pytest.approx(fast(4, 8), rel=0.02)


def test_nothing_measured_means_no_prediction():
    times = StepTimeModel()
    assert times.predict(1, 0) is None and times.coefficients is None
    assert best_num_drafts(times, 0.1, 4, 1, 0) is None
    times.observe(1, 0, 0, 5 * MS)  # plain steps only: what a verify step costs is still unknown
    assert best_num_drafts(times, 0.1, 4, 1, 0) is None
    times.observe(1, 4, 0, 50 * MS)  # the first verify step pays one-off costs: not fitted
    assert times.num_verify_steps == 0 and best_num_drafts(times, 0.1, 4, 1, 0) is None
    times.observe(1, 4, 0, 9 * MS)
    assert times.num_verify_steps == 1 and best_num_drafts(times, 0.1, 4, 1, 0) is not None


def test_a_stalled_step_moves_the_fit_only_so_far():
    step_time = machine(5 * MS, 0.1 * MS, 1 * MS, 0.5 * MS)
    times = fitted(step_time, varied_shapes())
    before = times.predict(1, 0)
    times.observe(1, 0, 0, 2.0)  # another process took the cores for 2 s
    assert times.predict(1, 0) < 1.2 * before


def test_expected_extra_tokens_is_the_geometric_sum():
    assert expected_extra_tokens(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_extra_tokens(1.0, 4) == 4
    assert expected_extra_tokens(0.0, 4) == 0


def best_by_hand(step_time, alpha: float, max_k: int, num_decodes: int) -> int:
    """The k in 0..max_k with the largest gain, from the machine itself (not the fit)."""
    value = step_time(num_decodes, 0) / num_decodes
    gains = [0.0] + [
        sum(alpha**j for j in range(1, k + 1)) * value - 1.1 * (step_time(num_decodes, k) - step_time(num_decodes, 0))
        for k in range(1, max_k + 1)
    ]
    return max(range(max_k + 1), key=lambda k: (gains[k] > 0, gains[k]))


@pytest.mark.parametrize(
    ("name", "step_time", "alpha", "num_decodes", "want"),
    [
        # one conversation at the memory wall: a verify row costs little next to the weights' read
        ("memory-bound, good drafts", machine(5 * MS, 0.05 * MS, 1 * MS, 0.3 * MS), 0.7, 1, 4),
        # the same machine, drafts that are mostly wrong: not worth the eager step
        ("memory-bound, poor drafts", machine(5 * MS, 0.05 * MS, 1 * MS, 0.3 * MS), 0.1, 1, 0),
        # drafts cost 1 ms a row: two are worth it at alpha 0.5, the third is not
        ("shortened", machine(5 * MS, 0.05 * MS, 0.0, 1 * MS), 0.5, 1, 2),
        # 64 rows, compute-bound: a draft row costs what a row of the batch costs
        ("compute-bound batch", machine(2 * MS, 1 * MS, 1 * MS, 1 * MS), 0.9, 64, 0),
    ],
)
def test_the_number_of_drafts_that_pays(name, step_time, alpha, num_decodes, want):
    times = fitted(step_time, varied_shapes())
    assert best_by_hand(step_time, alpha, 4, num_decodes) == want  # the case is what its name says
    assert best_num_drafts(times, alpha, 4, num_decodes, 0) == want


def test_a_step_that_already_verifies_has_paid_for_its_eager_pass():
    # delta (the eager pass) large, rows cheap: the first drafting sequence cannot pay delta alone
    # at a low acceptance rate, a second one in the same step only pays its rows
    times = fitted(machine(5 * MS, 0.1 * MS, 4 * MS, 0.1 * MS), varied_shapes())
    assert best_num_drafts(times, 0.3, 4, 2, 0) == 0
    assert best_num_drafts(times, 0.3, 4, 2, 4) > 0


def test_acceptance_counts_one_failure_per_partly_rejected_verify():
    est = AcceptanceEstimate(forget=1.0)
    est.observe(4, 2)  # 2 successes, then a failure
    est.observe(4, 4)  # all accepted: no failure
    assert (est.successes, est.failures) == (6, 1)
    assert est.rate(prior=0.5) == pytest.approx((6 + 2 * 0.5) / (7 + 2))


# --- in the Speculator ----------------------------------------------------------------------------
def feed(spec: Speculator, step_time, shapes) -> None:
    """Steps as the engine reports them: the time to the step-time model, the end of the step to the speculator."""
    for num_decodes, num_drafts in shapes:
        spec.step_times.observe(num_decodes, num_drafts, 0, step_time(num_decodes, num_drafts))
        spec.end_step(num_drafts)


def test_the_speculator_drafts_alone_but_not_in_a_compute_bound_batch():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), max_model_len=1000)
    # a machine whose rows cost like a 2-core CPU's past ~16 rows: 5 ms of weights, 0.4 ms a row
    feed(spec, machine(5 * MS, 0.4 * MS, 0.5 * MS, 0.4 * MS), varied_shapes())
    seq = Sequence([1, 2, 3, 4] * 8, 16)
    spec.register(seq, eligible=True)
    for _ in range(5):
        spec.observe(seq, 4, 4)  # its drafts are good
    assert spec.propose(seq, 10, 1) == [1, 2, 3, 4]
    spec.end_step(4)  # the next step (an untimed one: nothing learnt)
    assert spec.propose(seq, 10, 64) == []  # among 63 others: a token is worth ~0.5 ms, a row costs 0.44


def test_one_sequence_of_a_step_probes_while_nothing_is_measured():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), max_model_len=1000)
    seqs = [Sequence([1, 2, 3, 4] * 8, 16) for _ in range(3)]
    for seq in seqs:
        spec.register(seq, eligible=True)
    # a step of 3 decodes: the first drafts (its time will tell what a verify costs), the others not
    assert [spec.propose(seq, 10, 3) for seq in seqs] == [[1, 2, 3, 4], [], []]
    feed(spec, lambda num_decodes, num_drafts: 30 * MS, [(3, 4)])  # the first verify: one-off costs, not fitted
    assert [spec.propose(seq, 10, 3) for seq in seqs] == [[1, 2, 3, 4], [], []]


def test_drafts_a_grammar_cuts_are_not_counted_into_the_step():
    """A structured output's cut comes before the cost model: drafts its grammar rejects take no part of the
    step, so with nothing measured the next sequence still probes (counted after the cut, the first
    sequence's four rejected drafts would have used up the step's probe)."""
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), max_model_len=1000)
    seqs = [Sequence([1, 2, 3, 4] * 8, 16) for _ in range(3)]
    for seq in seqs:
        spec.register(seq, eligible=True)
    seen = []
    def reject_all(drafts: list[int]) -> list[int]:
        seen.append(list(drafts))
        return []
    assert spec.propose(seqs[0], 10, 3, reject_all) == []
    assert seen == [[1, 2, 3, 4]]  # the proposer's drafts reached the cut
    assert spec.propose(seqs[1], 10, 3, lambda drafts: drafts[:2]) == [1, 2]  # the probe, cut to two
    assert spec.propose(seqs[2], 10, 3) == []


def test_a_sequence_judged_not_to_pay_probes_again_after_a_while():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), max_model_len=1000)
    step_time = machine(5 * MS, 0.05 * MS, 20 * MS, 5 * MS)  # a verify step far too dear
    feed(spec, step_time, [*varied_shapes(), (1, 4)])  # ending with a verify step
    seq = Sequence([1, 2, 3, 4] * 8, 16)
    spec.register(seq, eligible=True)
    proposed = []
    for _ in range(2 * PROBE_EVERY + 2):
        drafts = spec.propose(seq, 10, 1)
        proposed.append(len(drafts))
        feed(spec, step_time, [(1, len(drafts))])
    # plain steps, one probe after PROBE_EVERY of them, and again
    assert [i for i, n in enumerate(proposed) if n] == [PROBE_EVERY, 2 * PROBE_EVERY + 1]


def test_a_set_max_batch_size_still_caps():
    spec = Speculator(SpeculativeConfig(max_batch_size=4, cost_model=False), max_model_len=100)
    seq = Sequence([1, 2, 3, 4] * 3, 16)
    spec.register(seq, eligible=True)
    assert spec.propose(seq, 10, 4) != []
    assert spec.propose(seq, 10, 5) == []
    with pytest.raises(ValueError, match="max_batch_size"):
        SpeculativeConfig(max_batch_size=0)


def test_a_draft_model_runs_only_for_the_sequences_the_cost_model_keeps():
    asked: list[list[int]] = []

    def draft(requests):
        asked.append([k for _, k in requests])
        return [[1, 2, 3, 4][:k] for _, k in requests]

    seqs = [Sequence([1, 2, 3, 4] * 8, 16) for _ in range(3)]
    for cost_model, shapes, want in [
        (False, [], [[4, 4, 4]]),  # every decode drafts
        (True, [], [[4]]),  # nothing measured: one sequence probes
        # a compute-bound machine at 64 sequences: nobody drafts, the draft model does not run
        (True, [*varied_shapes(), (1, 4)], []),
    ]:
        config = SpeculativeConfig(method="draft_model", model="/draft", num_speculative_tokens=4,
                                   cost_model=cost_model)
        spec = Speculator(config, max_model_len=1000, batch_proposer=draft)
        feed(spec, machine(2 * MS, 1 * MS, 1 * MS, 1 * MS), shapes)
        for seq in seqs:
            spec.register(seq, eligible=True)
        asked.clear()
        spec.prepare(seqs, 64 if shapes else 3)
        assert asked == want
        drafts = [spec.propose(seq, 10, 64 if shapes else 3) for seq in seqs]
        assert drafts == [[1, 2, 3, 4] if i < len(want[0]) else [] for i in range(3)] if want else [[], [], []]
    with pytest.raises(ValueError, match="batch proposer"):
        Speculator(SpeculativeConfig(), max_model_len=100, batch_proposer=draft)
