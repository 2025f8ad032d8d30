"""Which decoding sequences draft tokens this step, and how many: the per-sequence policy.

The scheduler asks ``propose`` for each decode it plans; the engine reports
each verify step back with ``observe``. The rules (docs/speculative-decoding.md)::

    batch > max_batch_size (if set) -> no drafts (plain decodes)
    sequence not eligible         -> no drafts (the engine says which are: see ``eligible``)
    backing off                   -> no drafts, one step of the back-off used up
    the proposer finds nothing    -> no drafts: a plain decode step (ngram: no n-gram recurs)
    else                          -> the cost model's number of the proposed drafts (0 to k,
                                     fewer near max_tokens or max_model_len): cost_model.py
    `max_failures` verify steps in a row accept nothing -> back off `backoff_steps` steps

Plain Python, no torch: the state is a few integers per sequence, held in a
weak dictionary so a finished sequence's entry goes with it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.cost_model import (
    PRIOR_ACCEPTANCE,
    AcceptanceEstimate,
    best_num_drafts,
)
from pagedllm.spec_decode.ngram_proposer import NgramProposer
from pagedllm.spec_decode.proposer import Proposer
from pagedllm.spec_decode.suffix_proposer import SuffixProposer
from pagedllm.step_time import StepTimeModel

# where the cost model says drafting does not pay, one sequence still drafts after this many steps
# without a verify step, so the fit keeps measuring what a verify costs now (a probe of one
# sequence's rows: ~0.2% of a 64-sequence batch's time at this rate)
PROBE_EVERY = 32


class Sequence(Protocol):
    """What the policy reads of a sequence (``engine/sequence.py``'s; this package sits below the engine)."""

    token_ids: list[int]
    num_prompt_tokens: int
    num_draft_tokens: int

    def __len__(self) -> int: ...


def _make_proposer(config: SpeculativeConfig) -> Proposer | None:
    """The draft method ``config`` names, behind the proposer interface (None: a draft model, whose batched
    runs the engine hands in as the Speculator's ``batch_proposer``)."""
    if config.method == "suffix":
        return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    return None


# drafts for several (sequence, most drafts) at once, in order: a draft model's batched run
BatchProposer = Callable[[list[tuple["Sequence", int]]], list[list[int]]]


@dataclass
class _SeqState:
    """One sequence's speculation record."""

    eligible: bool = False  # until the engine registers the sequence (beams, for one, never are)
    max_len: int | None = None  # most tokens it may reach (prompt + max_tokens, or max_model_len)
    failures: int = 0  # verify steps in a row that accepted nothing
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    backoff: int = 0  # decode steps left without proposing


class Speculator:
    """Drafts tokens for decoding sequences under ``config``'s rules, and counts what they yield.

    Args:
        config: the speculative settings.
        max_model_len: no draft may take a sequence past this length.
        batch_proposer: what drafts for all of a step's decodes at once (method "draft_model" only).
        step_times: the engine's step-time model, which the engine feeds; a model of its own when None.
    """

    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, batch_proposer: BatchProposer | None = None,
        step_times: StepTimeModel | None = None,
    ) -> None:
        if (config.method == "draft_model") != (batch_proposer is not None):
            raise ValueError("a batch proposer drafts for method 'draft_model', and only for it")
        self.config = config
        self.max_model_len = max_model_len
        self.batch_proposer = batch_proposer
        self.proposer = _make_proposer(config)
        # drafts made by ``prepare`` for this step's decodes (draft_model), taken by ``propose``
        self._prepared: weakref.WeakKeyDictionary[Sequence, list[int]] = weakref.WeakKeyDictionary()
        self._states: weakref.WeakKeyDictionary[Sequence, _SeqState] = weakref.WeakKeyDictionary()
        # totals for metrics (vLLM's spec_decode_num_* counters)
        self.num_drafts = 0  # verify steps run
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # the cost model (cost_model.py): step times fitted to the engine's steps (the engine's one
        # model, which it feeds), and the acceptance rate of all sequences, the prior of one that has
        # not verified yet
        self.step_times = step_times if step_times is not None else StepTimeModel()
        self.acceptance = AcceptanceEstimate(forget=0.98)
        self._num_step_decodes = 0  # decodes proposed for in the step being planned
        self._num_step_drafts = 0  # drafts given to it so far
        self._num_plain_steps = 0  # steps in a row without drafts

    def _state(self, seq: Sequence) -> _SeqState:
        state = self._states.get(seq)
        if state is None:
            state = self._states[seq] = _SeqState()
        return state

    def register(self, seq: Sequence, eligible: bool, max_len: int | None = None) -> None:
        """Whether ``seq`` may speculate at all (its request's settings allow it), and how long it may grow."""
        state = self._state(seq)
        state.eligible = eligible
        state.max_len = max_len

    def _max_num_drafts(self, seq: Sequence, max_num_tokens: int, batch_size: int) -> int:
        """The most drafts ``seq`` may verify in a step of ``batch_size`` (0: none), before any proposal."""
        cfg = self.config
        state = self._state(seq)
        if (cfg.max_batch_size is not None and batch_size > cfg.max_batch_size) or not state.eligible:
            return 0
        if state.backoff > 0:
            return 0
        limit = self.max_model_len if state.max_len is None else min(state.max_len, self.max_model_len)
        # the verify step computes the last token and the drafts, and samples one more after them
        return max(0, min(cfg.num_speculative_tokens, max_num_tokens, limit - len(seq) - 1))

    def prepare(self, seqs: list[Sequence], batch_size: int) -> None:
        """Before a step's schedule: draft for ``seqs`` (the decodes it may plan) in one run of the batch
        proposer (method "draft_model"); ``propose`` then hands them out. No-op for the other methods."""
        self._prepared.clear()
        if self.batch_proposer is None:
            return
        wanted = [(seq, k) for seq in seqs if (k := self._max_num_drafts(seq, self.config.num_speculative_tokens,
                                                                          batch_size))]
        if self.config.cost_model:
            # a draft model's run costs even for drafts the cost model would drop: ask it first (with the
            # most drafts each may take), keeping one sequence where a probe is due
            probe_due = self.step_times.num_verify_steps == 0 or self._num_plain_steps >= PROBE_EVERY
            kept = [(seq, k) for seq, k in wanted
                    if best_num_drafts(self.step_times, self._alpha(seq), k, batch_size, 0)]
            wanted = kept or wanted[:1] if probe_due else kept
        if wanted:
            for (seq, _), drafts in zip(wanted, self.batch_proposer(wanted)):
                self._prepared[seq] = drafts

    def _alpha(self, seq: Sequence) -> float:
        """``seq``'s expected acceptance rate per draft: its own, pulled to the rate of all sequences."""
        return self._state(seq).acceptance.rate(self.acceptance.rate(PRIOR_ACCEPTANCE))

    def propose(
        self, seq: Sequence, max_num_tokens: int, batch_size: int,
        allow: Callable[[list[int]], list[int]] | None = None,
    ) -> list[int]:
        """Draft tokens to verify after ``seq``'s last token in a step of ``batch_size`` sequences ([]: decode plainly).

        ``allow`` cuts the proposer's drafts to those the request may emit (a structured output's grammar)
        before the cost model weighs them and counts them into the step."""
        cfg = self.config
        state = self._state(seq)
        self._num_step_decodes += 1
        k = self._max_num_drafts(seq, max_num_tokens, batch_size)
        if state.backoff > 0 and state.eligible:
            state.backoff -= 1
        if k < 1:
            return []
        if self.batch_proposer is not None:
            drafts = self._prepared.pop(seq, [])[:k]
        else:
            drafts = self.proposer.propose(seq, k)
        if drafts and allow is not None:
            drafts = allow(drafts)
        if not drafts or not cfg.cost_model:
            return drafts
        # every running sequence may decode in this step: the batch the step's time is predicted for
        num_decodes = max(batch_size, self._num_step_decodes)
        k = best_num_drafts(self.step_times, self._alpha(seq), len(drafts), num_decodes, self._num_step_drafts)
        if not k:
            # unmeasured, or judged not to pay: a verify step's cost is only known from verify steps,
            # so one sequence of a step (never a whole batch) probes while none ran for a while
            if self._num_step_drafts or (k == 0 and self._num_plain_steps < PROBE_EVERY):
                return []
            k = len(drafts)
        self._num_step_drafts += k
        return drafts[:k]

    def end_step(self, num_draft_tokens: int) -> None:
        """The step planned last ran, with ``num_draft_tokens`` drafts in all; the next step's planning starts.
        (Its time goes to ``step_times``, which the engine feeds.)"""
        self._num_step_decodes = self._num_step_drafts = 0
        self._num_plain_steps = 0 if num_draft_tokens else self._num_plain_steps + 1

    def finish(self, seq: Sequence) -> None:
        """``seq`` finished or was aborted: the proposer forgets it (and suffix decoding learns its output)."""
        if self.proposer is not None:
            self.proposer.finish(seq)

    def observe(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """A verify step of ``seq`` accepted ``num_accepted`` of ``num_proposed`` drafts."""
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        state = self._state(seq)
        state.acceptance.observe(num_proposed, num_accepted)
        self.acceptance.observe(num_proposed, num_accepted)
        state.failures = 0 if num_accepted else state.failures + 1
        if state.failures >= self.config.max_failures:
            state.failures = 0
            state.backoff = self.config.backoff_steps
            state.acceptance = AcceptanceEstimate()  # it comes back judged by the global rate
