"""What every tool parser shares: the call and delta types, and the streaming contract.

A parser reads one choice's output text and splits it into the reply's
``content`` and its ``tool_calls``. The same object serves both answers:

- streamed: ``feed(new_text)`` after each step and ``finish()`` after the
  last, each returning the ``DeltaMessage`` to send (or None);
- whole: ``Parser.extract(text)`` feeds everything at once and collects it.

Both run the same character-level state machine, so a stream cut anywhere
reassembles into the non-streamed answer. The one difference is when a call
is *committed*: a stream sends a call's header (id, name) as soon as its name
is known and its arguments have begun, so that the arguments can follow in
pieces; ``extract`` commits a call only once it has closed. If the model's
JSON breaks after a streamed call began, the stream cannot take it back: the
call stays with the arguments sent so far (``diverged`` is set) while
``extract`` returns that text as content. Only malformed or truncated output
differs this way.
"""

from __future__ import annotations

import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pagedllm.entrypoints.openai.tool_parsers.json_scan import CallScanner

_ID_ALPHABET = string.ascii_letters + string.digits


def new_tool_call_id() -> str:
    """A fresh call id in OpenAI's shape: ``call_`` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    """One function call of a reply, as an item of OpenAI's ``message.tool_calls``.

    ``arguments`` is the JSON text of the arguments object, as the model
    wrote it (OpenAI's clients ``json.loads`` it).
    """

    name: str
    arguments: str
    id: str = field(default_factory=new_tool_call_id)

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's JSON: ``{"id", "type": "function", "function": {"name", "arguments"}}``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """A piece of a streamed call: the first piece of each call has ``id`` and ``name``, later ones only arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's ``delta.tool_calls[i]``."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index, "id": self.id, "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class DeltaMessage:
    """What one streamed chunk of a choice carries: new reasoning, new content, pieces of calls.

    ``reasoning_content`` is set only by a reasoning parser (``reasoning_parsers/``).
    """

    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    reasoning_content: str | None = None

    @property
    def empty(self) -> bool:
        """Whether the delta carries nothing."""
        return self.content is None and self.reasoning_content is None and not self.tool_calls

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's ``delta`` (without ``role``, which the first chunk adds)."""
        out: dict[str, Any] = {}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.content is not None:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = [d.to_dict() for d in self.tool_calls]
        return out


@dataclass(frozen=True)
class ExtractedToolCalls:
    """A whole reply split into content and calls.

    ``content`` is None when there are calls and no text besides them; with
    no calls it is the text (``""`` for an empty reply). ``reasoning_content``:
    what a reasoning parser split off (None when there was none).
    """

    content: str | None
    tool_calls: list[ToolCall]
    reasoning_content: str | None = None

    @property
    def tools_called(self) -> bool:
        """Whether the reply holds at least one call."""
        return bool(self.tool_calls)


def assemble_deltas(deltas: Iterable[DeltaMessage | None]) -> ExtractedToolCalls:
    """Put streamed deltas back together the way a client does: content joined, calls joined by index."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]
    for delta in deltas:
        if delta is None:
            continue
        if delta.reasoning_content is not None:
            reasoning.append(delta.reasoning_content)
        if delta.content is not None:
            content.append(delta.content)
        for piece in delta.tool_calls:
            if piece.id is not None:
                if piece.index in calls:
                    raise ValueError(f"tool call {piece.index} was opened twice")
                calls[piece.index] = [piece.id, piece.name or "", ""]
            elif piece.index not in calls:
                raise ValueError(f"arguments of tool call {piece.index} came before its header")
            calls[piece.index][2] += piece.arguments
    tool_calls = [ToolCall(name, args, id_) for _, (id_, name, args) in sorted(calls.items())]
    text = "".join(content)
    return ExtractedToolCalls(text if text or not tool_calls else None, tool_calls,
                              "".join(reasoning) if reasoning else None)


class DeltaSender(ABC):
    """What a streaming output parser keeps and sends: the delta being built, the calls sent so far.

    Shared by the tool parsers (``ToolParser``) and the reasoning parsers
    (``reasoning_parsers/base.py``): each step's pieces (content, a call's
    header, its argument fragments) accumulate in one ``DeltaMessage`` that
    ``_take`` hands out. ``max_calls``: at most this many call headers are
    sent; later calls are dropped (None: no limit).
    """

    def __init__(self, max_calls: int | None = None) -> None:
        if max_calls is not None and (isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1):
            raise ValueError(f"max_calls must be a positive integer or None, got {max_calls!r}")
        self.max_calls = max_calls
        self.num_calls = 0
        self._out = DeltaMessage()
        self._finished = False

    def finish(self) -> DeltaMessage | None:
        """The output has ended: what was held back, resolved; the last delta, or None."""
        if self._finished:
            raise ValueError("finish() called twice")
        self._finished = True
        self._end()
        return self._take()

    @abstractmethod
    def _end(self) -> None:
        """Resolve whatever is pending at the end of the output."""

    def _check_open(self) -> None:
        if self._finished:
            raise ValueError("feed() after finish()")

    def _take(self) -> DeltaMessage | None:
        out, self._out = self._out, DeltaMessage()
        return None if out.empty else out

    def _send_content(self, text: str) -> None:
        if text:
            self._out.content = (self._out.content or "") + text

    def _open_call(self, name: str) -> int | None:
        """Send a call's header; its index, or None when ``max_calls`` are already out (the call is dropped)."""
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            return None
        index = self.num_calls
        self.num_calls += 1
        self._out.tool_calls.append(ToolCallDelta(index, new_tool_call_id(), name))
        return index

    def _send_arguments(self, index: int, piece: str) -> None:
        if not piece:
            return
        calls = self._out.tool_calls
        if calls and calls[-1].index == index:
            calls[-1].arguments += piece  # one piece per call and chunk
        else:
            calls.append(ToolCallDelta(index, arguments=piece))


class ToolParser(DeltaSender):
    """Splits one choice's output into content and tool calls, streamed or whole.

    Args:
        max_calls: keep at most this many calls (1 when the request sets
            ``parallel_tool_calls: false``); later complete calls are dropped.
        buffered: commit calls only once they close (``extract`` sets it);
            a stream leaves it False.

    One parser per choice: ``feed`` the choice's new text after every step,
    ``finish`` once after the last. ``num_calls`` counts the calls sent so
    far (a finish reason of ``tool_calls`` needs at least one).
    """

    name: ClassVar[str] = ""
    # whether the parser takes the request's tools (``tools=``, to type values by their schemas)
    needs_tools: ClassVar[bool] = False

    def __init__(self, max_calls: int | None = None, *, buffered: bool = False) -> None:
        super().__init__(max_calls)
        self.buffered = buffered
        self.diverged = False  # a sent call broke: extract() would return its text as content

    def feed(self, text: str) -> DeltaMessage | None:
        """Read the choice's next text; the delta to send, or None when nothing is ready yet."""
        self._check_open()
        for ch in text:
            self._step(ch)
        return self._take()

    @classmethod
    def extract(cls, text: str, max_calls: int | None = None, **kwargs: Any) -> ExtractedToolCalls:
        """Split a whole output into content and calls (the non-streamed answer)."""
        parser = cls(max_calls=max_calls, buffered=True, **kwargs)
        return assemble_deltas([parser.feed(text), parser.finish()])

    @abstractmethod
    def _step(self, ch: str) -> None:
        """Read one character of output."""


class StreamedCall:
    """A call object being read, sent when its parser's commit rule allows.

    ``early``: send the header as soon as the name is known and the
    arguments have begun (streaming); otherwise only at ``complete()``.
    ``sent`` tells whether any of it went out, which decides what a
    failure means: text to return as content, or a call that diverged.
    """

    def __init__(self, parser: ToolParser, args_keys: tuple[str, ...], early: bool) -> None:
        self.scanner = CallScanner(args_keys)
        self._parser = parser
        self._early = early
        self._committed = False
        self.index: int | None = None
        self._sent = 0  # characters of the arguments already sent

    @property
    def sent(self) -> bool:
        """Whether the header went out (a dropped call, past max_calls, never goes out)."""
        return self.index is not None

    def feed(self, ch: str) -> None:
        """The object's next character (ValueError when it stops being a call), sent if due."""
        self.scanner.feed(ch)
        if self._early:
            self._flush()

    def complete(self) -> None:
        """The call is whole: commit it if it was not yet, and send the rest of its arguments."""
        self._flush(final=True)

    def _flush(self, final: bool = False) -> None:
        s = self.scanner
        if not self._committed:
            if s.name is None or not (final or s.args_started or s.done):
                return
            self._committed = True
            self.index = self._parser._open_call(s.name)
        if self.index is not None:
            piece = s.arguments_from(self._sent)
            self._parser._send_arguments(self.index, piece)
            self._sent += len(piece)
