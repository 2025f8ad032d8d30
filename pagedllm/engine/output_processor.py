"""From sampled tokens to user-visible results: text, stops, logprobs, outputs."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pagedllm.engine.detokenizer import detokenize_incrementally
from pagedllm.engine.output_deltas import DeltaCursor, held_chars
from pagedllm.engine.request import Request, spec_decode_rates
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence, SequenceStatus
from pagedllm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.step_result import TokenLogprobs

if TYPE_CHECKING:
    from pagedllm.loader.tokenizer import Tokenizer


class OutputProcessor:
    """Appends sampled tokens, detokenizes, applies stop rules and builds outputs.

    A sequence that stops is finished through the scheduler at once, so its
    blocks are free before the next step is planned.

    Args:
        tokenizer: decodes tokens; ``eos_token_ids`` ends sequences.
        scheduler: where finished sequences are released.
        max_model_len: a sequence this long stops with "length".
    """

    def __init__(self, tokenizer: Tokenizer, scheduler: Scheduler, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.max_model_len = max_model_len

    def append_sample(self, req: Request, seq: Sequence, sample: TokenLogprobs) -> None:
        """Add one sampled token to ``seq`` and finish it if a stop rule fires."""
        seq.append_token(sample.token_id)
        seq.cumulative_logprob += sample.logprob
        if seq.logprobs is not None:
            seq.logprobs.append(self.position_logprobs(sample))
        delta = detokenize_incrementally(self.tokenizer, seq, req.params.skip_special_tokens)
        status = self.check_stop(seq, req.params, len(delta))
        if status is not None:
            self.scheduler.finish(seq, status)

    def position_logprobs(self, t: TokenLogprobs) -> PositionLogprobs:
        """vLLM's shape: {token_id: Logprob} for the chosen token and the top alternatives."""
        decode = self.tokenizer.decode
        entries = {t.token_id: Logprob(t.logprob, t.rank, decode([t.token_id], skip_special_tokens=False))}
        for rank, (token_id, logprob) in enumerate(t.top, start=1):
            if token_id not in entries:
                entries[token_id] = Logprob(logprob, rank, decode([token_id], skip_special_tokens=False))
        return entries

    def check_stop(self, seq: Sequence, params: SamplingParams, delta_len: int) -> SequenceStatus | None:
        """The finished status ``seq`` reaches with its newest token, if any.

        A stop string is cut from the text (unless the request keeps it);
        ``delta_len`` is how much text the newest token added.
        """
        token = seq.token_ids[-1]
        if seq.num_output_tokens < params.min_tokens:
            # EOS and stop_token_ids are masked until min_tokens (the runner's
            # rules); nothing but the context limit ends the output before
            return SequenceStatus.FINISHED_LENGTH if len(seq) >= self.max_model_len else None
        if not params.ignore_eos and token in self.tokenizer.eos_token_ids:
            seq.stop_reason = None
            return SequenceStatus.FINISHED_STOPPED
        if params.stop_token_ids and token in params.stop_token_ids:
            seq.stop_reason = token
            return SequenceStatus.FINISHED_STOPPED
        # as vLLM: a stop string ends the output only once it is past min_tokens tokens
        check_strings = delta_len and seq.num_output_tokens > params.min_tokens
        for stop in params.stop_strings if check_strings else ():
            # only a match that ends inside the newest delta is new
            start = max(0, len(seq.output_text) - delta_len - len(stop) + 1)
            idx = seq.output_text.find(stop, start)
            if idx != -1:
                end = idx + len(stop) if params.include_stop_str_in_output else idx
                seq.output_text = seq.output_text[:end]
                seq.stop_reason = stop
                return SequenceStatus.FINISHED_STOPPED
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if len(seq) >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def make_output(self, req: Request) -> RequestOutput:
        """The request's current state as vLLM's RequestOutput: whole, or with ``RequestOutputKind.DELTA``
        only what is new since its previous output (the choices with nothing new left out)."""
        if req.beam is not None:
            return self._beam_output(req)
        seqs = req.seqs
        if len(seqs) > req.params.n:
            # best_of: the n samples with the highest cumulative logprob
            seqs = sorted(seqs, key=lambda q: q.cumulative_logprob, reverse=True)[: req.params.n]
        if req.params.output_kind is RequestOutputKind.DELTA:
            outs = self._delta_outputs(req, seqs)
        else:
            outs = [_completion(index, seq, seq.output_text) for index, seq in enumerate(seqs)]
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outs,
            finished=req.is_finished,
            num_cached_tokens=req.seqs[0].num_cached_tokens,
            prompt_logprobs=req.prompt_logprobs,
            metrics=self._metrics(req),
        )

    @staticmethod
    def _delta_outputs(req: Request, seqs: list[Sequence]) -> list[CompletionOutput]:
        """Each choice's new text, tokens and logprobs since the request's previous output, text held back
        while a stop string may still cut it (``output_deltas.py``)."""
        hold = held_chars(req.params)
        outs = []
        for index, seq in enumerate(seqs):
            cursor = req.delta_cursors.get(seq.seq_id)
            if cursor is None:
                cursor = req.delta_cursors[seq.seq_id] = DeltaCursor()
            delta = cursor.advance(seq.output_text, seq.num_output_tokens, seq.is_finished, hold)
            if delta is not None:
                outs.append(_completion(index, seq, *delta))
        return outs

    @staticmethod
    def _metrics(req: Request) -> dict:
        """Times, and for a request that speculates its draft counts, acceptance rate and mean acceptance
        length (vLLM's names and definitions; all samples of the request together)."""
        metrics = {"arrival_time": req.arrival_time, "finished_time": time.monotonic() if req.is_finished else None}
        if req.speculates:
            rate, length = spec_decode_rates(req.num_drafts, req.num_draft_tokens, req.num_accepted_tokens)
            metrics["spec_decode_num_drafts"] = req.num_drafts
            metrics["spec_decode_num_draft_tokens"] = req.num_draft_tokens
            metrics["spec_decode_num_accepted_tokens"] = req.num_accepted_tokens
            metrics["spec_decode_acceptance_rate"] = rate
            metrics["spec_decode_mean_acceptance_length"] = length
        return metrics

    def _beam_output(self, req: Request) -> RequestOutput:
        outs = [
            CompletionOutput(
                index=i,
                text=self.tokenizer.decode(list(h.token_ids)),
                token_ids=list(h.token_ids),
                cumulative_logprob=h.cumulative_logprob,
                finish_reason=h.finish_reason,
            )
            for i, h in enumerate(req.beam.finished)
        ]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, True,
                             metrics={"beam_scores": [h.score for h in req.beam.finished]})


def _completion(
    index: int, seq: Sequence, text: str, first_token: int = 0, end_token: int | None = None
) -> CompletionOutput:
    """Choice ``index``: ``text`` and the sequence's output tokens ``first_token:end_token`` (default: all)
    with their logprobs."""
    start = seq.num_prompt_tokens
    return CompletionOutput(
        index=index,
        text=text,
        token_ids=seq.token_ids[start + first_token : None if end_token is None else start + end_token],
        cumulative_logprob=seq.cumulative_logprob,
        logprobs=None if seq.logprobs is None else seq.logprobs[first_token:end_token],
        finish_reason=seq.status.value if seq.is_finished else None,
        stop_reason=seq.stop_reason,
    )
