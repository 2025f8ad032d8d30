"""The one record a step hands the model runner: plain data, no live objects, no torch.

The engine builds it from the scheduler's plan (``engine/step_builder.py``);
the runner (``runner/model_runner.py``) reads nothing else. The record is
incremental: a sequence's lasting data (its tokens so far, block table and
sampling settings) is sent once, when the runner first sees it, and each
later step carries only what changed (the tokens and blocks added since).
The runner keeps each sequence's state (``runner/sequence_states.py``) and
rebuilds from it the full ``SequenceStep`` view its tensors are built from.
So the runner never touches bookkeeping state, and a step can be checked,
logged or sent to another process as it is, at a cost that does not grow
with the context::

    StepRecord
      finished_seq_ids                sequences the runner forgets (finished, or preempted: sent again in full)
      new_sequences: NewSequence ...  first sight of a sequence (or again after preemption)
        token_ids                     its tokens 0 .. the end of this step's share
        num_prompt_tokens, block_table, sampling (sampling.rules: logits processors, or None)
      sequences: ScheduledStep ...    prefills and decodes, in the scheduler's order
        num_computed_tokens, num_new_tokens  tokens [num_computed_tokens, + num_new_tokens) run
        new_token_ids                 tokens the runner has not seen yet (a decode: the last sampled one)
        new_block_ids                 blocks appended to the table since the last step
        block_table                   the whole table, only when a block changed in place (copy-on-write)
        uniforms                      one uniform per sampled row (the sequence, then its forks);
                                      empty when the step does not reach the last token
        token_bitmasks                each sampled row's structured-output mask (packed int32 words
                                      as bytes; b"": none this step), when the request has a constraint
        num_kept_tokens               truncate the runner's tokens first (drafts a verify step rejected)
        num_draft_tokens              a verify step: the last new tokens are drafts, all positions sampled
        prompt_logprobs, prompt_targets  prompt tokens this chunk scores, if asked
        pooling                       a pooling request's prefill: "LAST", "MEAN" or "CLS" (samples nothing)
        pooled_logit_ids              a LAST pooling prefill's token ids whose logits it returns (a reranker)
      blocks_to_copy: (src, dst) ...  copy-on-write before the step runs
      blocks_to_load: (block, bytes) ...  K/V read back from the prefix cache on disk, written first
      state_copies_before / _after: (src, dst) ...  a hybrid model's forks: state slots copied before / after
                                      the step (docs/hybrid-models.md); NewSequence.state_slot: its slot
      states_to_load: (slot, bytes) ...  a hybrid model's states read back from the prefix cache on disk,
                                      written into the slots first

``SequenceStep`` is the runner's full view of one scheduled sequence, rebuilt
from its state each step: the tensors are built from it as before the
record was incremental.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pagedllm.thinking_budget import ThinkingBudget


class NoTokenToSampleError(ValueError):
    """A sequence's own sampling settings leave no token it may sample next.

    ``allowed_token_ids`` minus what ``bad_words`` and ``min_tokens`` ban,
    intersected with a structured output's mask, can be empty at some step
    although it was not at the first (a ``choice`` that ends before
    ``min_tokens``). The runner raises it for that sequence alone (its
    ``StepResult.error``); the engine ends the sequence cleanly with finish
    reason ``"no_valid_token"``, not as a failed request.
    """

    def __init__(self, message: str = (
        "the request's allowed_token_ids, bad_words, min_tokens and structured output leave no token to sample"
    )) -> None:
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class LogitsRules:
    """A request's logits processors, resolved against the tokenizer and vocabulary (vLLM's order).

    Applied to a sampled row's logits before temperature and the filters, in
    this order: only ``allowed_token_ids`` kept (when non-empty); the last
    token of each ``bad_words`` sequence whose other tokens end the output,
    and ``min_tokens_banned`` while the output has fewer than ``min_tokens``
    tokens, set to -inf; ``logit_bias`` added; the repetition penalty over
    prompt and output tokens; then ``frequency_penalty * count +
    presence_penalty * (count > 0)`` subtracted, counting the output; last,
    a ``thinking`` budget that has run out forces the one token it owes.
    Built once per request (``engine/inputs.py``: ``logits_rules``).
    """

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()  # empty: every token allowed
    bad_words: tuple[tuple[int, ...], ...] = ()  # token-id sequences
    min_tokens: int = 0
    min_tokens_banned: tuple[int, ...] = ()  # EOS and stop_token_ids
    thinking: ThinkingBudget | None = None  # thinking_token_budget: forces the block's end, after all the others

    @property
    def has_penalties(self) -> bool:
        """Whether any of the repetition, frequency or presence penalties is on."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0

    @property
    def needs_prompt(self) -> bool:
        """Whether the runner needs the prompt's token ids (the repetition penalty counts them)."""
        return self.repetition_penalty != 1.0

    @property
    def needs_output(self) -> bool:
        """Whether the runner needs each row's output token ids."""
        return (self.has_penalties or self.min_tokens > 0 or any(len(w) > 1 for w in self.bad_words)
                or self.thinking is not None)


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """How a sequence's rows sample, resolved: ``temperature`` 0.0 means greedy.

    ``top_k`` <= 0 keeps the whole vocabulary; ``num_top_logprobs`` is how
    many top candidates to report with each sample (None: the sampled
    token's logprob only); ``rules``: the logits processors, None for none.
    """

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    num_top_logprobs: int | None
    rules: LogitsRules | None = None


class SequenceStep(NamedTuple):
    """One scheduled sequence's share of a step, in full: what the runner's tensors are built from.

    Not sent: the runner rebuilds it each step from its sequence state and
    the record's ``ScheduledStep`` (``runner/sequence_states.py``). A named
    tuple, as ``ScheduledStep``: one is built per sequence per step, and a
    frozen dataclass takes several times as long to build.
    """

    request_id: str
    num_computed_tokens: int
    token_ids: tuple[int, ...]
    block_table: tuple[int, ...]
    sampling: SamplingSpec
    uniforms: tuple[float, ...] = ()
    prompt_logprobs: int | None = None  # top candidates per scored prompt token; None: none scored
    prompt_targets: tuple[int, ...] = ()
    # filled only for sampled rows whose rules need them (``LogitsRules.needs_prompt``/``needs_output``)
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[tuple[int, ...], ...] = ()  # one per sampled row, as ``uniforms``
    # one per sampled row when the request has a structured-output constraint, else empty:
    # ceil(vocab / 32) int32 words (native byte order), bit i of word w allows token 32w+i; b"": all allowed
    token_bitmasks: tuple[bytes, ...] = ()
    # speculative decoding's verify step: the last ``num_draft_tokens`` tokens are drafts; every new
    # token's logits are sampled, ``uniforms`` holds one per draft and one for the token after them
    num_draft_tokens: int = 0
    # the sequence's prompt length: a longrope model rotates every token of a longer-than-original prompt's
    # sequence with its long factors (layers/rotary.py's longrope_rows)
    num_prompt_tokens: int = 0
    # a pooling request's prefill (pagedllm/pooling/): "LAST", "MEAN" or "CLS"; it samples nothing and its
    # pooled final hidden states come back in StepResult.pooled
    pooling: str | None = None
    # a LAST pooling prefill that asks for the LM head's logits of these token ids at its last prompt token
    # instead of the hidden state (a yes/no reranker, pooling/params.py)
    pooled_logit_ids: tuple[int, ...] = ()
    # a hybrid model's state slot (engine/state_slots.py); -1: the model has no state layers
    state_slot: int = -1

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Tokens in the context after this step."""
        return self.num_computed_tokens + len(self.token_ids)

    @property
    def num_samples(self) -> int:
        """Rows this step samples for the sequence (its forks included); 0 mid-prompt."""
        return len(self.uniforms)


@dataclass(frozen=True, slots=True)
class NewSequence:
    """A sequence the runner has not seen (or has forgotten at a preemption): its lasting data, once."""

    seq_id: int
    request_id: str
    token_ids: tuple[int, ...]  # tokens 0 .. the end of this step's share (prompt, then outputs)
    num_prompt_tokens: int
    block_table: tuple[int, ...]
    sampling: SamplingSpec
    state_slot: int = -1  # a hybrid model's state slot, held until the sequence finishes or is preempted


class ScheduledStep(NamedTuple):
    """One scheduled sequence's share of a step: what changed since the runner last saw it.

    A named tuple: one is built and pickled per sequence per step, and a
    frozen dataclass takes several times as long to build, and longer to pickle.
    """

    seq_id: int
    num_computed_tokens: int
    num_new_tokens: int
    new_token_ids: tuple[int, ...] = ()  # appended to the runner's tokens (through the end of this step's share)
    new_block_ids: tuple[int, ...] = ()  # appended to the runner's block table
    block_table: tuple[int, ...] | None = None  # replaces the runner's whole table (a block changed in place)
    uniforms: tuple[float, ...] = ()
    prompt_logprobs: int | None = None  # top candidates per scored prompt token; None: none scored
    prompt_targets: tuple[int, ...] = ()
    # one per sampled row when the request has a structured-output constraint, else empty (SequenceStep's)
    token_bitmasks: tuple[bytes, ...] = ()
    # the runner keeps only its first ``num_kept_tokens`` tokens before appending ``new_token_ids``:
    # drafts a verify step rejected (None: keep all)
    num_kept_tokens: int | None = None
    num_draft_tokens: int = 0  # a verify step: its last new tokens are drafts (SequenceStep's)
    pooling: str | None = None  # a pooling request's prefill (SequenceStep's)
    pooled_logit_ids: tuple[int, ...] = ()  # (SequenceStep's)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """Everything the runner computes one step from, given the sequences it already holds."""

    sequences: tuple[ScheduledStep, ...]
    blocks_to_copy: tuple[tuple[int, int], ...] = ()
    new_sequences: tuple[NewSequence, ...] = ()
    finished_seq_ids: tuple[int, ...] = ()
    # [start, stop) block ids whose K/V will never be read again: their pages go back to the OS
    release_blocks: tuple[tuple[int, int], ...] = ()
    # (block id, K/V bytes as the pool holds them) read from the prefix cache on disk (kv_disk/store.py)
    blocks_to_load: tuple[tuple[int, bytes], ...] = ()
    # a hybrid model's forks: (source, destination) state slots copied before the step runs, and after it
    state_copies_before: tuple[tuple[int, int], ...] = ()
    state_copies_after: tuple[tuple[int, int], ...] = ()
    # a hybrid model's states read back from the prefix cache on disk: (state slot, the slot's bytes)
    states_to_load: tuple[tuple[int, bytes], ...] = ()
