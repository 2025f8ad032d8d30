"""One choice's output through the reasoning parser and then the tool parser.

The reasoning parser goes first and splits off ``reasoning_content``; the
reply text it passes on goes to the request's tool parser, so a call is
looked for only outside the reasoning (a ``<tool_call>`` the model merely
thinks about is not a call). A format that carries its own calls (harmony)
has them sent by its reasoning parser, and no tool parser runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.entrypoints.openai.reasoning_parsers.base import ReasoningParser
from pagedllm.entrypoints.openai.tool_parsers.base import (
    DeltaMessage,
    ExtractedToolCalls,
    ToolParser,
    assemble_deltas,
)


class ReplyParser:
    """A reasoning parser and (unless the format parses calls itself) a tool parser, chained; ``feed``/``finish``."""

    def __init__(self, reasoning: ReasoningParser, tools: ToolParser | None) -> None:
        self.reasoning = reasoning
        self.tools = None if reasoning.parses_tool_calls else tools

    @property
    def num_calls(self) -> int:
        """Calls sent so far (a finish reason of ``tool_calls`` needs one)."""
        return self.reasoning.num_calls + (self.tools.num_calls if self.tools is not None else 0)

    def feed(self, text: str, token_ids: Sequence[int]) -> DeltaMessage | None:
        """The step's new output; the delta to send, or None."""
        return self._through_tools(self.reasoning.feed(text, token_ids), last=False)

    def finish(self) -> DeltaMessage | None:
        """The output has ended; the last delta, or None."""
        return self._through_tools(self.reasoning.finish(), last=True)

    def extract(self, text: str, token_ids: Sequence[int]) -> ExtractedToolCalls:
        """A whole output split into reasoning, content and calls (the non-streamed answer)."""
        return assemble_deltas([self.feed(text, token_ids), self.finish()])

    def _through_tools(self, delta: DeltaMessage | None, last: bool) -> DeltaMessage | None:
        if self.tools is None:
            return delta
        reply = delta.content if delta is not None else None
        out = DeltaMessage(reasoning_content=delta.reasoning_content if delta is not None else None)
        pieces = [self.tools.feed(reply) if reply else None]
        if last:
            pieces.append(self.tools.finish())
        for piece in pieces:
            if piece is not None:
                if piece.content is not None:
                    out.content = (out.content or "") + piece.content
                out.tool_calls.extend(piece.tool_calls)
        return None if out.empty else out
