"""Formats where the whole reply is either calls or content (Llama 3's JSON, pythonic lists).

The reply is held (``_raw``) while it still reads as calls; at the first
character that breaks the format, all of it is content, unless a call has
already gone out (streamed), in which case the stream has ``diverged`` and
the rest is dropped.
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import ToolParser

TEXT = "text"  # not calls: everything is content
DROP = "drop"  # a sent call broke: the rest is dropped


class WholeReplyToolParser(ToolParser):
    """A parser whose subclass reads the reply as calls (``_calls``, each with ``sent``) until it is not."""

    def __init__(self, max_calls: int | None = None, *, buffered: bool = False) -> None:
        super().__init__(max_calls, buffered=buffered)
        self._raw: list[str] = []  # the reply so far, while it may still be content
        self._calls: list[Any] = []  # the calls read so far (StreamedCall or PieceCall)
        self._mode = TEXT

    def _not_calls(self, ch: str | None) -> None:
        """The reply stops reading as calls: all of it is content, unless a call already went out."""
        if any(call.sent for call in self._calls):
            self.diverged = True
            self._mode = DROP
            return
        self._mode = TEXT
        self._send_content("".join(self._raw) + (ch or ""))
        self._raw = []
