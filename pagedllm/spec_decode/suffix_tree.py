"""A suffix trie of bounded depth with occurrence counts: the structure suffix decoding drafts from.

Every substring of at most ``max_depth`` tokens of the indexed token lists
is a path from the root; a node counts how often its path occurs, and
``total`` how often it occurs followed by another token (the sum of its
children's counts)::

    tokens  a b a b c          max_depth 3
    root -a(2)-b(2)-a(1)       "a b a" once
                   -c(1)       "a b c" once: after "a b", a and c each with share 1/2
         -b(2)-a(1)-b(1)
              -c(1)
         -c(1)

Two ways in: ``extend`` appends to the tree's own growing token list (a
request's prompt and output, a step's new tokens at a time, O(max_depth)
per token: the nodes of the list's current suffixes are kept), and
``add``/``remove`` index or forget a separate finished list (the global
tree over earlier outputs). ``match`` finds the longest suffix of a context
that occurred earlier with a continuation; ``draft`` follows the most
frequent children from there.

Plain Python, no torch. Nodes are ids into flat integer arrays and edges an
int -> int dict, not an object per node: a tree holds up to ``max_depth``
nodes per token (hundreds of thousands for a few dozen outputs), and that
many objects would make each of Python's full garbage collections walk them
all (tens of milliseconds, measured); arrays and int-only dicts are not
tracked by the collector.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

ROOT = 0
_NONE = -1
_TOKEN_BITS = 32  # an edge's key: parent id above these bits, token id in them


class SuffixTree:
    """Counts of every substring of at most ``max_depth`` tokens of the indexed token lists.

    Args:
        max_depth: longest path kept; a match and the draft that follows it
            fit in it together.
    """

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        # per node id: occurrences of its path, those followed by a token, the token on the edge into
        # it, its first child and its next sibling (children are a linked list, for ``draft``)
        self._count = array("q", [0])
        self._total = array("q", [0])
        self._token = array("q", [_NONE])
        self._first = array("q", [_NONE])
        self._next = array("q", [_NONE])
        self._edges: dict[int, int] = {}  # (parent << _TOKEN_BITS) | token -> child
        self._free: list[int] = []  # ids of removed nodes, reused first
        # extend's list: the nodes of its suffixes of length 0, 1, ... (< max_depth), root first
        self._tail: list[int] = [ROOT]
        self.num_tokens = 0  # tokens appended through extend

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, the root included."""
        return len(self._count) - len(self._free)

    # --- nodes ----------------------------------------------------------------------------------
    def _child(self, node: int, token: int) -> int:
        """The child after ``token``, made (count 0) when missing."""
        key = (node << _TOKEN_BITS) | token
        child = self._edges.get(key)
        if child is not None:
            return child
        if self._free:
            child = self._free.pop()
            self._count[child] = self._total[child] = 0
            self._token[child], self._first[child] = token, _NONE
        else:
            child = len(self._count)
            for column, value in ((self._count, 0), (self._total, 0), (self._token, token),
                                  (self._first, _NONE), (self._next, _NONE)):
                column.append(value)
        self._next[child] = self._first[node]
        self._first[node] = child
        self._edges[key] = child
        return child

    def _drop(self, node: int, child: int, chain: Sequence[int]) -> None:
        """Remove ``child`` of ``node`` and the chain of single descendants along ``chain``'s tokens."""
        nxt = self._next
        if self._first[node] == child:
            self._first[node] = nxt[child]
        else:
            prev = self._first[node]
            while nxt[prev] != child:
                prev = nxt[prev]
            nxt[prev] = nxt[child]
        del self._edges[(node << _TOKEN_BITS) | self._token[child]]
        self._free.append(child)
        for token in chain:
            below = self._edges.pop((child << _TOKEN_BITS) | token, None)
            if below is None:
                break
            self._free.append(below)
            child = below

    def count(self, node: int) -> int:
        """Occurrences of ``node``'s path."""
        return self._count[node]

    def total(self, node: int) -> int:
        """Occurrences of ``node``'s path followed by a token (its children's counts summed)."""
        return self._total[node]

    def children(self, node: int) -> Iterator[tuple[int, int]]:
        """(token, child) pairs of ``node``, newest first."""
        child = self._first[node]
        while child != _NONE:
            yield self._token[child], child
            child = self._next[child]

    # --- indexing -------------------------------------------------------------------------------
    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the tree's own list: each new token ends one more occurrence of the
        paths of the list's current suffixes."""
        depth, count, total, edges, child_of = self.max_depth, self._count, self._total, self._edges, self._child
        tail = self._tail
        for token in tokens:
            new_tail = [ROOT]
            for node in tail:
                # the lookup inlined: this loop runs max_depth times per token (a prompt's indexing)
                child = edges.get((node << _TOKEN_BITS) | token)
                if child is None:
                    child = child_of(node, token)
                count[child] += 1
                total[node] += 1
                new_tail.append(child)
            tail = new_tail if len(new_tail) <= depth else new_tail[:depth]
        self._tail = tail
        self.num_tokens += len(tokens)

    def add(self, tokens: Sequence[int]) -> None:
        """Index ``tokens`` as a list of its own (one finished output): every substring of it counts once more."""
        count, total, edges, child_of = self._count, self._total, self._edges, self._child
        for start in range(len(tokens)):
            node = ROOT
            for token in tokens[start : start + self.max_depth]:
                child = edges.get((node << _TOKEN_BITS) | token)
                if child is None:
                    child = child_of(node, token)
                count[child] += 1
                total[node] += 1
                node = child

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo ``add(tokens)``: nodes whose count reaches 0 are freed."""
        count, total, edges = self._count, self._total, self._edges
        for start in range(len(tokens)):
            node = ROOT
            window = tokens[start : start + self.max_depth]
            for i, token in enumerate(window):
                child = edges[(node << _TOKEN_BITS) | token]
                count[child] -= 1
                total[node] -= 1
                if count[child] == 0:
                    # a path occurs at least as often as any longer one: the chain below held only
                    # this occurrence and goes with it
                    self._drop(node, child, window[i + 1 :])
                    break
                node = child

    # --- lookups --------------------------------------------------------------------------------
    def _find(self, tokens: Sequence[int]) -> int:
        node = ROOT
        edges = self._edges
        for token in tokens:
            node = edges.get((node << _TOKEN_BITS) | token, _NONE)
            if node == _NONE:
                break
        return node

    def match(self, context: Sequence[int], max_len: int) -> tuple[int, int]:
        """The node of the longest suffix of ``context`` (at most ``max_len`` tokens) that occurred
        followed by a token, and its length; (ROOT, 0) when none did.

        A suffix that occurred with a continuation has shorter suffixes that
        did too (the same occurrence, cut at the front), so the length is
        found by bisection: O(max_len log max_len) lookups.
        """
        lo, hi = 0, min(max_len, len(context), self.max_depth - 1)
        best = ROOT
        end = len(context)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            node = self._find(context[end - mid :])
            if node != _NONE and self._total[node] > 0:
                lo, best = mid, node
            else:
                hi = mid - 1
        return best, lo

    def match_tail(self, max_len: int) -> tuple[int, int]:
        """``match`` for the tree's own list (``extend``'s), without lookups: the suffix nodes are kept."""
        tail = self._tail
        for length in range(min(max_len, len(tail) - 1), 0, -1):
            if self._total[tail[length]] > 0:
                return tail[length], length
        return ROOT, 0

    def draft(self, node: int, max_num_tokens: int, min_token_prob: float) -> tuple[list[int], float]:
        """Follow the most frequent child from ``node`` for at most ``max_num_tokens`` tokens.

        A token's probability is estimated as the product of the shares
        (child count / parent's continuations) along the draft so far; the
        draft stops before a token whose probability falls under
        ``min_token_prob``. Ties go to the smaller token id. Returns the
        tokens and their probabilities summed (the expected number of
        accepted tokens, used to pick between trees).
        """
        count, total = self._count, self._total
        tokens: list[int] = []
        prob = 1.0
        score = 0.0
        while len(tokens) < max_num_tokens and total[node] > 0:
            token, child = max(self.children(node), key=lambda tc: (count[tc[1]], -tc[0]))
            prob *= count[child] / total[node]
            if prob < min_token_prob:
                break
            tokens.append(token)
            score += prob
            node = child
        return tokens, score
