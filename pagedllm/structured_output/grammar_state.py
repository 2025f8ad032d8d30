"""The grammar state of one constrained request: a matcher per sequence, in step with its output tokens.

``RequestGrammar`` is owned by the engine's ``Request``. A matcher follows
its sequence's output, whatever happened to it: a fork of ``n > 1`` gets its
own matcher, replayed from the tokens it has; after a preemption the
recomputed sequence keeps its tokens, so its matcher stands; a sequence with
fewer tokens than its matcher accepted rolls it back.

The engine hands it its sequences (anything with the ``GrammarSequence``
fields) and passes the masks it returns, plain bytes, to the runner
(``SequenceStep.token_bitmasks``); xgrammar (and torch with it) is imported
only when the first matcher is made, so the bookkeeping stays torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from pagedllm.structured_output.lazy_xgrammar import xgrammar

if TYPE_CHECKING:
    import xgrammar as xgr


class GrammarSequence(Protocol):
    """What a matcher reads of a sequence (``engine.sequence.Sequence`` has it; this package never imports the engine)."""

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def num_output_tokens(self) -> int: ...


class GrammarRejectedError(ValueError):
    """A sampled token the grammar does not accept (the mask was not applied, or nothing was allowed)."""


class RequestGrammar:
    """The grammar state of one constrained request: a matcher per sequence, keyed by sequence id.

    Each matcher remembers how many output tokens it accepted; ``bitmask``
    and ``accept`` first bring it in step with the sequence's output (a new
    fork replays its tokens; fewer tokens than accepted roll back).

    ``starts_at``: where in an output the grammar begins (None: not yet, every
    token allowed); a thinking budget's ``grammar_start``, so that a model
    thinks freely and the grammar holds from the end of its reasoning block.
    None: from the first output token.
    """

    def __init__(
        self, compiled: xgr.CompiledGrammar, vocab_size: int,
        starts_at: Callable[[Sequence[int]], int | None] | None = None,
    ) -> None:
        self.compiled = compiled
        self.vocab_size = vocab_size
        self.starts_at = starts_at
        self._matchers: dict[int, xgr.GrammarMatcher] = {}
        self._accepted: dict[int, int] = {}  # output tokens accepted, counted from the grammar's start
        self._starts: dict[int, int] = {}  # where each sequence's matcher began
        # one row, reused: fill_next_token_bitmask writes into it
        self._row = np.empty((1, xgrammar().get_bitmask_shape(1, vocab_size)[1]), dtype=np.int32)  # [1, ceil(vocab / 32)]

    def start(self, seq: GrammarSequence, num_output: int | None = None) -> int | None:
        """Where the grammar begins in the sequence's first ``num_output`` output tokens (default: all); None: not yet."""
        if self.starts_at is None:
            return 0
        num_output = seq.num_output_tokens if num_output is None else num_output
        return self.starts_at(seq.token_ids[seq.num_prompt_tokens : seq.num_prompt_tokens + num_output])

    def _synced(self, seq: GrammarSequence, num_output: int | None = None) -> xgr.GrammarMatcher:
        """The sequence's matcher, having accepted exactly its first ``num_output`` output tokens (default: all;
        fewer leave out the drafts a sequence holds for a verify step), from where the grammar begins
        (the caller checked it has begun)."""
        num_output = seq.num_output_tokens if num_output is None else num_output
        begin = self.start(seq, num_output) or 0
        if self._starts.get(seq.seq_id, begin) != begin:
            self.release(seq.seq_id)  # rolled back before the grammar's start: a new matcher
        matcher = self._matchers.get(seq.seq_id)
        if matcher is None:
            matcher = self._matchers[seq.seq_id] = xgrammar().GrammarMatcher(self.compiled)
            self._accepted[seq.seq_id] = 0
            self._starts[seq.seq_id] = begin
        accepted = self._accepted[seq.seq_id]
        if accepted > num_output - begin:
            matcher.rollback(accepted - (num_output - begin))
            accepted = num_output - begin
        first = seq.num_prompt_tokens + begin
        for token in seq.token_ids[first + accepted : seq.num_prompt_tokens + num_output]:
            if not matcher.accept_token(token):
                raise GrammarRejectedError(f"the output's token {token} does not follow the structured output grammar")
            accepted += 1
        self._accepted[seq.seq_id] = accepted
        return matcher

    def bitmask(self, seq: GrammarSequence) -> bytes:
        """The packed allowed-token mask of the sequence's next token: int32 words, bit i of word w is token 32w+i.

        Empty when every token is allowed (nothing to apply), as before the grammar begins.
        """
        if self.start(seq) is None:
            return b""
        matcher = self._synced(seq)
        if not matcher.fill_next_token_bitmask(self._row, 0):
            return b""
        return self._row.tobytes()

    def allows_first(self, token_ids: Iterable[int]) -> bool:
        """Whether the grammar lets an output start with any of ``token_ids`` (a fresh matcher's mask)."""
        matcher = xgrammar().GrammarMatcher(self.compiled)
        row = np.empty_like(self._row)
        if not matcher.fill_next_token_bitmask(row, 0):
            return True  # every token is allowed
        words = row[0].view(np.uint32)  # bit i of word w: token 32w + i
        return any(t < self.vocab_size and (int(words[t >> 5]) >> (t & 31)) & 1 for t in token_ids)

    def _walk_drafts(self, seq: GrammarSequence, num_output: int, drafts: list[int]) -> list[bytes]:
        """The masks plain decoding would apply at each draft position: mask j is the grammar's after drafts
        0..j-1. Stops at the first draft the grammar rejects (or after its stop token), so ``len(masks) - 1``
        drafts are valid and the last mask is that of the token after them. The matcher is rolled back."""
        matcher = self._synced(seq, num_output)
        masks: list[bytes] = []
        walked = 0
        for draft in drafts:
            if matcher.is_terminated():
                break  # a draft after the grammar's stop token: the output ends at that token anyway
            masks.append(self._next_mask(matcher))
            if not matcher.accept_token(draft):
                break
            walked += 1
        if len(masks) == walked:
            # the row after the last valid draft; after the stop token it is never appended (b"": any)
            masks.append(b"" if matcher.is_terminated() else self._next_mask(matcher))
        if walked:
            matcher.rollback(walked)
        return masks

    def _next_mask(self, matcher: xgr.GrammarMatcher) -> bytes:
        """The packed mask of ``matcher``'s next token; b"" when every token is allowed."""
        return self._row.tobytes() if matcher.fill_next_token_bitmask(self._row, 0) else b""

    def valid_drafts(self, seq: GrammarSequence, drafts: list[int]) -> list[int]:
        """``drafts`` (proposed after ``seq``'s tokens, not yet appended) cut before the first the grammar rejects."""
        return drafts[: len(self._walk_drafts(seq, seq.num_output_tokens, drafts)) - 1]

    def verify_bitmasks(self, seq: GrammarSequence, num_drafts: int) -> tuple[bytes, ...]:
        """The ``num_drafts + 1`` masks of a verify step of ``seq``, whose last ``num_drafts`` tokens are drafts
        the grammar allows (``valid_drafts`` cut them): row j's is the grammar's after drafts 0..j-1."""
        drafts = list(seq.token_ids[len(seq.token_ids) - num_drafts :])
        masks = self._walk_drafts(seq, seq.num_output_tokens - num_drafts, drafts)
        if len(masks) != num_drafts + 1:
            raise ValueError(f"sequence {seq.seq_id}: the grammar rejects draft {len(masks) - 1} of {num_drafts}")
        return tuple(masks)

    def accept(self, seq: GrammarSequence, token_id: int) -> bool:
        """Advance the sequence's matcher by its new ``token_id``, sampled after its current tokens.

        Returns whether the grammar is now terminated (it accepted a stop
        token at its end: the output is complete). GrammarRejectedError
        when the grammar does not allow the token. Before the grammar begins
        the token is not its business (False).
        """
        if self.start(seq) is None:
            return False
        matcher = self._synced(seq)
        if matcher.is_terminated() or not matcher.accept_token(token_id):
            raise GrammarRejectedError(f"the sampled token {token_id} does not follow the structured output grammar")
        self._accepted[seq.seq_id] += 1
        return matcher.is_terminated()

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence's matcher."""
        self._matchers.pop(seq_id, None)
        self._accepted.pop(seq_id, None)
        self._starts.pop(seq_id, None)
