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


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` draft tokens for ``token_ids``, or [] when no n-gram of ``min_n..max_n`` tokens recurs.

    Longer n-grams are tried first (a longer match predicts better); among
    matches of one length the latest wins (the most recent context).
    """
    num = len(token_ids)
    if k < 1 or num < 2:
        return []
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        tail = token_ids[num - n :]
        first = tail[0]
        # scan starts from the right: the latest occurrence that ends before the tail itself
        for start in range(num - n - 1, -1, -1):
            if token_ids[start] == first and token_ids[start : start + n] == tail:
                follow = token_ids[start + n : start + n + k]
                if follow:
                    return follow
    return []
