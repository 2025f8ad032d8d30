"""Which decoding sequences draft tokens this step, and how many: the per-sequence policy.

The scheduler asks ``propose`` for each decode it plans; the engine reports
each verify step back with ``observe``. The rules (docs/speculative-decoding.md)::

    batch > max_batch_size        -> no drafts (plain decodes)
    sequence not eligible         -> no drafts (the engine says which are: see ``eligible``)
    backing off                   -> no drafts, one step of the back-off used up
    the proposer finds nothing    -> no drafts: a plain decode step (ngram: no n-gram recurs)
    else                          -> up to k drafts (fewer near max_tokens or max_model_len)
    `max_failures` verify steps in a row accept nothing -> back off `backoff_steps` steps

Plain Python, no torch: the state is a few integers per sequence, held in a
weak dictionary so a finished sequence's entry goes with it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Protocol

from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.ngram_proposer import NgramProposer
from pagedllm.spec_decode.proposer import Proposer
from pagedllm.spec_decode.suffix_proposer import SuffixProposer


class Sequence(Protocol):
    """What the policy reads of a sequence (``engine/sequence.py``'s; this package sits below the engine)."""

    token_ids: list[int]
    num_prompt_tokens: int
    num_draft_tokens: int

    def __len__(self) -> int: ...


def _make_proposer(config: SpeculativeConfig) -> Proposer:
    """The draft method ``config`` names, behind the proposer interface."""
    if config.method == "suffix":
        return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


@dataclass
class _SeqState:
    """One sequence's speculation record."""

    eligible: bool = False  # until the engine registers the sequence (beams, for one, never are)
    max_len: int | None = None  # most tokens it may reach (prompt + max_tokens, or max_model_len)
    failures: int = 0  # verify steps in a row that accepted nothing
    backoff: int = 0  # decode steps left without proposing


class Speculator:
    """Drafts tokens for decoding sequences under ``config``'s rules, and counts what they yield.

    Args:
        config: the speculative settings.
        max_model_len: no draft may take a sequence past this length.
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = _make_proposer(config)
        self._states: weakref.WeakKeyDictionary[Sequence, _SeqState] = weakref.WeakKeyDictionary()
        # totals for metrics (vLLM's spec_decode_num_* counters)
        self.num_drafts = 0  # verify steps run
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

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

    def propose(self, seq: Sequence, max_num_tokens: int, batch_size: int) -> list[int]:
        """Draft tokens to verify after ``seq``'s last token in a step of ``batch_size`` sequences ([]: decode plainly)."""
        cfg = self.config
        state = self._state(seq)
        if batch_size > cfg.max_batch_size or not state.eligible:
            return []
        if state.backoff > 0:
            state.backoff -= 1
            return []
        limit = self.max_model_len if state.max_len is None else min(state.max_len, self.max_model_len)
        # the verify step computes the last token and the drafts, and samples one more after them
        k = min(cfg.num_speculative_tokens, max_num_tokens, limit - len(seq) - 1)
        if k < 1:
            return []
        return self.proposer.propose(seq, k)

    def finish(self, seq: Sequence) -> None:
        """``seq`` finished or was aborted: the proposer forgets it (and suffix decoding learns its output)."""
        self.proposer.finish(seq)

    def observe(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """A verify step of ``seq`` accepted ``num_accepted`` of ``num_proposed`` drafts."""
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        state = self._state(seq)
        state.failures = 0 if num_accepted else state.failures + 1
        if state.failures >= self.config.max_failures:
            state.failures = 0
            state.backoff = self.config.backoff_steps
