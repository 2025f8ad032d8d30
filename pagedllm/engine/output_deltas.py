"""What one sequence has streamed so far, and what its next delta carries (``RequestOutputKind.DELTA``)."""

from __future__ import annotations

from pagedllm.sampling_params import SamplingParams


def held_chars(params: SamplingParams) -> int:
    """How many characters at the end of an unfinished output a delta holds back: ``longest stop - 1``.

    A stop string that spans tokens is found only when complete, and the
    output is then cut where it starts, so text that may be the beginning of
    a stop string is not sent until more text (or the end) shows it stays.
    """
    return max((len(s) for s in params.stop_strings), default=1) - 1


class DeltaCursor:
    """The text and tokens of one sequence already sent in deltas.

    Tokens (and their logprobs) go out with the next delta that has text, or
    with the last one, so a delta never carries a token whose text is still
    held back; once the sequence has finished, nothing more is sent.
    """

    __slots__ = ("num_chars", "num_tokens", "done")

    def __init__(self) -> None:
        self.num_chars = 0  # characters of the output text sent
        self.num_tokens = 0  # output tokens sent
        self.done = False  # the finishing delta was sent

    def advance(self, text: str, num_tokens: int, finished: bool, hold: int) -> tuple[str, int, int] | None:
        """(new text, first new token, end of new tokens) of the sequence's next delta, or None when it has none.

        ``text`` is the sequence's whole output text and ``num_tokens`` its
        output token count; unless ``finished``, the last ``hold`` characters
        stay back.
        """
        if self.done:
            return None
        end = len(text) if finished else max(self.num_chars, len(text) - hold)
        new_text = text[self.num_chars : end]
        if not new_text and not finished:
            return None
        first_token = self.num_tokens
        self.num_chars = end
        self.num_tokens = num_tokens
        self.done = finished
        return new_text, first_token, num_tokens
