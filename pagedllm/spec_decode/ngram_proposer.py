"""Prompt lookup (vLLM's ``ngram`` method): draft the tokens that followed an earlier copy of the tail.

For n from ``max_n`` down to ``min_n``, find the latest earlier occurrence
of the last n tokens in the sequence (prompt and output alike); the tokens
after it are the draft::

    tokens:  ... def f ( x ) : return x ... def f ( x )
                         ^^^^^^^^^^^^^^        ^^^^^^^ the tail (n = 4)
             match ------'  draft: ") : return x"[:k]

Plain Python on lists of ints; no torch, no state.
"""

from __future__ import annotations

from array import array

from pagedllm.spec_decode.proposer import ProposerSequence

_WIDTH = array("q").itemsize  # bytes per token id in the searched string


def _latest_match(data: bytes, pattern: bytes, end: int) -> int:
    """The highest token index whose ``len(pattern)``-byte run in ``data[:end]`` equals ``pattern``; -1 if none.

    ``bytes.rfind`` searches in C; a hit not on a token boundary is skipped.
    """
    while True:
        pos = data.rfind(pattern, 0, end)
        if pos < 0 or pos % _WIDTH == 0:
            return pos // _WIDTH if pos >= 0 else -1
        end = pos + len(pattern) - 1  # the next search finds only runs starting before this one


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` draft tokens for ``token_ids``, or [] when no n-gram of ``min_n..max_n`` tokens recurs.

    Longer n-grams are tried first (a longer match predicts better); among
    matches of one length the latest wins (the most recent context). The
    search runs over the ids packed as 8-byte integers (a C substring
    search: about a millisecond less per step at 2k tokens than a Python scan).
    """
    num = len(token_ids)
    if k < 1 or num < 2:
        return []
    data = array("q", token_ids).tobytes()
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        # a match must end before the tail's last token, so that a token follows it
        start = _latest_match(data, data[(num - n) * _WIDTH :], (num - 1) * _WIDTH)
        if start >= 0:
            return token_ids[start + n : start + n + k]
    return []


class NgramProposer:
    """``propose_ngram`` behind the proposer interface (``proposer.py``): no state.

    Args:
        min_n: shortest n-gram matched.
        max_n: longest n-gram matched (tried first).
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, seq: ProposerSequence, max_num_tokens: int) -> list[int]:
        """``propose_ngram`` over ``seq``'s prompt and output."""
        return propose_ngram(seq.token_ids, max_num_tokens, self.min_n, self.max_n)

    def finish(self, seq: ProposerSequence) -> None:
        """Nothing to forget."""
