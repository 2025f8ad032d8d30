"""The proposer interface: what the ``Speculator`` asks of a draft method (ngram, suffix), so they are interchangeable."""

from __future__ import annotations

from typing import Protocol


class ProposerSequence(Protocol):
    """What a proposer reads of a sequence (``engine/sequence.py``'s; this package sits below the engine)."""

    token_ids: list[int]
    num_prompt_tokens: int
    num_draft_tokens: int  # the last ones of token_ids are drafts (only while a step verifies them)


class Proposer(Protocol):
    """Drafts tokens for a sequence; may keep state per sequence, and across sequences."""

    def propose(self, seq: ProposerSequence, max_num_tokens: int) -> list[int]:
        """At most ``max_num_tokens`` (>= 1) draft tokens to follow ``seq``'s tokens; [] for none."""
        ...

    def finish(self, seq: ProposerSequence) -> None:
        """``seq`` is done (finished or aborted): forget its state, learn from its output if the method does."""
        ...
