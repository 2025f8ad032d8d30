"""A reply's deltas (``DeltaMessage``: thinking, text, call pieces) as Anthropic content blocks.

The chat route's parsers (``reasoning_parsers/``, ``tool_parsers/``) split
the model's output into reasoning, content and call pieces; here each kind
becomes a block, in the order the model wrote them: ``thinking``, ``text``,
``tool_use`` (one per call). Streamed, a block opens with
``content_block_start``, grows with ``content_block_delta`` events
(``thinking_delta``, ``text_delta``, ``input_json_delta``) and ends with
``content_block_stop`` when a block of another kind (or another call) begins,
or the reply ends. The same object collects the whole blocks for a
non-streamed answer, so the two agree. A thinking block's ``signature`` is
empty: nothing here signs thinking, and what a client sends back is not checked.
"""

from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import DeltaMessage


class ContentBlocks:
    """The blocks of one reply, built from its deltas; ``add`` and ``close`` return the stream events."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open: int | None = None  # index of the block still growing
        self._calls: dict[int, int] = {}  # call index -> its block's index
        self._arguments: dict[int, str] = {}  # block index -> a call's arguments text so far

    @property
    def num_calls(self) -> int:
        """How many ``tool_use`` blocks there are."""
        return len(self._calls)

    def add(self, delta: DeltaMessage | None) -> list[dict[str, Any]]:
        """One delta's events (none for an empty delta)."""
        events: list[dict[str, Any]] = []
        if delta is None:
            return events
        if delta.reasoning_content:
            events += self._grow("thinking", "thinking_delta", "thinking", delta.reasoning_content)
        if delta.content:
            events += self._grow("text", "text_delta", "text", delta.content)
        for piece in delta.tool_calls:
            if piece.id is not None:
                events += self._start({"type": "tool_use", "id": piece.id, "name": piece.name or "", "input": {}})
                self._calls[piece.index] = len(self.blocks) - 1
                self._arguments[len(self.blocks) - 1] = ""
            index = self._calls.get(piece.index)
            if index is None:
                raise ValueError(f"arguments of call {piece.index} came before its header")
            if piece.arguments:
                self._arguments[index] += piece.arguments
                events.append(_delta(index, {"type": "input_json_delta", "partial_json": piece.arguments}))
        return events

    def close(self) -> list[dict[str, Any]]:
        """The reply ended: the stop event of the block still open, if any."""
        return self._stop()

    def content(self) -> list[dict[str, Any]]:
        """The whole blocks (a non-streamed answer's ``content``): each call's ``input`` as the object it wrote."""
        out = []
        for i, block in enumerate(self.blocks):
            if block["type"] == "tool_use":
                block = {**block, "input": _arguments_object(self._arguments[i])}
            out.append(block)
        return out

    def _grow(self, kind: str, delta_type: str, field: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self.blocks[self._open]["type"] != kind:
            start = {"type": kind, field: ""}
            if kind == "thinking":
                start["signature"] = ""
            events += self._start(start)
        index = len(self.blocks) - 1  # the open block: the last one
        self.blocks[index][field] += text
        events.append(_delta(index, {"type": delta_type, field: text}))
        return events

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._stop()
        self.blocks.append(dict(block))
        self._open = len(self.blocks) - 1
        events.append({"type": "content_block_start", "index": self._open, "content_block": block})
        return events

    def _stop(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        return [{"type": "content_block_stop", "index": index}]


def _delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def _arguments_object(text: str) -> dict[str, Any]:
    """A call's arguments text as its object. A whole answer commits a call only once its JSON closed
    (``buffered`` parsers), so this parses; ``{}`` for a call with no arguments text."""
    if not text.strip():
        return {}
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"a call's arguments are not a JSON object: {text[:80]!r}")
    return value


def stop_reason(
    finish_reason: str | None, engine_stop_reason: int | str | None, num_calls: int
) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for an output that ended so.

    ``length`` is ``max_tokens``; a reply with calls that stopped is ``tool_use``; one
    stopped by a stop string (the engine's ``stop_reason`` is then that string) is
    ``stop_sequence``; the end of the turn (EOS, a stop token) is ``end_turn``.
    """
    if finish_reason == "length":
        return "max_tokens", None
    if num_calls:
        return "tool_use", None
    if isinstance(engine_stop_reason, str):
        return "stop_sequence", engine_stop_reason
    return "end_turn", None
