"""A user request: one prompt, its sampling settings and its n sequences."""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

from pagedllm.engine.beam_search import BeamSearch
from pagedllm.engine.output_deltas import DeltaCursor
from pagedllm.engine.sequence import Sequence
from pagedllm.sampling_params import SamplingParams
from pagedllm.step_record import LogitsRules

if TYPE_CHECKING:  # xgrammar imports torch; the bookkeeping only holds the object
    from pagedllm.structured_output.grammar_state import RequestGrammar


def spec_decode_rates(
    num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int
) -> tuple[float | None, float | None]:
    """vLLM's speculative figures from the three counts: the acceptance rate (accepted / draft tokens; None
    without a draft token) and the mean acceptance length (1 + accepted tokens / verify steps that carried
    drafts: the tokens a verify step emits on average; None without a verify step)."""
    if min(num_drafts, num_draft_tokens, num_accepted_tokens) < 0 or num_accepted_tokens > num_draft_tokens:
        raise ValueError(
            f"bad speculative counts: {num_drafts} verify steps, {num_draft_tokens} draft tokens, "
            f"{num_accepted_tokens} accepted"
        )
    rate = num_accepted_tokens / num_draft_tokens if num_draft_tokens else None
    length = 1 + num_accepted_tokens / num_drafts if num_drafts else None
    return rate, length


class Request:
    """Groups the sequences sampled from one prompt (``best_of`` or ``n`` of them).

    Only the first is queued; the others wait in its ``fork_children`` and
    are forked from it when it is admitted, so they share its prefill and its
    blocks. Each gets its own random stream: from ``(seed, index)`` when the
    request has a seed, else from the engine's stream.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        block_size: int,
        engine_rng: random.Random,
        arrival: int,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        # top candidates the runner reports per sampled position: what the user asked for,
        # or, for a beam search, the candidates its next step chooses from
        self.num_top_logprobs: int | None = params.logprobs
        self.arrival_time = time.monotonic()
        self.prompt_logprobs: list | None = None
        # a pooling request's pooled final hidden states so far (pooling/params.py; engine/llm_engine.py)
        self.pooled: list[float] | None = None
        self.seqs: list[Sequence] = []
        for i in range(params.num_samples):
            rng = random.Random(f"{params.seed}:{i}") if params.seed is not None else random.Random(
                engine_rng.getrandbits(64)
            )
            seq = Sequence(prompt_token_ids, block_size, request_id, i, rng, arrival)
            # a MEAN or CLS pooling request needs the hidden states of every (the first) prompt token, which a
            # prefix-cache hit would skip; LAST needs only the last one, always computed
            pooling = getattr(params, "pooling_type", None)
            seq.allow_prefix_hits = params.prompt_logprobs is None and pooling in (None, "LAST")
            seq.scores_prompt = params.prompt_logprobs is not None
            if params.logprobs is not None:
                seq.logprobs = []
            self.seqs.append(seq)
        self.seqs[0].fork_children = self.seqs[1:]
        # the logits processors the runner applies (penalties, bias, bans); set by the engine
        self.rules: LogitsRules | None = None
        # the structured-output matchers of its sequences; set by the engine
        self.grammar: RequestGrammar | None = None
        # set for beam-search requests: the beams are forked as the search goes
        self.beam: BeamSearch | None = None
        self.beam_done = False
        # RequestOutputKind.DELTA: what each sequence has sent so far, by sequence id (output_processor.py)
        self.delta_cursors: dict[int, DeltaCursor] = {}
        # speculative decoding: whether its sequence drafts, its verify steps that carried drafts (vLLM's
        # num_drafts; all samples together), and the draft tokens proposed and accepted so far
        self.speculates = False
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    @property
    def is_finished(self) -> bool:
        if self.beam is not None:
            return self.beam_done
        return all(s.is_finished for s in self.seqs)
