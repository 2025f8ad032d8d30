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

from pagedllm.entrypoints.openai.tool_parsers.base import StreamedCall, ToolParser

START = "<tool_call>"
END = "</tool_call>"
_JSON_WS = " \t\n\r"

# where the parser stands
_TEXT = "text"  # outside any block
_OPENED = "opened"  # after <tool_call>, before the JSON object
_OBJECT = "object"  # inside the JSON object
_CLOSING = "closing"  # after the object: whitespace, then </tool_call>
_DROP = "drop"  # a sent call broke: skip to its </tool_call>


class HermesToolParser(ToolParser):
    """Tool calls in ``<tool_call>`` blocks (Qwen2.5/Qwen3, Hermes); vLLM's ``hermes`` parser."""

    name = "hermes"

    def __init__(self, max_calls: int | None = None, *, buffered: bool = False) -> None:
        super().__init__(max_calls, buffered=buffered)
        self._mode = _TEXT
        self._pending = ""  # text that may be the beginning of <tool_call>
        self._live = False  # whether the current stretch of text has more than whitespace
        self._held = ""  # the stretch's whitespace, while it has nothing else
        self._block: list[str] = []  # the block's text since <tool_call>, while it may still be content
        self._close = ""  # the part of </tool_call> (or of a next <tool_call>) matched so far
        self._call: StreamedCall | None = None

    def _step(self, ch: str) -> None:
        mode = self._mode
        if mode == _TEXT:
            self._text_char(ch)
        elif mode == _DROP:
            self._close = (self._close + ch)[-len(END) :]
            if self._close == END:
                self._mode, self._close = _TEXT, ""
        else:
            try:
                self._block_char(ch)
            except ValueError:
                self._break_block(ch)

    def _text_char(self, ch: str) -> None:
        self._pending += ch
        if self._pending == START:
            self._pending = ""
            self._open_block()
            return
        # release what can no longer begin a tag, keep what still may
        while self._pending and not START.startswith(self._pending):
            self._content(self._pending[0])
            self._pending = self._pending[1:]

    def _open_block(self) -> None:
        self._mode, self._block, self._call = _OPENED, [START], None

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

    def _block_char(self, ch: str) -> None:
        """One character inside a block; ValueError when the block stops being a call."""
        mode = self._mode
        if mode == _OPENED:
            if ch == "{":
                self._call = StreamedCall(self, ("arguments",), early=not self.buffered)
                self._call.feed(ch)
                self._mode = _OBJECT
            elif ch not in _JSON_WS:
                raise ValueError("a tool call block must hold a JSON object")
        elif mode == _OBJECT:
            self._call.feed(ch)
            if self._call.scanner.done:
                self._mode, self._close = _CLOSING, ""
        elif self._close or ch not in _JSON_WS:  # _CLOSING
            self._close += ch
            if self._close in (END, START):
                self._block_complete()
                if self._close == START:  # the next call began without closing this one: taken as closed
                    self._open_block()
                self._close = ""
                return
            if not (END.startswith(self._close) or START.startswith(self._close)):
                raise ValueError(f"text after the tool call's JSON, before {END}")
        self._block.append(ch)

    def _block_complete(self) -> None:
        self._call.complete()
        # the call ends the stretch of text before it; whitespace-only stretches go
        self._mode, self._block, self._call = _TEXT, [], None
        self._live, self._held = False, ""

    def _break_block(self, ch: str | None) -> None:
        """The block is not a call: its text is content, unless part of it already went out as a call."""
        call = self._call
        self._call, self._close = None, ""
        if call is not None and call.sent:
            self.diverged = True
            self._mode, self._block = _DROP, []
            self._live, self._held = False, ""
            if ch is not None:
                self._step(ch)
            return
        block, self._block, self._mode = "".join(self._block), [], _TEXT
        self._content(block)
        if ch is not None:
            self._text_char(ch)  # the breaking character may begin a new block

    def _end(self) -> None:
        if self._mode == _CLOSING:
            self._block_complete()  # a complete object without (all of) </tool_call>
        elif self._mode in (_OPENED, _OBJECT):
            self._break_block(None)
        pending, self._pending = self._pending, ""
        for ch in pending:
            self._content(ch)
        if self._held and self.num_calls == 0:
            self._send_content(self._held)  # no calls: the text as it is
        self._held = ""
