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

Everything here is a function of the token ids so far, so the rule holds
across preemption, recomputation and speculative verification as the other
logits processors do (``runner/logits_processors.py`` applies it). No torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def find(tokens: Sequence[int], needle: Sequence[int], start: int = 0, end: int | None = None) -> int:
    """Where ``needle`` first occurs in ``tokens[start:end]`` (an index into ``tokens``), or -1."""
    end = len(tokens) if end is None else min(end, len(tokens))
    n = len(needle)
    if n == 0:
        return -1
    first = needle[0]
    i = start
    while i + n <= end:
        try:
            i = tokens.index(first, i, end - n + 1)
        except ValueError:
            return -1
        if tuple(tokens[i : i + n]) == tuple(needle):
            return i
        i += 1
    return -1


def rfind(tokens: Sequence[int], needle: Sequence[int]) -> int:
    """Where ``needle`` last occurs in ``tokens``, or -1."""
    n = len(needle)
    for i in range(len(tokens) - n, -1, -1):
        if tuple(tokens[i : i + n]) == tuple(needle):
            return i
    return -1


@dataclass(frozen=True, slots=True)
class ThinkingBudget:
    """A request's budget resolved to token ids.

    Attributes:
        budget: reasoning tokens allowed (0: close the block at once).
        start: the opening marker's tokens.
        close: the closing marker's tokens (a block is closed once they appear).
        forced: what is forced when the budget runs out: ``close`` and the text after it.
        opened: the prompt left the block open (the reasoning starts at the first output token).
    """

    budget: int
    start: tuple[int, ...]
    close: tuple[int, ...]
    forced: tuple[int, ...]
    opened: bool = False

    def __post_init__(self) -> None:
        if self.budget < 0:
            raise ValueError(f"thinking_token_budget must be >= 0, got {self.budget}")
        if not self.start or not self.close or self.forced[: len(self.close)] != self.close:
            raise ValueError("a thinking budget needs start and closing markers that tokenize to something")

    def with_prompt(self, prompt: Sequence[int]) -> ThinkingBudget:
        """The same budget, knowing whether ``prompt`` leaves the block open (an opening marker after the last close)."""
        opened = rfind(prompt, self.start) > rfind(prompt, self.close)
        return ThinkingBudget(self.budget, self.start, self.close, self.forced, opened)

    def forced_token(self, output: Sequence[int]) -> int | None:
        """The token the next position must be, given the output so far; None: the model chooses.

        The block begins after the first opening marker of the output (or at
        0 when the prompt opened it). If it has not closed within ``budget``
        tokens, positions ``begin + budget`` onward are ``forced``, one by one.
        """
        if self.opened:
            begin = 0
        else:
            at = find(output, self.start)
            if at < 0:
                return None  # no reasoning (yet)
            begin = at + len(self.start)
        k = len(output) - begin - self.budget  # how far past the budget the next position is
        if k < 0 or k >= len(self.forced):
            return None
        if find(output, self.close, begin, begin + self.budget) >= 0:
            return None  # the model closed the block itself, within the budget
        return self.forced[k]
