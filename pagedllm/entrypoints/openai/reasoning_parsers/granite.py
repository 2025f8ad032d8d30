"""IBM Granite 3.x reasoning: ``Here is my thought process:`` ... ``Here is my response:`` ...

Granite 3.2/3.3 with thinking turned on (``chat_template_kwargs:
{"thinking": true}``) are told by their chat template to answer as::

    Here is my thought process:
    <the reasoning>

    Here is my response:
    <the reply>

The models also write the contracted ``Here's my thought process:`` /
``Here's my response:``; both spellings are read. The reasoning is the text
between the two markers, its leading and trailing whitespace dropped; the
content is what follows the response marker, its leading whitespace
dropped. Output that does not begin (after whitespace) with a thought marker
is all content (thinking off); output cut before the response marker is all
reasoning. Streamed, text that could be the start of a marker (and the
whitespace before one) is held back until it is known, so a stream cut
anywhere gives the non-streamed answer.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.entrypoints.openai.reasoning_parsers.base import ReasoningParser

THOUGHT_MARKERS = ("Here is my thought process:", "Here's my thought process:")
RESPONSE_MARKERS = ("Here is my response:", "Here's my response:")

_START = "start"  # before anything but whitespace: a thought marker may open the reasoning
_LEAD = "lead"  # after the thought marker: its whitespace is dropped
_THINK = "think"  # the reasoning
_AFTER = "after"  # after the response marker: its whitespace is dropped
_REPLY = "reply"  # the reply: everything is content


def _could_begin(text: str, markers: tuple[str, ...]) -> bool:
    return any(m.startswith(text) for m in markers)


class GraniteReasoningParser(ReasoningParser):
    """Granite 3.x's plain-text thought and response markers; vLLM's ``granite`` parser."""

    name = "granite"
    think_markers = (THOUGHT_MARKERS[0], RESPONSE_MARKERS[0] + "\n")

    def __init__(
        self, *, prompt_text: str | None = None, calls_allowed: bool = False, max_calls: int | None = None
    ) -> None:
        super().__init__(prompt_text=prompt_text, calls_allowed=calls_allowed, max_calls=max_calls)
        self._mode = _START
        self._pending = ""  # text that may be the start of a marker
        self._space = ""  # the reasoning's whitespace, held until text follows it

    def _read(self, text: str, token_ids: Sequence[int]) -> None:
        for ch in text:
            self._step(ch)

    def _step(self, ch: str) -> None:
        mode = self._mode
        if mode == _REPLY:
            self._send_content(ch)
        elif mode in (_LEAD, _AFTER):
            if not ch.isspace():
                self._mode = _THINK if mode == _LEAD else _REPLY
                self._step(ch)
        elif mode == _THINK:
            self._think_char(ch)
        else:  # _START
            self._pending += ch
            stripped = self._pending.lstrip()
            if stripped in THOUGHT_MARKERS:
                self._mode, self._pending = _LEAD, ""
            elif not _could_begin(stripped, THOUGHT_MARKERS):
                self._mode, pending, self._pending = _REPLY, self._pending, ""
                self._send_content(pending)

    def _think_char(self, ch: str) -> None:
        self._pending += ch
        if self._pending in RESPONSE_MARKERS:
            self._mode, self._pending, self._space = _AFTER, "", ""  # whitespace before the marker is dropped
            return
        while self._pending and not _could_begin(self._pending, RESPONSE_MARKERS):
            self._reasoning_char(self._pending[0])
            self._pending = self._pending[1:]

    def _reasoning_char(self, ch: str) -> None:
        if ch.isspace():
            self._space += ch
        else:
            self._send_reasoning(self._space + ch)
            self._space = ""

    def _end(self) -> None:
        pending, self._pending = self._pending, ""
        if self._mode == _START:
            self._send_content(pending)
        elif self._mode == _THINK:
            self._send_reasoning(self._space + pending)  # cut off: all of it was reasoning
            self._space = ""
