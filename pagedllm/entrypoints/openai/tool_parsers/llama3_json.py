"""Llama 3 JSON tool calls: ``{"name": ..., "parameters": {...}}``.

The format Llama 3.1/3.2/3.3's chat templates ask for with JSON-based tool
calling: the whole reply is the call, optionally after ``<|python_tag|>``
(a special token, so it is only in the text when special tokens are kept);
several calls are separated by ``;``. As vLLM's ``llama3_json`` parser, the
arguments may also be under ``arguments``.

A reply is calls only if all of it is: leading whitespace, the optional tag,
then call objects separated by ``;`` (a trailing ``;`` and whitespace are
allowed). Anything else, a reply that is not JSON or a JSON object that is
not a call, is returned whole as content with no calls.

Streamed, the reply is held back while it may still be a call, and sent as
content at the first character that shows it is not.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import StreamedCall
from pagedllm.entrypoints.openai.tool_parsers.whole_reply import DROP, TEXT, WholeReplyToolParser

PYTHON_TAG = "<|python_tag|>"
_JSON_WS = " \t\n\r"
_ARGS_KEYS = ("parameters", "arguments")

_LEAD = "lead"  # before the first object: whitespace and the optional tag
_OBJECT = "object"
_AFTER = "after"  # after an object: whitespace, ';' or the end
_NEXT = "next"  # after ';': whitespace, another object or the end
_TEXT = TEXT  # not calls: everything is content
_DROP = DROP  # a sent call broke: the rest is dropped


class Llama3JsonToolParser(WholeReplyToolParser):
    """Tool calls as Llama 3's JSON (``name`` and ``parameters``, ``;`` between calls); vLLM's ``llama3_json``."""

    name = "llama3_json"

    def __init__(self, max_calls: int | None = None, *, buffered: bool = False) -> None:
        super().__init__(max_calls, buffered=buffered)
        self._mode = _LEAD
        self._tag = ""  # the part of <|python_tag|> matched so far
        self._tagged = False
        self._calls: list[StreamedCall] = []

    def _step(self, ch: str) -> None:
        mode = self._mode
        if mode == _TEXT:
            self._send_content(ch)
            return
        if mode == _DROP:
            return
        try:
            self._calls_char(ch)
        except ValueError:
            self._not_calls(ch)
            return
        if not self._calls or not self._calls[0].sent:
            self._raw.append(ch)  # nothing went out yet: the reply may still turn out to be content

    def _calls_char(self, ch: str) -> None:
        """One character while the reply still reads as calls; ValueError when it stops."""
        mode = self._mode
        if mode == _OBJECT:
            call = self._calls[-1]
            call.feed(ch)
            if call.scanner.done:
                self._mode = _AFTER
        elif mode == _LEAD and (self._tag or (ch == "<" and not self._tagged)):
            self._tag += ch
            if not PYTHON_TAG.startswith(self._tag):
                raise ValueError("not the python tag")
            if self._tag == PYTHON_TAG:
                self._tag, self._tagged = "", True
        elif ch in _JSON_WS:
            pass
        elif ch == "{" and mode in (_LEAD, _NEXT):
            self._calls.append(StreamedCall(self, _ARGS_KEYS, early=not self.buffered))
            self._calls[-1].feed(ch)
            self._mode = _OBJECT
        elif ch == ";" and mode == _AFTER:
            self._mode = _NEXT
        else:
            raise ValueError("not a call")

    def _end(self) -> None:
        if self._mode in (_AFTER, _NEXT):
            for call in self._calls:
                call.complete()
        elif self._mode in (_LEAD, _OBJECT):
            self._not_calls(None)  # no call, or one cut short
