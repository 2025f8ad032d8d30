"""When drafting pays on this machine: a model of a decode step's time, fitted to the steps the engine ran.

A verify step computes a sequence's last token and its k drafts in one
pass. On a CPU that pass reads the weights once, as a plain decode does,
but its k extra rows cost compute, and on this engine a step with drafts
runs eager where a plain decode may run captured. Whether drafting pays
depends on both costs and on how often drafts are accepted::

    step time   t(B, K)  ~  a + b*B                   (B decodes, no drafts)
                           + delta + c*K              (K drafts in all: a verify step)

    a draft row of a sequence with acceptance rate alpha yields, at length k,
        X(k) = alpha + alpha^2 + ... + alpha^k        extra tokens (expected)
    each worth what a token of a plain step costs:    t(B, 0) / B
    it costs                                          t(B, K + k) - t(B, K)

    draft k tokens where  X(k) * t(B, 0) / B  -  cost  is largest and > 0

so a small batch at the memory wall (a plain step costs the weights' read
whatever B) drafts long, and a batch large enough to be compute-bound
(t(B, 0) / B near the cost of one more row, while X(k) < k) does not draft
at all: vLLM's ``disable_by_batch_size``, found from measurements instead
of set by hand. ``a, b, delta, c`` are a ridge least-squares fit over the
steps without prompt tokens, older steps forgotten geometrically, so the
model follows a machine whose load changes. Before a verify step was
measured ``delta`` and ``c`` are taken as 0 (the ridge's prior): the first
steps draft, and their timings decide the rest.

Plain Python, no torch: four sums per feature pair and a 4x4 solve.
"""

from __future__ import annotations

# weight kept by the older steps at each new one (about 50 steps' memory)
FORGET = 0.98
# ridge prior: pulls each coefficient to 0 with about this much weight (in observations of x = 1)
RIDGE = 1e-3
# a draft must gain this fraction of its cost to be worth it: a guard against the fit's noise
MARGIN = 1.1
# the acceptance rate a sequence is assumed to have before its own verify steps are seen (and
# the global rate is unknown); and how many verify steps' weight that guess has
PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 2.0
# weight kept by a sequence's older verify outcomes at each new one
ACCEPTANCE_FORGET = 0.8

# after this many fitted steps, a step's time is held to OUTLIER times the fit's prediction
MIN_STEPS_TO_CLIP = 8
OUTLIER = 3.0

_NUM_FEATURES = 4  # 1, B, verify?, K


def _features(num_decodes: int, num_draft_tokens: int) -> tuple[float, float, float, float]:
    return (1.0, float(num_decodes), 1.0 if num_draft_tokens else 0.0, float(num_draft_tokens))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b (Gaussian elimination with partial pivoting; ``a`` is symmetric positive definite)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for j in range(col, n + 1):
                m[r][j] -= f * m[col][j]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][j] * x[j] for j in range(r + 1, n))) / m[r][r]
    return x


def expected_extra_tokens(alpha: float, k: int) -> float:
    """Tokens beyond the one a plain step gives that k drafts yield on average, each accepted with ``alpha``
    while the ones before it were (the standard geometric model of speculative decoding)."""
    return sum(alpha**j for j in range(1, k + 1))


class StepTimeModel:
    """Fitted time of a step of B decodes carrying K drafts in all, in seconds.

    ``observe`` takes each step without prompt tokens; ``predict`` is None
    until one such step was seen.
    """

    def __init__(self) -> None:
        # sums of w * x x^T and w * x y, w = FORGET^(age of the step)
        self._xx = [[0.0] * _NUM_FEATURES for _ in range(_NUM_FEATURES)]
        self._xy = [0.0] * _NUM_FEATURES
        self._coef: list[float] | None = None
        self._verify_warm = False  # whether the first verify step (not fitted) was seen
        self.num_plain_steps = 0
        self.num_verify_steps = 0

    def observe(self, num_decodes: int, num_draft_tokens: int, seconds: float) -> None:
        """A step of ``num_decodes`` decodes with ``num_draft_tokens`` drafts in all took ``seconds``."""
        if num_decodes < 1 or num_draft_tokens < 0 or not seconds > 0:
            return
        if num_draft_tokens and not self._verify_warm:
            # the first verify step pays one-off costs (first eager pass over its shapes): 85 ms
            # where later ones took ~15 on the bundled model
            self._verify_warm = True
            return
        predicted = self.predict(num_decodes, num_draft_tokens)
        if predicted is not None and self.num_plain_steps + self.num_verify_steps >= MIN_STEPS_TO_CLIP:
            # a step stalled by another process is no cost of its shape: held to OUTLIER times the
            # prediction, a lasting change still moves the fit within a few steps
            seconds = min(seconds, OUTLIER * predicted)
        x = _features(num_decodes, num_draft_tokens)
        for i in range(_NUM_FEATURES):
            self._xy[i] = FORGET * self._xy[i] + x[i] * seconds
            for j in range(_NUM_FEATURES):
                self._xx[i][j] = FORGET * self._xx[i][j] + x[i] * x[j]
        if num_draft_tokens:
            self.num_verify_steps += 1
        else:
            self.num_plain_steps += 1
        self._coef = None

    @property
    def coefficients(self) -> tuple[float, ...] | None:
        """``(a, b, delta, c)`` of the module's formula; None before any step was seen."""
        if self.num_plain_steps + self.num_verify_steps == 0:
            return None
        if self._coef is None:
            a = [[v + (RIDGE if i == j else 0.0) for j, v in enumerate(row)] for i, row in enumerate(self._xx)]
            self._coef = _solve(a, self._xy)
        return tuple(self._coef)

    def predict(self, num_decodes: int, num_draft_tokens: int) -> float | None:
        """Seconds a step of ``num_decodes`` decodes with ``num_draft_tokens`` drafts would take; None: no data."""
        coef = self.coefficients
        if coef is None:
            return None
        a, b, delta, c = coef
        t = a + b * num_decodes
        if num_draft_tokens:
            # a fit on few verify steps may give a negative extra: drafting is never free
            t += max(delta + c * num_draft_tokens, 0.0)
        return max(t, 0.0)


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
