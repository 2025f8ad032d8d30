"""When drafting pays on this machine: the drafts a sequence should verify, from the fitted step time.

A verify step computes a sequence's last token and its k drafts in one
pass. On a CPU that pass reads the weights once, as a plain decode does,
but its k extra rows cost compute, and on this engine a step with drafts
runs eager where a plain decode may run captured. Whether drafting pays
depends on both costs and on how often drafts are accepted. The step time
``t(B, K)`` (B decodes, K drafts in all, no prompt tokens) is the engine's
one fitted model of a step (``pagedllm/step_time.py``: ``a + b*B`` for the
decodes, ``delta + c*K`` more for a verify step)::

    a draft row of a sequence with acceptance rate alpha yields, at length k,
        X(k) = alpha + alpha^2 + ... + alpha^k        extra tokens (expected)
    each worth what a token of a plain step costs:    t(B, 0) / B
    it costs                                          t(B, K + k) - t(B, K)

    draft k tokens where  X(k) * t(B, 0) / B  -  cost  is largest and > 0

so a small batch at the memory wall (a plain step costs the weights' read
whatever B) drafts long, and a batch large enough to be compute-bound
(t(B, 0) / B near the cost of one more row, while X(k) < k) does not draft
at all: vLLM's ``disable_by_batch_size``, found from measurements instead
of set by hand. Before a verify step was measured ``delta`` and ``c`` are
the fit's prior, 0: the first steps draft, and their timings decide the rest.

Plain Python, no torch.
"""

from __future__ import annotations

from pagedllm.step_time import StepTimeModel

# a draft must gain this fraction of its cost to be worth it: a guard against the fit's noise
MARGIN = 1.1
# the acceptance rate a sequence is assumed to have before its own verify steps are seen (and
# the global rate is unknown); and how many verify steps' weight that guess has
PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 2.0
# weight kept by a sequence's older verify outcomes at each new one
ACCEPTANCE_FORGET = 0.8


def expected_extra_tokens(alpha: float, k: int) -> float:
    """Tokens beyond the one a plain step gives that k drafts yield on average, each accepted with ``alpha``
    while the ones before it were (the standard geometric model of speculative decoding)."""
    return sum(alpha**j for j in range(1, k + 1))


def best_num_drafts(
    times: StepTimeModel, alpha: float, max_num_drafts: int, num_decodes: int, num_step_drafts: int
) -> int | None:
    """How many of ``max_num_drafts`` proposed drafts a sequence should verify (0: decode plainly; None:
    unknown, no verify step was measured yet).

    Args:
        times: the fitted step times.
        alpha: the sequence's expected acceptance rate per draft.
        max_num_drafts: drafts proposed.
        num_decodes: decodes in the step (B).
        num_step_drafts: drafts other sequences already put in this step (K so far).
    """
    plain = times.predict(num_decodes, 0)
    if plain is None or times.num_verify_steps == 0:
        return None  # nothing measured yet: the caller probes
    token_value = plain / num_decodes  # what a token of a plain step costs
    before = times.predict(num_decodes, num_step_drafts)
    best_k, best_gain = 0, 0.0
    for k in range(1, max_num_drafts + 1):
        cost = times.predict(num_decodes, num_step_drafts + k) - before
        gain = expected_extra_tokens(alpha, k) * token_value - MARGIN * cost
        if gain > best_gain:
            best_k, best_gain = k, gain
    return best_k


class AcceptanceEstimate:
    """A sequence's acceptance rate per draft: its decayed verify outcomes, pulled to a prior.

    A verify of k drafts that accepted a < k of them saw a successes and one
    failure; one that accepted all k saw k successes (the geometric model).
    """

    def __init__(self, forget: float = ACCEPTANCE_FORGET) -> None:
        self.forget = forget  # weight kept by older outcomes at each new one
        self.successes = 0.0
        self.failures = 0.0

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        """A verify step accepted ``num_accepted`` of ``num_proposed`` drafts."""
        self.successes = self.forget * self.successes + num_accepted
        self.failures = self.forget * self.failures + (1.0 if num_accepted < num_proposed else 0.0)

    def rate(self, prior: float) -> float:
        """The estimate, with ``prior`` worth ``PRIOR_WEIGHT`` verify steps."""
        return (self.successes + PRIOR_WEIGHT * prior) / (self.successes + self.failures + PRIOR_WEIGHT)
