"""Formats whose calls sit in blocks opened by a marker in the reply text (Hermes, Qwen3-Coder, Mistral).

The text outside the blocks is content: text that may be the start of the marker is held back until
it is not; once the reply has a call, a stretch of text between calls that
is only whitespace is dropped. Inside a block the subclass reads its own
syntax, one character at a time, and raises ValueError at the character
where the block stops being a call; the block's text is then content, from
its marker to where it broke, unless part of the call already went out
(streamed), in which case the stream has ``diverged`` and the rest of the
block is skipped.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

from pagedllm.entrypoints.openai.tool_parsers.base import ToolParser

_TEXT = "text"
_BLOCK = "block"
_DROP = "drop"


class TaggedToolParser(ToolParser):
    """Content with call blocks opened by ``start``; the subclass reads each block (``_block_char``)."""

    start: ClassVar[str] = ""
    # after a streamed call broke, text up to and including this marker is skipped (None: all the rest)
    drop_until: ClassVar[str | None] = None

    def __init__(self, max_calls: int | None = None, *, buffered: bool = False) -> None:
        super().__init__(max_calls, buffered=buffered)
        self._mode = _TEXT
        self._pending = ""  # text that may be the beginning of the marker
        self._live = False  # whether the current stretch of text has more than whitespace
        self._held = ""  # the stretch's whitespace, while it has nothing else
        self._block: list[str] = []  # the block's text since its marker, while it may still be content
        self._dropped = ""  # the tail of skipped text, to find drop_until

    def _step(self, ch: str) -> None:
        if self._mode == _TEXT:
            self._text_char(ch)
        elif self._mode == _DROP:
            end = self.drop_until
            if end is not None:
                self._dropped = (self._dropped + ch)[-len(end) :]
                if self._dropped == end:
                    self._mode, self._dropped = _TEXT, ""
        else:
            self._block.append(ch)
            try:
                self._block_char(ch)
            except ValueError:
                self._break_block(ch)

    def _text_char(self, ch: str) -> None:
        self._pending += ch
        if self._pending == self.start:
            self._pending = ""
            self._reopen_block()
            return
        while self._pending and not self.start.startswith(self._pending):
            self._content(self._pending[0])
            self._pending = self._pending[1:]

    def _content(self, text: str) -> None:
        """Text of the reply's content: sent, unless its stretch is only whitespace so far."""
        if self._live:
            self._send_content(text)
        elif text.isspace():
            self._held += text
        else:
            self._live = True
            self._send_content(self._held + text)
            self._held = ""

    def _reopen_block(self) -> None:
        """A marker was read (in the text, or right after a call's end where the format allows): a block begins."""
        self._mode, self._block = _BLOCK, [self.start]
        self._open_block()

    def _block_done(self) -> None:
        """The subclass completed the block's call(s): back to text, a new stretch."""
        self._mode, self._block = _TEXT, []
        self._live, self._held = False, ""

    def _break_block(self, ch: str | None) -> None:
        """The block is not a call: its text is content, unless part of it already went out as a call."""
        if self._block_sent():
            self.diverged = True
            self._mode, self._block, self._dropped = _DROP, [], ""
            self._live, self._held = False, ""
            return
        text = "".join(self._block if ch is None else self._block[:-1])
        self._mode, self._block = _TEXT, []
        self._content(text)
        if ch is not None:
            self._text_char(ch)  # the breaking character may begin a new block

    def _end(self) -> None:
        if self._mode == _BLOCK and not self._block_at_end():
            self._break_block(None)
        pending, self._pending = self._pending, ""
        for ch in pending:
            self._content(ch)
        if self._held and self.num_calls == 0:
            self._send_content(self._held)  # no calls: the text as it is
        self._held = ""

    @abstractmethod
    def _open_block(self) -> None:
        """The marker was read: a block begins."""

    @abstractmethod
    def _block_char(self, ch: str) -> None:
        """One character inside the block; ValueError when the block stops being a call."""

    @abstractmethod
    def _block_sent(self) -> bool:
        """Whether any call of the open block went out."""

    @abstractmethod
    def _block_at_end(self) -> bool:
        """The output ended inside the block: complete its call(s) and return True, or False if it is no call."""
