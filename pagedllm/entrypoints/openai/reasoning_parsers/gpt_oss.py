"""gpt-oss's harmony output read into channels, with openai-harmony's ``StreamableParser``.

The model writes messages ``<|channel|>C[ to=R][ <|constrain|>T]<|message|>...``
closed by ``<|end|>`` (more follow, each after ``<|start|>assistant``),
``<|return|>`` (the reply is done) or ``<|call|>`` (a tool call is done).
They are sent as:

- channel ``analysis`` -> ``reasoning_content``;
- a message to ``functions.NAME`` (recipient in the header, on
  ``commentary``) -> a tool call: its id and NAME once the header is read,
  then the message text, the JSON arguments, in pieces as they come;
  when the request allows no calls (no tools, or ``tool_choice: none``)
  its text goes to the content instead; a call past ``max_calls``
  (``parallel_tool_calls: false``) is dropped, as the tool parsers drop it;
- a message to any other recipient (a built-in tool such as ``browser``,
  which this server does not run) -> ``reasoning_content``;
- everything else (``final``, ``commentary`` preambles without a
  recipient) -> ``content``.

The parser works on token ids (harmony's markers are special tokens of the
o200k_harmony vocabulary), one token at a time, so where a stream is cut
cannot change what it sends. Output that breaks the format (a cut header, a
token harmony does not expect) stops the reading: the tokens from there on
are decoded, special ones spelled out, and sent as content when the output
ends (whole, so no UTF-8 character is split), so nothing the model wrote is lost.

With a thinking budget the prompt opens the analysis message itself
(``harmony/thinking.py``): told a ``prompt_text`` that ends with the analysis
header, the parser reads that header first, so the output is the message's text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedllm.entrypoints.openai.reasoning_parsers.base import ReasoningParser
from pagedllm.harmony.thinking import (
    ANALYSIS_OPEN,
    END,
    FINAL_OPEN,
    analysis_header_ids,
    opens_analysis,
)
from pagedllm.harmony.vocab import harmony_encoding

FUNCTIONS = "functions."

# where the current message's text goes
_REASONING = "reasoning"
_CONTENT = "content"
_CALL = "call"
_DROP = "drop"


class GptOssReasoningParser(ReasoningParser):
    """Harmony channels -> reasoning, content and tool calls (vLLM's ``openai_gptoss`` parsers)."""

    name = "gpt_oss"
    parses_tool_calls = True
    # a thinking budget ends the analysis message and opens the final one (harmony/thinking.py sets them, with
    # the closing marker <|end|> alone: the model may end its analysis itself and go on to a call)
    think_markers = (ANALYSIS_OPEN, END + FINAL_OPEN)

    def __init__(
        self, *, prompt_text: str | None = None, calls_allowed: bool = False, max_calls: int | None = None
    ) -> None:
        super().__init__(prompt_text=prompt_text, calls_allowed=calls_allowed, max_calls=max_calls)
        from openai_harmony import Role, StreamableParser

        self._encoding = harmony_encoding()
        self._parser = StreamableParser(self._encoding, Role.ASSISTANT)
        self._target: str | None = None  # the open message's destination; None between messages
        self._call: int | None = None  # the open call's index
        self._broken: list[int] = []  # tokens after the format broke, sent as text at the end
        self.diverged = False
        if opens_analysis(prompt_text):  # a thinking budget's prompt opened the analysis message (harmony/thinking.py)
            for token in analysis_header_ids():
                self._parser.process(token)

    def _read(self, text: str, token_ids: Sequence[int]) -> None:
        for token in token_ids:
            if self.diverged:
                self._broken.append(token)
                continue
            try:
                self._parser.process(token)
            except Exception:  # HarmonyError: the output left the format
                self.diverged = True
                self._broken.append(token)
                continue
            self._route()

    def _route(self) -> None:
        """Send what the last token added, opening the message's destination when its header completes."""
        from openai_harmony import StreamState

        p = self._parser
        if p.state != StreamState.CONTENT:
            self._target, self._call = None, None  # between messages, or in a header
            return
        if self._target is None:
            self._target = self._destination(p.current_channel, p.current_recipient)
        delta = p.last_content_delta or ""
        if self._target == _REASONING:
            self._send_reasoning(delta)
        elif self._target == _CALL:
            self._send_arguments(self._call, delta)
        elif self._target == _CONTENT:
            self._send_content(delta)

    def _destination(self, channel: str | None, recipient: str | None) -> str:
        if recipient and recipient.startswith(FUNCTIONS):
            if not self.calls_allowed:
                return _CONTENT
            self._call = self._open_call(recipient[len(FUNCTIONS) :])
            return _DROP if self._call is None else _CALL
        if recipient or channel == "analysis":
            return _REASONING
        return _CONTENT

    def _end(self) -> None:
        if not self.diverged:
            try:
                self._parser.process_eos()  # completes a message the stop token did not close
            except Exception:  # a header cut by max_tokens: nothing of it was sent
                pass
        if self._broken:
            self._send_content(self._encoding.decode(self._broken))

    @property
    def messages(self) -> list[Any]:
        """The harmony messages read so far (openai_harmony ``Message`` objects)."""
        return list(self._parser.messages)
