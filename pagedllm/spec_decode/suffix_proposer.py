"""Suffix decoding (vLLM's ``suffix`` method, arXiv 2411.04975): drafts from suffix trees over this
request's tokens and over earlier requests' outputs, as many tokens as the match supports.

Per step and sequence::

    local tree   (this sequence's prompt + output, extended by the tokens new since the last step)
    global tree  (the outputs of the last ``max_cached_requests`` finished requests)

    in each tree: the longest suffix of the sequence (at most max_depth - k tokens, so that k
    tokens fit below it) that occurred with a continuation; from its node follow the most
    frequent child while the estimated probability stays >= min_token_prob, for at most
    min(k, floor(max_spec_factor * match length)) tokens;
    the draft whose probabilities sum higher wins (the local one on a tie).

A short match drafts little (factor 1: one token per matched token), a long
one up to k; a continuation that followed one of two occurrences has share 1/2 and may stop the
draft early. Plain Python, no torch.
"""

from __future__ import annotations

import weakref
from collections import deque

from pagedllm.spec_decode.proposer import ProposerSequence
from pagedllm.spec_decode.suffix_tree import SuffixTree


class SuffixProposer:
    """Drafts from a suffix tree per sequence and a global one over finished outputs.

    Args:
        max_depth: deepest path of the trees (a match and its draft fit in it together).
        max_cached_requests: finished outputs the global tree holds, oldest
            forgotten first; 0: no global tree.
        max_spec_factor: a match of n tokens drafts at most ``factor * n`` tokens.
        min_token_prob: a draft stops before a token whose estimated probability is lower.
    """

    def __init__(self, max_depth: int, max_cached_requests: int, max_spec_factor: float,
                 min_token_prob: float) -> None:
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        # a finished sequence's tree goes with it even if nobody calls finish
        self._trees: weakref.WeakKeyDictionary[ProposerSequence, SuffixTree] = weakref.WeakKeyDictionary()
        self.global_tree: SuffixTree | None = SuffixTree(max_depth) if max_cached_requests > 0 else None
        self._cached: deque[list[int]] = deque()  # the global tree's outputs, oldest first

    @property
    def num_cached_requests(self) -> int:
        """Outputs the global tree holds now."""
        return len(self._cached)

    def _tree(self, seq: ProposerSequence) -> SuffixTree:
        """``seq``'s own tree, brought up to its tokens (only the new ones are indexed)."""
        tokens = seq.token_ids
        tree = self._trees.get(seq)
        if tree is None or tree.num_tokens > len(tokens):
            # first proposal (the prompt is indexed now), or tokens taken back: not done by this
            # engine (drafts leave before the next proposal), rebuilt rather than trusted
            tree = self._trees[seq] = SuffixTree(self.max_depth)
        if tree.num_tokens < len(tokens):
            tree.extend(tokens[tree.num_tokens :])
        return tree

    def _draft(self, tree: SuffixTree, match: tuple[int, int], max_num_tokens: int) -> tuple[list[int], float]:
        """``tree``'s draft below ``match`` (node, length), as long as the match length allows."""
        node, length = match
        if length == 0:
            return [], 0.0
        budget = min(max_num_tokens, int(self.max_spec_factor * length))
        return tree.draft(node, budget, self.min_token_prob)

    def propose(self, seq: ProposerSequence, max_num_tokens: int) -> list[int]:
        """The better of the local and the global tree's drafts, at most ``max_num_tokens`` tokens."""
        # the longest match that leaves room below it for max_num_tokens tokens in the tree
        max_match = max(1, self.max_depth - max_num_tokens)
        tree = self._tree(seq)
        best = self._draft(tree, tree.match_tail(max_match), max_num_tokens)
        glob = self.global_tree
        if glob is not None and self._cached:
            other = self._draft(glob, glob.match(seq.token_ids[-max_match:], max_match), max_num_tokens)
            if other[1] > best[1]:
                best = other
        return best[0]

    def finish(self, seq: ProposerSequence) -> None:
        """Drop ``seq``'s tree; its output joins the global tree, evicting the oldest beyond the bound."""
        self._trees.pop(seq, None)
        # a step that failed leaves its drafts in place (the request is aborted): they are no output
        output = seq.token_ids[seq.num_prompt_tokens : len(seq.token_ids) - seq.num_draft_tokens]
        if self.global_tree is None or not output:
            return
        self.global_tree.add(output)
        self._cached.append(output)
        while len(self._cached) > self.max_cached_requests:
            self.global_tree.remove(self._cached.popleft())
