"""Python-syntax tool calls: ``[get_weather(city="Paris"), get_time(zone="CET")]``.

The format of Llama 3.2's and Llama 4's pythonic tool templates (and of
models tuned on them): the whole reply is a Python list of calls, each a
function name with keyword arguments whose values are literals (strings,
numbers, ``True``/``False``/``None``, lists, dicts and tuples of those).
Llama 4 may wrap it in ``<|python_start|>`` ... ``<|python_end|>``.

A reply is calls only if all of it is, as for Llama 3 JSON: each call is
read with Python's ``ast`` when its closing parenthesis arrives, and
anything else (text, a positional argument, a value that is not a literal,
a set, ``nan``) makes the whole reply content with no calls. The arguments
are the keyword arguments as a JSON object, in the order written.

Streamed, the reply is held back while it may still be calls; each call goes
out (its header, then its arguments) when it closes. Python's triple-quoted
strings are read only where they hold no quote or bracket.
"""

from __future__ import annotations

import ast
import json
import re

from pagedllm.entrypoints.openai.tool_parsers.pieces import PieceCall
from pagedllm.entrypoints.openai.tool_parsers.whole_reply import DROP, TEXT, WholeReplyToolParser

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_IDENT_START = re.compile(r"[A-Za-z_]")
_IDENT = re.compile(r"[A-Za-z0-9_]")
_OPENERS = {"(": ")", "[": "]", "{": "}"}

_LEAD = "lead"  # whitespace and the optional <|python_start|>, then '['
_LIST = "list"  # inside the list, between calls: whitespace, ',', ']' or a name
_NAME = "name"  # a call's name, up to '('
_CALL = "call"  # inside a call's parentheses
_TRAIL = "trail"  # after ']': whitespace and the optional <|python_end|>
_TEXT = TEXT  # not calls: everything is content
_DROP = DROP  # a sent call broke: the rest is dropped


def call_arguments(source: str) -> tuple[str, str]:
    """One call's text (``name(k=v, ...)``) -> (name, the JSON text of its keyword arguments).

    ValueError when it is not a call of a plain name with literal keyword arguments.
    """
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise ValueError(f"not Python: {e}") from None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError("not a call of a function name")
    if node.args or any(kw.arg is None for kw in node.keywords):
        raise ValueError("a tool call takes keyword arguments only")
    arguments = {}
    for kw in node.keywords:
        try:
            arguments[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
            raise ValueError(f"the argument {kw.arg!r} is not a literal") from e
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"an argument has no JSON value: {e}") from None
    return node.func.id, text


class PythonicToolParser(WholeReplyToolParser):
    """Tool calls as a Python list of calls (Llama 3.2/4 pythonic); vLLM's ``pythonic`` parser."""

    name = "pythonic"

    def __init__(self, max_calls: int | None = None, *, buffered: bool = False) -> None:
        super().__init__(max_calls, buffered=buffered)
        self._mode = _LEAD
        self._tag = ""  # the part of a python tag matched so far
        self._tagged = False
        self._source: list[str] = []  # the current call's text
        self._stack: list[str] = []  # open brackets inside the call
        self._quote = ""  # the open string's quote character
        self._escape = False
        self._calls: list[PieceCall] = []

    def _step(self, ch: str) -> None:
        if self._mode == _TEXT:
            self._send_content(ch)
            return
        if self._mode == _DROP:
            return
        try:
            self._calls_char(ch)
        except ValueError:
            self._not_calls(ch)
            return
        if not any(call.sent for call in self._calls):
            self._raw.append(ch)

    def _calls_char(self, ch: str) -> None:
        """One character while the reply still reads as calls; ValueError when it stops."""
        mode = self._mode
        if mode == _CALL:
            self._call_char(ch)
        elif mode == _NAME:
            self._source.append(ch)
            if ch == "(":
                self._mode, self._stack = _CALL, ["("]
            elif not _IDENT.match(ch):
                raise ValueError("not a function name")
        elif self._tag or (ch == "<" and mode in (_LEAD, _TRAIL)):
            self._tag_char(ch)
        elif ch.isspace():
            pass
        elif mode == _LEAD and ch == "[":
            self._mode = _LIST
        elif mode == _LIST and ch in ",]":
            if ch == "]":
                self._list_done()
        elif mode == _LIST and _IDENT_START.match(ch):
            self._mode, self._source = _NAME, [ch]
        else:
            raise ValueError("not a list of calls")

    def _tag_char(self, ch: str) -> None:
        self._tag += ch
        tag = PYTHON_START if self._mode == _LEAD else PYTHON_END
        if self._tagged or not tag.startswith(self._tag):
            raise ValueError("not a python tag")
        if self._tag == tag:
            self._tag, self._tagged = "", True

    def _call_char(self, ch: str) -> None:
        self._source.append(ch)
        if self._quote:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == self._quote:
                self._quote = ""
        elif ch in "'\"":
            self._quote = ch
        elif ch in _OPENERS:
            self._stack.append(ch)
        elif ch in ")]}":
            if _OPENERS[self._stack.pop()] != ch:
                raise ValueError("unbalanced brackets")
            if not self._stack:
                self._call_done()

    def _call_done(self) -> None:
        name, arguments = call_arguments("".join(self._source))
        call = PieceCall(self, name, early=not self.buffered)
        call.open()
        call.add(arguments)
        if not self.buffered:
            call.complete()
        self._calls.append(call)
        self._mode, self._source = _LIST, []

    def _list_done(self) -> None:
        if not self._calls:
            raise ValueError("an empty list is no call")
        self._mode, self._tagged = _TRAIL, False

    def _end(self) -> None:
        if self._mode == _TRAIL and not self._tag:
            for call in self._calls:
                call.complete()  # buffered: the reply turned out to be all calls
        elif self._mode not in (_TEXT, _DROP):
            self._not_calls(None)
