"""A response's ``output`` items built from the parsed deltas of one choice, with the stream events on the way.

The chat route's parsers (``reasoning_parsers/``, ``tool_parsers/``) turn
each step's new text into a ``DeltaMessage``: reasoning, content, pieces of
calls. Here those pieces become Responses items, in the order they come:

    reasoning     -> a ``reasoning`` item  (``response.reasoning_text.delta``)
    content       -> a ``message`` item    (``response.output_text.delta``)
    a call header -> a ``function_call`` item, then its ``response.function_call_arguments.delta``

Each item opens with ``response.output_item.added`` (and, for reasoning and
messages, ``response.content_part.added``) and closes with the matching
``.done`` events when the next kind of item starts or the output ends. Text
that is only whitespace does not open a message on its own (a model's
newline between two calls is not a reply); an output with no item at all
still gets its (empty) message. The non-streamed answer is the same builder's
items, its events unread, so both answers hold the same output.
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.response_items import (
    function_call_item,
    new_item_id,
    output_message,
    output_text_part,
    reasoning_item,
)
from pagedllm.entrypoints.openai.tool_parsers.base import DeltaMessage


class ResponseOutputBuilder:
    """The output items of one response and the events that build them (without sequence numbers).

    ``add(delta, num_tokens)`` after each step, ``finish(incomplete)`` once;
    ``take_events()`` hands out what happened since the last call.
    ``num_reasoning_tokens``: the tokens of steps whose text was all reasoning.
    """

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.num_reasoning_tokens = 0
        self._events: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written
        self._text = ""  # the open item's text (or a call's arguments)
        self._pending_space = ""  # whitespace content not yet in a message
        self._calls: dict[int, dict[str, Any]] = {}  # parser call index -> its item

    def take_events(self) -> list[dict[str, Any]]:
        """The events since the last call, in order."""
        out, self._events = self._events, []
        return out

    def add(self, delta: DeltaMessage | None, num_tokens: int = 0) -> None:
        """One step's parsed output (None: nothing came out), made of ``num_tokens`` tokens."""
        if delta is None:
            return
        if delta.reasoning_content and delta.content is None and not delta.tool_calls:
            self.num_reasoning_tokens += num_tokens
        if delta.reasoning_content:
            self._reasoning(delta.reasoning_content)
        if delta.content:
            self._content(delta.content)
        for piece in delta.tool_calls:
            if piece.id is not None:
                self._open_call(piece.index, piece.id, piece.name or "")
            self._arguments(piece.index, piece.arguments)

    def finish(self, incomplete: bool = False) -> None:
        """The output ended (``incomplete``: cut by ``max_output_tokens``); close the item being written."""
        if not self.items:
            self._start("message")
            self._text = self._pending_space
            if self._text:
                self._delta_event("response.output_text.delta", self._text)
        self._close("incomplete" if incomplete else "completed")

    # --- the three kinds of item ------------------------------------------------------------

    def _reasoning(self, text: str) -> None:
        if not self._is_open("reasoning"):
            self._start("reasoning")
        self._text += text
        self._delta_event("response.reasoning_text.delta", text)

    def _content(self, text: str) -> None:
        if not self._is_open("message"):
            if not (self._pending_space + text).strip():
                self._pending_space += text
                return
            text, self._pending_space = self._pending_space + text, ""
            self._start("message")
        self._text += text
        self._delta_event("response.output_text.delta", text)

    def _open_call(self, index: int, call_id: str, name: str) -> None:
        self._close("completed")
        item = function_call_item(new_item_id("fc"), call_id, name, "", "in_progress")
        self._calls[index] = item
        self._added(item)

    def _arguments(self, index: int, piece: str) -> None:
        item = self._calls.get(index)
        if not piece or item is None:
            return
        if item is self._open:
            self._text += piece
        else:  # a piece for a call already closed (no parser sends one): kept, not streamed again
            item["arguments"] += piece
            return
        self._events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                             "output_index": len(self.items) - 1, "delta": piece})

    # --- opening and closing ----------------------------------------------------------------

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self._open["type"] == kind

    def _start(self, kind: str) -> None:
        self._close("completed")
        if kind == "message":
            item = output_message(new_item_id("msg"), "", "in_progress")
            item["content"] = []
            part = output_text_part("")
        else:
            item = reasoning_item(new_item_id("rs"), "", "in_progress")
            item["content"] = []
            part = {"type": "reasoning_text", "text": ""}
        self._added(item)
        self._events.append({"type": "response.content_part.added", "item_id": item["id"],
                             "output_index": len(self.items) - 1, "content_index": 0, "part": part})

    def _added(self, item: dict[str, Any]) -> None:
        self.items.append(item)
        self._open = item
        self._text = ""
        self._events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                             "item": dict(item)})

    def _delta_event(self, kind: str, text: str) -> None:
        item = self._open
        event = {"type": kind, "item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0,
                 "delta": text}
        if kind == "response.output_text.delta":
            event["logprobs"] = []
        self._events.append(event)

    def _close(self, status: str) -> None:
        """Close the open item: its ``done`` events, with its whole text, and its final state."""
        item = self._open
        if item is None:
            return
        self._open = None
        index = self.items.index(item)
        base = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            item["arguments"] = self._text
            self._events.append({"type": "response.function_call_arguments.done", **base, "name": item["name"],
                                 "arguments": self._text})
        else:
            if item["type"] == "message":
                part = output_text_part(self._text)
                self._events.append({"type": "response.output_text.done", **base, "content_index": 0,
                                     "text": self._text, "logprobs": []})
            else:
                part = {"type": "reasoning_text", "text": self._text}
                self._events.append({"type": "response.reasoning_text.done", **base, "content_index": 0,
                                     "text": self._text})
            item["content"] = [part]
            self._events.append({"type": "response.content_part.done", **base, "content_index": 0, "part": part})
        item["status"] = status
        self._events.append({"type": "response.output_item.done", "output_index": index, "item": dict(item)})
