"""Beam search over paged sequences: forks share blocks, pruned beams free theirs.

Each live beam is a running ``Sequence``. After a step gives every live beam
its top next-token logprobs, ``BeamSearch.advance`` picks the next beams the
way transformers' ``generate(num_beams=..., length_penalty=...)`` does (with
its default ``early_stopping=False``), so both find the same best sequence:

- the ``K = max(2, 1 + num_eos) * beam_width`` best continuations over all
  beams, by summed logprob;
- those that end (EOS, or the length limit) and rank among the first
  ``beam_width`` become finished hypotheses, scored ``sum_logprob /
  generated_len ** length_penalty``; the best ``beam_width`` are kept;
- the best ``beam_width`` continuations that do not end are the next beams;
- search stops when every continuation ends, or when ``beam_width``
  hypotheses are finished and the best live beam, normalised by its current
  length, cannot beat the worst of them.

A beam chosen by several continuations is forked (``Scheduler.fork_running``:
block tables shared, ref counts up); the partial last block is copied on the
first write, full blocks never are. A beam chosen by none is finished and its
blocks go back to the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence, SequenceStatus
from pagedllm.sampling_params import check_float, check_int

# (2**31) ** 32 is about 4e297, inside a float64
MAX_LENGTH_PENALTY = 32.0


@dataclass(frozen=True)
class BeamSearchParams:
    """Settings of ``LLM.beam_search``, with vLLM's names.

    Args:
        beam_width: beams kept at each step (and hypotheses returned).
        max_tokens: most tokens generated per beam.
        ignore_eos: do not end hypotheses at EOS.
        length_penalty: exponent of the generated length that divides a
            finished hypothesis's summed logprob (>0 favours longer ones).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        check_int("beam_width", self.beam_width, 1, 8)
        check_int("max_tokens", self.max_tokens, 1)
        # len ** length_penalty must stay a finite float for any length below 2**31
        check_float("length_penalty", self.length_penalty, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its output tokens, summed logprob and normalised score."""

    token_ids: tuple[int, ...]
    cumulative_logprob: float
    score: float
    finish_reason: str


@dataclass(frozen=True)
class Continuation:
    """A live beam followed by one more token."""

    parent: Sequence
    token_id: int
    cumulative_logprob: float


@dataclass
class BeamStep:
    """What the engine must do after ``advance``: grow, fork and drop beams."""

    next_beams: list[Continuation] = field(default_factory=list)
    dropped: list[Sequence] = field(default_factory=list)
    done: bool = False


class BeamSearch:
    """The beam-search state of one request (plain Python, no torch)."""

    def __init__(self, params: BeamSearchParams, prompt_len: int, max_len: int, eos_token_ids: frozenset[int]) -> None:
        self.params = params
        self.prompt_len = prompt_len
        # a continuation reaching this many tokens ends (prompt + max_tokens, capped by the context)
        self.max_len = min(prompt_len + params.max_tokens, max_len)
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.num_candidates = max(2, 1 + len(eos_token_ids)) * params.beam_width
        self.scores: dict[int, float] = {}  # seq_id -> summed logprob of a live beam
        self.results: dict[int, list[tuple[int, float]]] = {}  # seq_id -> top (token, logprob)
        self.live: list[Sequence] = []
        self.finished: list[Hypothesis] = []
        self.improvement_possible = True

    def start(self, seq: Sequence) -> None:
        self.live = [seq]
        self.scores = {seq.seq_id: 0.0}

    def add_result(self, seq: Sequence, top: list[tuple[int, float]]) -> None:
        """Record a live beam's top next tokens from the step that just ran."""
        self.results[seq.seq_id] = top

    @property
    def ready(self) -> bool:
        """Every live beam has its result (beams advance in lock-step)."""
        return all(s.seq_id in self.results for s in self.live)

    def _normalise(self, logprob: float, generated_len: int) -> float:
        return logprob / (generated_len**self.params.length_penalty)

    def advance(self) -> BeamStep:
        """Choose the next beams and finished hypotheses from the live beams' results."""
        cur_len = len(self.live[0])
        candidates = [
            Continuation(seq, token, self.scores[seq.seq_id] + logprob)
            for seq in self.live
            for token, logprob in self.results[seq.seq_id]
        ]
        candidates.sort(key=lambda c: c.cumulative_logprob, reverse=True)
        candidates = candidates[: self.num_candidates]
        self.results = {}

        def ends(c: Continuation) -> bool:
            return c.token_id in self.eos_token_ids or cur_len + 1 >= self.max_len

        width = self.params.beam_width
        # finished hypotheses: only among the best `width` continuations
        if self.improvement_possible:
            for c in candidates[:width]:
                if ends(c):
                    tokens = tuple(c.parent.token_ids[self.prompt_len :]) + (c.token_id,)
                    reason = "stop" if c.token_id in self.eos_token_ids else "length"
                    score = self._normalise(c.cumulative_logprob, cur_len + 1 - self.prompt_len)
                    self.finished.append(Hypothesis(tokens, c.cumulative_logprob, score, reason))
            self.finished.sort(key=lambda h: h.score, reverse=True)
            del self.finished[width:]

        step = BeamStep(next_beams=[c for c in candidates if not ends(c)][:width])
        chosen = {id(c.parent) for c in step.next_beams}
        step.dropped = [s for s in self.live if id(s) not in chosen]
        if step.next_beams and len(self.finished) == width:
            best_live = self._normalise(step.next_beams[0].cumulative_logprob, cur_len + 1 - self.prompt_len)
            if best_live <= self.finished[-1].score:
                self.improvement_possible = False
        step.done = not step.next_beams or not self.improvement_possible
        return step

    def abort(self) -> None:
        """End the search early: live beams join the hypotheses as "abort"."""
        for seq in self.live:
            logprob = self.scores[seq.seq_id]
            generated = len(seq) - self.prompt_len
            score = self._normalise(logprob, generated) if generated else logprob
            self.finished.append(Hypothesis(tuple(seq.token_ids[self.prompt_len :]), logprob, score, "abort"))
        self.finished.sort(key=lambda h: h.score, reverse=True)
        del self.finished[self.params.beam_width :]
        self.live = []

    def set_live(self, beams: list[tuple[Sequence, float]]) -> None:
        """The engine reports the sequences now carrying the next beams."""
        self.live = [s for s, _ in beams]
        self.scores = {s.seq_id: score for s, score in beams}


class BeamRequest(Protocol):
    """What ``apply_beam_step`` reads and writes of a request (``engine.request.Request`` has it).

    A structural type, so that this module need not import ``request.py``,
    which imports ``BeamSearch`` from here: the request holds its search, the
    search does not know the request class.
    """

    seqs: list[Sequence]
    beam: BeamSearch | None
    beam_done: bool


def apply_beam_step(req: BeamRequest, scheduler: Scheduler) -> int:
    """Carry out one ``advance`` of ``req``'s search; return the tokens appended.

    Pruned beams are finished (their blocks freed); a beam continued in
    several ways is forked, sharing its blocks; each continuation then gets
    its token.
    """
    beam = req.beam
    step = beam.advance()
    for seq in step.dropped:
        scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
    if step.done:
        for seq in beam.live:
            if not seq.is_finished:
                scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        req.beam_done = True
        return 0
    used: set[int] = set()
    appends: list[tuple[Sequence, int]] = []
    live: list[tuple[Sequence, float]] = []
    for c in step.next_beams:
        if c.parent.seq_id not in used:
            used.add(c.parent.seq_id)
            seq = c.parent
        else:
            # a second continuation of the same beam: share its blocks
            seq = c.parent.fork(index=len(req.seqs))
            scheduler.fork_running(c.parent, seq)
            req.seqs.append(seq)
        appends.append((seq, c.token_id))
        live.append((seq, c.cumulative_logprob))
    for seq, token in appends:  # after the forks, which copy the parent's tokens
        seq.append_token(token)
    beam.set_live(live)
    return len(appends)
