"""The time of an engine step on this machine, fitted to the steps the engine ran: one model for the
prefill cap (``engine/step_budget.py``) and the drafting cost (``spec_decode/cost_model.py``).

A step computes B one-token decodes, K draft tokens in all (a verify step,
run eager where a plain decode may run captured) and P prompt tokens
(chunked prefill)::

    t(B, K, P)  ~  a + b*B                      the decodes (the weights' read, then a row each)
                 + [K > 0] * delta + c*K        a verify step's eager pass, and its draft rows
                 + p*P                          the prompt tokens (their attention included, on average)

The prefill cap asks how many prompt tokens fit beside B decodes in a
latency target: ``(target - t(B, 0, 0)) / p``; the drafting cost asks what
k more drafts add to a step: ``t(B, K + k, 0) - t(B, K, 0)``. Both read the
same fit, so a machine measured once answers both.

``a, b, delta, c, p`` are a ridge least-squares fit (numpy's solver over
the weighted normal equations), older steps forgotten geometrically, so the
model follows a machine whose load changes and a prompt whose attention grows
chunk by chunk. Before a verify step (or a step with prompt tokens) was
measured its coefficients are the ridge prior, 0. Plain Python and numpy:
the engine feeds it, the scheduler and the speculator read it; no torch here.
"""

from __future__ import annotations

import numpy as np

# weight kept by the older steps at each new one (about 50 steps' memory)
FORGET = 0.98
# ridge prior: pulls each coefficient to 0 with about this much weight (in observations of x = 1)
RIDGE = 1e-3
# after this many fitted steps, a step's time is held to OUTLIER times the fit's prediction
MIN_STEPS_TO_CLIP = 8
OUTLIER = 3.0

_NUM_FEATURES = 5  # 1, B, verify?, K, P


def _features(num_decodes: int, num_draft_tokens: int, num_prompt_tokens: int) -> np.ndarray:
    return np.array(
        [1.0, num_decodes, 1.0 if num_draft_tokens else 0.0, num_draft_tokens, num_prompt_tokens], dtype=np.float64
    )


class StepTimeModel:
    """Fitted time of a step of B decodes carrying K drafts in all and P prompt tokens, in seconds.

    ``observe`` takes each timed step; ``predict`` is None until one was seen.
    """

    def __init__(self) -> None:
        # sums of w * x x^T and w * x y, w = FORGET^(age of the step)
        self._xx = np.zeros((_NUM_FEATURES, _NUM_FEATURES))
        self._xy = np.zeros(_NUM_FEATURES)
        self._coef: np.ndarray | None = None
        self._verify_warm = False  # whether the first verify step (not fitted) was seen
        self.num_steps = 0  # steps fitted
        self.num_plain_steps = 0  # of which steps of decodes alone
        self.num_verify_steps = 0  # steps with drafts
        self.num_prefill_steps = 0  # steps with prompt tokens

    def observe(self, num_decodes: int, num_draft_tokens: int, num_prompt_tokens: int, seconds: float) -> None:
        """A step of ``num_decodes`` decodes, ``num_draft_tokens`` drafts in all and ``num_prompt_tokens``
        prompt tokens took ``seconds``. Steps that compute nothing, or drafts without a decode, are ignored."""
        if min(num_decodes, num_draft_tokens, num_prompt_tokens) < 0 or not seconds > 0:
            return
        if num_decodes + num_prompt_tokens == 0 or (num_draft_tokens and not num_decodes):
            return
        if num_draft_tokens and not self._verify_warm:
            # the first verify step pays one-off costs (first eager pass over its shapes): 85 ms
            # where later ones took ~15 on the bundled model
            self._verify_warm = True
            return
        predicted = self.predict(num_decodes, num_draft_tokens, num_prompt_tokens)
        if predicted is not None and self.num_steps >= MIN_STEPS_TO_CLIP:
            # a step stalled by another process is no cost of its shape: held to OUTLIER times the
            # prediction, a lasting change still moves the fit within a few steps
            seconds = min(seconds, OUTLIER * predicted)
        x = _features(num_decodes, num_draft_tokens, num_prompt_tokens)
        self._xx = FORGET * self._xx + np.outer(x, x)
        self._xy = FORGET * self._xy + x * seconds
        self.num_steps += 1
        self.num_verify_steps += 1 if num_draft_tokens else 0
        self.num_prefill_steps += 1 if num_prompt_tokens else 0
        self.num_plain_steps += 0 if num_draft_tokens or num_prompt_tokens else 1
        self._coef = None

    @property
    def coefficients(self) -> tuple[float, ...] | None:
        """``(a, b, delta, c, p)`` of the module's formula; None before any step was seen."""
        if self.num_steps == 0:
            return None
        if self._coef is None:
            # the ridge's normal equations (X^T W X + RIDGE I) coef = X^T W y, solved by least squares:
            # well defined even where the steps seen leave a coefficient undetermined
            self._coef = np.linalg.lstsq(self._xx + RIDGE * np.eye(_NUM_FEATURES), self._xy, rcond=None)[0]
        return tuple(float(v) for v in self._coef)

    @property
    def prompt_token_s(self) -> float | None:
        """What one prompt token adds to a step (``p``); None until a step with prompt tokens was seen."""
        coef = self.coefficients
        return None if coef is None or self.num_prefill_steps == 0 else max(coef[4], 0.0)

    def predict(self, num_decodes: int, num_draft_tokens: int, num_prompt_tokens: int = 0) -> float | None:
        """Seconds a step of that shape would take; None: no data."""
        coef = self.coefficients
        if coef is None:
            return None
        a, b, delta, c, p = coef
        t = a + b * num_decodes + max(p, 0.0) * num_prompt_tokens
        if num_draft_tokens:
            # a fit on few verify steps may give a negative extra: drafting is never free
            t += max(delta + c * num_draft_tokens, 0.0)
        return max(t, 0.0)
