"""What every reasoning parser shares: the streaming contract of one choice's output.

A reasoning parser splits a choice's output into ``reasoning_content`` (the
model's thinking) and the text of the reply, as vLLM's ``--reasoning-parser``
does. It reads the new text *and* the new token ids of each step: a format
written in plain tags (``<think>``) reads the text, one written in special
tokens (gpt-oss's harmony channels) reads the ids, which a detokenizer that
skips special tokens would lose.

Contract, as the tool parsers' (``tool_parsers/base.py``): ``feed`` after
each step and ``finish`` once after the last, each returning the
``DeltaMessage`` to send (or None); the same state machine serves a whole
output (one ``feed`` of everything), so a stream cut anywhere reassembles
into the non-streamed answer. The reply text it passes on (``content``) then
goes through the request's tool parser (``reply_parser.py``), unless the
format carries its calls itself (``parses_tool_calls``: harmony's
``commentary`` messages to ``functions.NAME``), in which case the reasoning
parser sends the calls.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from pagedllm.entrypoints.openai.tool_parsers.base import DeltaMessage, DeltaSender


class ReasoningParser(DeltaSender):
    """Splits one choice's output into reasoning and reply (and, for some formats, tool calls).

    Args:
        prompt_text: the rendered prompt, for formats whose template may open
            the reasoning block in the prompt (``<think>`` at its end); None: unknown.
        calls_allowed: whether calls may be returned (the request has tools and
            ``tool_choice`` is ``auto``); only read by parsers that ``parses_tool_calls``.
        max_calls: keep at most this many calls (1 for ``parallel_tool_calls: false``).
    """

    name: ClassVar[str] = ""
    parses_tool_calls: ClassVar[bool] = False  # the format's calls come from this parser, not a tool parser
    # the markers a thinking budget forces (SamplingParams.think_start_str / think_end_str); None: no budget
    think_markers: ClassVar[tuple[str, str] | None] = None

    def __init__(
        self, *, prompt_text: str | None = None, calls_allowed: bool = False, max_calls: int | None = None
    ) -> None:
        super().__init__(max_calls)
        self.prompt_text = prompt_text
        self.calls_allowed = calls_allowed

    def feed(self, text: str, token_ids: Sequence[int]) -> DeltaMessage | None:
        """Read the choice's next text and token ids; the delta to send, or None."""
        self._check_open()
        self._read(text, token_ids)
        return self._take()

    @abstractmethod
    def _read(self, text: str, token_ids: Sequence[int]) -> None:
        """Read one step's new output."""


    # --- what subclasses send ---------------------------------------------------------------

    def _send_reasoning(self, text: str) -> None:
        if text:
            self._out.reasoning_content = (self._out.reasoning_content or "") + text
