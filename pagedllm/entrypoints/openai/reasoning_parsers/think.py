"""``<think>...</think>`` reasoning, as Qwen3 and DeepSeek-R1 write it.

The reasoning is the text between ``<think>`` and ``</think>``; the reply is
what follows ``</think>``, its leading whitespace dropped (the models put a
blank line there). Two ways the block opens:

- in the output: the reply may begin (after whitespace) with ``<think>``;
  output that does not is all content (Qwen3 with thinking off);
- in the prompt: templates that end the generation prompt with ``<think>``
  (DeepSeek-R1, Qwen3's thinking-only releases) make the whole output
  reasoning until ``</think>`` (a ``<think>`` the model writes again at the
  very start is dropped). The parser knows this from the prompt text
  (an open ``<think>`` after the last ``</think>``); without the prompt,
  ``deepseek_r1`` assumes it was opened and ``qwen3`` that it was not.

An output that ends inside the block (``max_tokens``) is all reasoning.
Streamed, text that could be the start of a tag is held back until it is
not, so a tag split across any two deltas never leaks into either field.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.entrypoints.openai.reasoning_parsers.base import ReasoningParser

OPEN = "<think>"
CLOSE = "</think>"

# where the parser stands
_START = "start"  # before anything but whitespace: <think> may still open the block
_THINK = "think"  # inside the block
_AFTER = "after"  # after </think>, before the reply's first non-whitespace
_REPLY = "reply"  # the reply: everything is content


def prompt_opens_block(prompt_text: str) -> bool:
    """Whether the prompt ends inside a ``<think>`` block (an open tag after the last close)."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


class ThinkReasoningParser(ReasoningParser):
    """``<think>`` blocks; ``opened_by_default``: whether a prompt-less parser starts inside the block."""

    name = "qwen3"
    opened_by_default = False
    think_markers = (OPEN, CLOSE + "\n\n")  # the blank line Qwen3's template writes after the block

    def __init__(
        self, *, prompt_text: str | None = None, calls_allowed: bool = False, max_calls: int | None = None
    ) -> None:
        super().__init__(prompt_text=prompt_text, calls_allowed=calls_allowed, max_calls=max_calls)
        self._opened = self.opened_by_default if prompt_text is None else prompt_opens_block(prompt_text)
        self._mode = _START
        self._pending = ""  # text that may be the start of the tag the mode waits for

    def _read(self, text: str, token_ids: Sequence[int]) -> None:
        for ch in text:
            self._step(ch)

    def _step(self, ch: str) -> None:
        if self._mode == _REPLY:
            self._send_content(ch)
        elif self._mode == _AFTER:
            if not ch.isspace():
                self._mode = _REPLY
                self._send_content(ch)
        elif self._mode == _THINK:
            self._pending += ch
            if self._pending == CLOSE:
                self._mode, self._pending = _AFTER, ""
                return
            while self._pending and not CLOSE.startswith(self._pending):
                self._send_reasoning(self._pending[0])
                self._pending = self._pending[1:]
        else:  # _START: whitespace and a prefix of <think> are held
            self._pending += ch
            stripped = self._pending.lstrip()
            if stripped == OPEN:
                self._mode, self._pending = _THINK, ""
            elif not OPEN.startswith(stripped):
                pending, self._pending = self._pending, ""
                if self._opened:  # the prompt opened the block: what was held is reasoning (or </think>)
                    self._mode = _THINK
                    for held in pending:
                        self._step(held)
                else:
                    self._mode = _REPLY
                    self._send_content(pending)

    def _end(self) -> None:
        pending, self._pending = self._pending, ""
        if self._mode == _THINK:
            self._send_reasoning(pending)  # a cut-off block: all of it was reasoning
        elif self._mode == _START:
            (self._send_reasoning if self._opened else self._send_content)(pending)


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """DeepSeek-R1: the template opens ``<think>`` in the prompt, so without a prompt the output starts inside it."""

    name = "deepseek_r1"
    opened_by_default = True
