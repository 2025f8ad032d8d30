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

Plain Python, no torch. A node holds its first child inline and a dict
only from the second child on: most nodes of a deep trie sit on a chain
of single children, and a dict per node would take four times the memory.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

_NONE = -1  # no inline child (token ids are >= 0)


class TrieNode:
    """One path from the root: its count, its continuations' count, its children."""

    __slots__ = ("count", "total", "token", "child", "more")

    def __init__(self) -> None:
        self.count = 0  # occurrences of the path
        self.total = 0  # occurrences followed by a token (the children's counts summed)
        self.token = _NONE  # the first child, inline
        self.child: TrieNode | None = None
        self.more: dict[int, TrieNode] | None = None  # the other children

    def get(self, token: int) -> TrieNode | None:
        """The child after ``token``, or None."""
        if self.token == token:
            return self.child
        more = self.more
        return more.get(token) if more is not None else None

    def get_or_add(self, token: int) -> TrieNode:
        """The child after ``token``, made (count 0) when missing."""
        if self.token == token:
            return self.child  # type: ignore[return-value]
        if self.token == _NONE:
            self.token, self.child = token, TrieNode()
            return self.child
        if self.more is None:
            self.more = {}
        node = self.more.get(token)
        if node is None:
            node = self.more[token] = TrieNode()
        return node

    def drop(self, token: int) -> None:
        """Forget the child after ``token`` (its count reached 0)."""
        if self.token != token:
            del self.more[token]  # type: ignore[index]
        elif self.more:
            self.token, self.child = self.more.popitem()
        else:
            self.token, self.child = _NONE, None
        if not self.more:
            self.more = None

    def children(self) -> Iterator[tuple[int, TrieNode]]:
        """(token, child) pairs, in no particular order."""
        if self.token != _NONE:
            yield self.token, self.child  # type: ignore[misc]
        if self.more is not None:
            yield from self.more.items()


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
        self.root = TrieNode()
        self.num_nodes = 1
        # extend's list: the nodes of its suffixes of length 0, 1, ... (< max_depth), root first
        self._tail: list[TrieNode] = [self.root]
        self.num_tokens = 0  # tokens appended through extend

    # --- indexing -----------------------------------------------------------------------------
    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the tree's own list: each new token ends one more occurrence of the
        paths of the list's current suffixes."""
        depth = self.max_depth
        tail = self._tail
        for token in tokens:
            new_tail = [self.root]
            for node in tail:
                child = node.get_or_add(token)
                if child.count == 0:
                    self.num_nodes += 1
                child.count += 1
                node.total += 1
                new_tail.append(child)
            tail = new_tail if len(new_tail) <= depth else new_tail[:depth]
        self._tail = tail
        self.num_tokens += len(tokens)

    def add(self, tokens: Sequence[int]) -> None:
        """Index ``tokens`` as a list of its own (one finished output): every substring of it counts once more."""
        self._walk_all(tokens, +1)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo ``add(tokens)``: nodes whose count reaches 0 are freed."""
        self._walk_all(tokens, -1)

    def _walk_all(self, tokens: Sequence[int], delta: int) -> None:
        for start in range(len(tokens)):
            node = self.root
            window = tokens[start : start + self.max_depth]
            for i, token in enumerate(window):
                child = node.get_or_add(token)
                if child.count == 0:
                    self.num_nodes += 1
                child.count += delta
                node.total += delta
                if child.count == 0:
                    # a path occurs at least as often as any longer one: the chain below held only
                    # this occurrence and goes with it
                    node.drop(token)
                    self.num_nodes -= len(window) - i
                    break
                node = child

    # --- lookups ------------------------------------------------------------------------------
    def _find(self, tokens: Sequence[int]) -> TrieNode | None:
        node: TrieNode | None = self.root
        for token in tokens:
            node = node.get(token)  # type: ignore[union-attr]
            if node is None:
                return None
        return node

    def match(self, context: Sequence[int], max_len: int) -> tuple[TrieNode, int]:
        """The node of the longest suffix of ``context`` (at most ``max_len`` tokens) that occurred
        followed by a token, and its length; (root, 0) when none did.

        A suffix that occurred with a continuation has shorter suffixes that
        did too (the same occurrence, cut at the front), so the length is
        found by bisection: O(max_len log max_len) lookups.
        """
        lo, hi = 0, min(max_len, len(context), self.max_depth - 1)
        best = self.root
        end = len(context)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            node = self._find(context[end - mid :])
            if node is not None and node.total > 0:
                lo, best = mid, node
            else:
                hi = mid - 1
        return best, lo

    def match_tail(self, max_len: int) -> tuple[TrieNode, int]:
        """``match`` for the tree's own list (``extend``'s), without lookups: the suffix nodes are kept."""
        tail = self._tail
        for length in range(min(max_len, len(tail) - 1), 0, -1):
            if tail[length].total > 0:
                return tail[length], length
        return self.root, 0


def draft(node: TrieNode, max_num_tokens: int, min_token_prob: float) -> tuple[list[int], float]:
    """Follow the most frequent child from ``node`` for at most ``max_num_tokens`` tokens.

    A token's probability is estimated as the product of the shares (child
    count / parent's continuations) along the draft so far; the draft stops
    before a token whose probability falls under ``min_token_prob``. Ties go
    to the smaller token id. Returns the tokens and their probabilities
    summed (the expected number of accepted tokens, used to pick between
    trees).
    """
    tokens: list[int] = []
    prob = 1.0
    score = 0.0
    while len(tokens) < max_num_tokens and node.total > 0:
        token, child = max(node.children(), key=lambda tc: (tc[1].count, -tc[0]))
        prob *= child.count / node.total
        if prob < min_token_prob:
            break
        tokens.append(token)
        score += prob
        node = child
    return tokens, score
