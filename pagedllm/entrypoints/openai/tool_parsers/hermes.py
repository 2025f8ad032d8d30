"""Hermes-style tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The format of Qwen2.5, Qwen3, Hermes 2/3 and many fine-tunes: any number of
call blocks, with text before, between or after them. What is returned:

- each well-formed block is a call: its name, and the raw text of its
  ``arguments`` object (``{}`` when it has none). A block may lack its
  ``</tool_call>`` when it is the last (the model stopped right after the
  JSON, as vLLM allows) or when the next ``<tool_call>`` follows its JSON;
- a block that is not a call (invalid JSON, no name, arguments that are not
  an object, text between the JSON and ``</tool_call>``) stays in the
  content, character for character, from its ``<tool_call>`` to where it
  broke; reading goes on from there as plain text;
- the content is the text outside the calls. Once the reply has a call, a
  stretch of text between calls that is only whitespace (the newlines
  between blocks) is dropped; with no call, the text is returned as is.

Streamed, text that could be the start of ``<tool_call>`` is held back until
it is not, so no partial markup reaches the content, and whitespace is held
until the stretch it belongs to turns out to have something else in it.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import StreamedCall
from pagedllm.entrypoints.openai.tool_parsers.tagged import TaggedToolParser

START = "<tool_call>"
END = "</tool_call>"
_JSON_WS = " \t\n\r"

# where the parser stands inside a block (the text around blocks is TaggedToolParser's)
_OPENED = "opened"  # after <tool_call>, before the JSON object
_OBJECT = "object"  # inside the JSON object
_CLOSING = "closing"  # after the object: whitespace, then </tool_call>


class HermesToolParser(TaggedToolParser):
    """Tool calls in ``<tool_call>`` blocks (Qwen2.5/Qwen3, Hermes); vLLM's ``hermes`` parser."""

    name = "hermes"
    start = START
    drop_until = END

    def __init__(self, max_calls: int | None = None, *, buffered: bool = False) -> None:
        super().__init__(max_calls, buffered=buffered)
        self._where = _OPENED
        self._close = ""  # the part of </tool_call> (or of a next <tool_call>) matched so far
        self._call: StreamedCall | None = None

    def _open_block(self) -> None:
        self._where, self._close, self._call = _OPENED, "", None

    def _block_char(self, ch: str) -> None:
        """One character inside a block; ValueError when the block stops being a call."""
        where = self._where
        if where == _OPENED:
            if ch == "{":
                self._call = StreamedCall(self, ("arguments",), early=not self.buffered)
                self._call.feed(ch)
                self._where = _OBJECT
            elif ch not in _JSON_WS:
                raise ValueError("a tool call block must hold a JSON object")
        elif where == _OBJECT:
            self._call.feed(ch)
            if self._call.scanner.done:
                self._where, self._close = _CLOSING, ""
        elif self._close or ch not in _JSON_WS:  # _CLOSING
            self._close += ch
            if self._close in (END, START):
                reopen = self._close == START
                self._complete()
                if reopen:  # the next call began without closing this one: taken as closed
                    self._reopen_block()
                return
            if not (END.startswith(self._close) or START.startswith(self._close)):
                raise ValueError(f"text after the tool call's JSON, before {END}")

    def _complete(self) -> None:
        self._call.complete()
        self._call, self._close = None, ""
        self._block_done()  # the call ends the stretch of text before it; whitespace-only stretches go

    def _block_sent(self) -> bool:
        return self._call is not None and self._call.sent

    def _block_at_end(self) -> bool:
        if self._where == _CLOSING and self._call is not None:
            self._complete()  # a complete object without (all of) </tool_call>
            return True
        return False
