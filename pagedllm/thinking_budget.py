"""A thinking budget: after N reasoning tokens, the end of the reasoning block is forced.

A reasoning model writes its thinking between two markers (Qwen3's
``<think>`` ... ``</think>``, Granite's ``Here is my thought process:`` ...
``Here is my response:``). A request's ``thinking_token_budget`` (vLLM's
name) caps it: once the block has run ``budget`` tokens without closing,
the next tokens are forced to the closing marker and the text after it
(``</think>`` then a newline), and the model goes on writing its answer
from there. The budget counts the tokens after the opening marker, or from
the first output token when the prompt left the block open (templates that
open ``<think>`` for the model).

The markers are found as *text*, not as one token sequence: on a model where
``<think>`` is no special token (SmolLM2, Llama) the same text has many
tokenizations (``<`` ``think`` ``>``, ``<th`` ``ink>``, ``>\\n`` glued to the
next line...), and a prompt's end may have tokenized differently from the
marker alone. Each budget carries the text of the few tokens that can be part
of a marker (``marker_pieces``; every other token reads as a character no
marker holds), so finding a marker is a text search over those tokens.

Everything here is a function of the token ids so far, so the rule holds
across preemption, recomputation and speculative verification as the other
logits processors do (``runner/logits_processors.py`` applies it). No torch.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

_OTHER = "\0"  # what a token that can be no part of a marker reads as (no marker holds it)


def _overlaps(piece: str, marker: str) -> bool:
    """Whether text ``piece`` can be part of an occurrence of ``marker`` in a longer text."""
    if marker in piece or piece in marker:
        return True
    longest = min(len(piece), len(marker) - 1)
    for k in range(1, longest + 1):
        # the piece ends with the marker's start, or starts with the marker's end
        if piece[-k:] == marker[:k] or piece[:k] == marker[-k:]:
            return True
    return False


def marker_pieces(token_texts: Sequence[str], markers: Sequence[str]) -> dict[int, str]:
    """{token id: text} of every token whose text can be part of one of ``markers`` (``token_texts[id]``: its text)."""
    if any(not m for m in markers) or any(_OTHER in m for m in markers):
        raise ValueError("thinking markers must be non-empty text")
    chars = {c for m in markers for c in m}
    pieces: dict[int, str] = {}
    for token_id, text in enumerate(token_texts):
        if not text or (text[0] not in chars and text[-1] not in chars and not any(m in text for m in markers)):
            continue  # a piece overlapping a marker starts or ends with one of its characters, or holds it whole
        if any(_overlaps(text, m) for m in markers):
            pieces[token_id] = text
    return pieces


@dataclass(frozen=True, slots=True)
class ThinkingBudget:
    """A request's budget, its markers, and the text of the tokens that can spell them.

    Attributes:
        budget: reasoning tokens allowed (0: close the block at once).
        start: the opening marker's text.
        close: the closing marker's text (a block is closed once it appears).
        forced: the token ids forced when the budget runs out: the closing marker and the text after it.
        pieces: {token id: text} of the tokens that can be part of ``start`` or ``close`` (``marker_pieces``).
        opened: the prompt left the block open (the reasoning starts at the first output token).
    """

    budget: int
    start: str
    close: str
    forced: tuple[int, ...]
    pieces: Mapping[int, str] = field(compare=False, repr=False)
    opened: bool = False

    def __post_init__(self) -> None:
        if self.budget < 0:
            raise ValueError(f"thinking_token_budget must be >= 0, got {self.budget}")
        if not self.start or not self.close or not self.forced:
            raise ValueError("a thinking budget needs start and closing markers that tokenize to something")

    def with_prompt(self, prompt: Sequence[int]) -> ThinkingBudget:
        """The same budget, knowing whether ``prompt`` leaves the block open (an opening marker after the last close)."""
        text, _ = self._text(prompt, 0, len(prompt))
        opened = text.rfind(self.start) > text.rfind(self.close)
        return ThinkingBudget(self.budget, self.start, self.close, self.forced, self.pieces, opened)

    def forced_token(self, output: Sequence[int]) -> int | None:
        """The token the next position must be, given the output so far; None: the model chooses.

        The block begins after the token that completes the first opening
        marker of the output (or at 0 when the prompt opened it). If it has
        not closed within ``budget`` tokens, positions ``begin + budget``
        onward are ``forced``, one by one.
        """
        if len(output) < self.budget:
            return None  # cheap: nothing can be due yet
        if self.opened:
            begin = 0
        else:
            begin = self._after(output, self.start, 0, len(output))
            if begin < 0:
                return None  # no reasoning (yet)
        k = len(output) - begin - self.budget  # how far past the budget the next position is
        if k < 0 or k >= len(self.forced):
            return None
        if self._after(output, self.close, begin, begin + self.budget) >= 0:
            return None  # the model closed the block itself, within the budget
        return self.forced[k]

    def grammar_start(self, output: Sequence[int]) -> int | None:
        """Where a structured output's grammar begins in ``output``: after the block, once it is closed.

        Only for a block the prompt opened (``opened``; otherwise the output is
        not reasoning and the grammar holds from its first token: 0). The model
        closed it within the budget: the token after the closing marker; the
        budget ran out: the token after the forced ones; not closed yet: None
        (the reasoning is free text).
        """
        if not self.opened:
            return 0
        closed = self._after(output, self.close, 0, self.budget)
        if closed >= 0:
            return closed
        end = self.budget + len(self.forced)
        return end if len(output) >= end else None

    def _text(self, tokens: Sequence[int], lo: int, hi: int) -> tuple[str, list[int]]:
        """The marker-relevant text of ``tokens[lo:hi]`` and, per token, the character offset where it ends."""
        parts, ends, at = [], [], 0
        for t in tokens[lo:hi]:
            piece = self.pieces.get(t, _OTHER)
            parts.append(piece)
            at += len(piece)
            ends.append(at)
        return "".join(parts), ends

    def _after(self, tokens: Sequence[int], marker: str, lo: int, hi: int) -> int:
        """The index after the token that completes the first ``marker`` in ``tokens[lo:hi]``, or -1."""
        text, ends = self._text(tokens, lo, min(hi, len(tokens)))
        at = text.find(marker)
        if at < 0:
            return -1
        return lo + bisect_left(ends, at + len(marker)) + 1
