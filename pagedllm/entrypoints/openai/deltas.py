"""What one streamed choice has sent so far, and what its next chunk carries."""

from __future__ import annotations

from pagedllm.outputs import CompletionOutput
from pagedllm.sampling_params import SamplingParams


class DeltaTracker:
    """Text and tokens already streamed per choice.

    With stop strings the engine may cut text it has already produced (a stop
    string that spans tokens is found only when complete), so the last
    ``longest stop - 1`` characters are held back until the choice finishes,
    as vLLM does. Tokens (for logprobs) go out with the next chunk that has
    text, or with the last one.
    """

    def __init__(self, params: SamplingParams) -> None:
        stops = params.stop_strings
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent: dict[int, int] = {}
        self.tokens_sent: dict[int, int] = {}
        self.text_offset: dict[int, int] = {}
        self.done: set[int] = set()

    def delta(self, choice: int, c: CompletionOutput) -> tuple[str, bool, int, int] | None:
        """(new text, finished, first new token, end of new tokens) for a choice, or None."""
        if choice in self.done:
            return None
        finished = c.finish_reason is not None
        sent = self.sent.get(choice, 0)
        end = len(c.text) if finished else max(sent, len(c.text) - self.hold)
        text = c.text[sent:end]
        if not text and not finished:
            return None
        self.sent[choice] = end
        first_token = self.tokens_sent.get(choice, 0)
        self.tokens_sent[choice] = len(c.token_ids)
        if finished:
            self.done.add(choice)
        return text, finished, first_token, len(c.token_ids)
