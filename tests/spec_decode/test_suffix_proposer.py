"""Suffix decoding's trees and proposer against a brute-force reference (hypothesis), the suffix config (no torch).

The reference computes everything from the token lists by plain scans: how
often a path occurs (and how often followed by a token), the longest suffix
of a context with a continuation, and the greedy draft from it. The trees
must agree with it whichever way they were built (one extend, extends in
chunks, add/remove of whole lists).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.engine.sequence import Sequence
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.suffix_proposer import SuffixProposer
from pagedllm.spec_decode.suffix_tree import ROOT, SuffixTree

# small vocabularies: many repeats, ties and long matches
tokens_st = st.lists(st.integers(0, 3), max_size=40)
depth_st = st.integers(2, 7)


# --- the reference ---------------------------------------------------------------------------
def occurrences(docs: list[list[int]], path: list[int], depth: int) -> tuple[int, int]:
    """(count, total) of ``path``: its occurrences in ``docs``, and those followed by a token within ``depth``."""
    n = len(path)
    count = total = 0
    for doc in docs:
        for i in range(len(doc) - n + 1):
            if doc[i : i + n] == path:
                count += 1
                total += i + n < len(doc) and n < depth
    return count, total


def ref_match(docs: list[list[int]], context: list[int], max_len: int, depth: int) -> int:
    """The longest suffix length of ``context`` (<= max_len, < depth) that occurs followed by a token."""
    for length in range(min(max_len, len(context), depth - 1), 0, -1):
        if occurrences(docs, context[len(context) - length :], depth)[1] > 0:
            return length
    return 0


def ref_draft(docs: list[list[int]], path: list[int], max_num: int, min_prob: float, depth: int) -> list[int]:
    """Greedy by count (ties: the smaller token), while the running product of shares stays >= min_prob."""
    out: list[int] = []
    prob = 1.0
    vocab = sorted({t for doc in docs for t in doc})
    while len(out) < max_num:
        total = occurrences(docs, path, depth)[1]
        if total == 0:
            break
        counts = {t: occurrences(docs, path + [t], depth)[0] for t in vocab}
        token = max(vocab, key=lambda t: (counts[t], -t))
        prob *= counts[token] / total
        if prob < min_prob:
            break
        out.append(token)
        path = path + [token]
    return out


def dump(tree: SuffixTree) -> dict[tuple[int, ...], tuple[int, int]]:
    """Every path of ``tree`` -> (count, total)."""
    paths: dict[tuple[int, ...], tuple[int, int]] = {}

    def walk(node: int, path: tuple[int, ...]) -> None:
        for token, child in tree.children(node):
            paths[path + (token,)] = (tree.count(child), tree.total(child))
            walk(child, path + (token,))

    walk(ROOT, ())
    return paths


def ref_dump(docs: list[list[int]], depth: int) -> dict[tuple[int, ...], tuple[int, int]]:
    paths = {tuple(doc[i : i + n]) for doc in docs for n in range(1, depth + 1) for i in range(len(doc) - n + 1)}
    return {p: occurrences(docs, list(p), depth) for p in paths}


# --- the tree --------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(tokens=tokens_st, depth=depth_st, cuts=st.lists(st.integers(0, 40), max_size=5))
def test_incremental_extends_equal_one_build_and_the_reference(tokens, depth, cuts):
    whole = SuffixTree(depth)
    whole.extend(tokens)
    chunked = SuffixTree(depth)
    start = 0
    for cut in sorted(cuts) + [len(tokens)]:
        chunked.extend(tokens[start : max(start, cut)])
        start = max(start, cut)
    added = SuffixTree(depth)
    added.add(tokens)
    want = ref_dump([tokens], depth)
    assert dump(whole) == dump(chunked) == dump(added) == want
    assert whole.num_nodes == chunked.num_nodes == added.num_nodes == len(want) + 1
    assert whole.num_tokens == chunked.num_tokens == len(tokens)


@settings(max_examples=200, deadline=None)
@given(a=tokens_st, b=tokens_st, c=tokens_st, depth=depth_st)
def test_remove_undoes_add(a, b, c, depth):
    tree = SuffixTree(depth)
    for doc in (a, b, c):
        tree.add(doc)
    tree.remove(b)
    assert dump(tree) == ref_dump([a, c], depth)
    assert tree.num_nodes == len(ref_dump([a, c], depth)) + 1
    tree.add(b[::-1])  # into the ids that b left
    assert dump(tree) == ref_dump([a, c, b[::-1]], depth)
    tree.remove(b[::-1])
    tree.remove(a)
    tree.remove(c)
    assert dump(tree) == {} and tree.num_nodes == 1 and tree.total(ROOT) == 0


@settings(max_examples=300, deadline=None)
@given(docs=st.lists(tokens_st, min_size=1, max_size=3), context=tokens_st, depth=depth_st,
       max_len=st.integers(1, 8), max_num=st.integers(1, 6), min_prob=st.sampled_from([0.0, 0.1, 0.3, 0.6, 1.0]))
def test_match_and_draft_equal_a_plain_scan(docs, context, depth, max_len, max_num, min_prob):
    tree = SuffixTree(depth)
    for doc in docs:
        tree.add(doc)
    node, length = tree.match(context, max_len)
    assert length == ref_match(docs, context, max_len, depth)
    if length:  # the proposer drafts only after a match
        got, score = tree.draft(node, max_num, min_prob)
        assert got == ref_draft(docs, context[len(context) - length :], max_num, min_prob, depth)
        assert (score > 0) == bool(got)


@settings(max_examples=300, deadline=None)
@given(tokens=tokens_st, depth=depth_st, max_len=st.integers(1, 8))
def test_the_kept_tail_matches_like_a_lookup(tokens, depth, max_len):
    tree = SuffixTree(depth)
    tree.extend(tokens)
    node, length = tree.match_tail(max_len)
    assert length == ref_match([tokens], tokens, max_len, depth)
    assert tree.match(tokens, max_len) == (node, length)


def test_a_worked_example():
    # "a b a b c" (0 1 0 1 2), depth 3: after "a b", "a" and "c" followed once each
    tree = SuffixTree(3)
    tree.extend([0, 1, 0, 1, 2])
    node, length = tree.match([7, 0, 1], 5)
    assert length == 2 and (tree.count(node), tree.total(node)) == (2, 2)
    assert tree.draft(node, 5, 0.0) == ([0], 0.5)  # the tie goes to the smaller token; depth 3 stops it there
    assert tree.draft(node, 5, 0.6) == ([], 0.0)  # share 1/2 < 0.6


# --- the proposer ----------------------------------------------------------------------------
def suffix(**kw) -> SuffixProposer:
    args = {"max_depth": 8, "max_cached_requests": 2, "max_spec_factor": 1.0, "min_token_prob": 0.1} | kw
    return SuffixProposer(**args)


def finished(prompt: list[int], output: list[int]) -> Sequence:
    seq = Sequence(prompt, 16)
    for t in output:
        seq.append_token(t)
    return seq


def test_the_proposer_follows_the_sequence_as_it_grows():
    proposer = suffix(max_cached_requests=0)
    seq = Sequence([5, 1, 2, 3, 4, 9, 1, 2], 16)
    assert proposer.propose(seq, 3) == [3, 4]  # match "1 2" (2 tokens): factor 1 allows 2
    seq.append_token(3)
    assert proposer.propose(seq, 3) == [4, 9, 1]  # match "1 2 3": 3 allowed
    seq.append_token(7)  # "3 7" never occurred, nor "7": nothing
    assert proposer.propose(seq, 3) == []
    assert proposer.global_tree is None


def test_the_global_tree_drafts_an_earlier_output_and_keeps_a_bounded_number():
    proposer = suffix()
    outputs = [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23], [30, 31, 32, 33, 34]]
    for i, out in enumerate(outputs):
        seq = finished([1, 2, 3], out)
        proposer.propose(seq, 2)  # builds its own tree, dropped by finish
        proposer.finish(seq)
        assert proposer.num_cached_requests == min(i + 1, 2)
    assert dump(proposer.global_tree) == ref_dump(outputs[1:], 8)  # the oldest evicted
    assert proposer.propose(Sequence([0, 20, 21], 16), 4) == [22, 23]
    assert proposer.propose(Sequence([0, 10, 11, 12], 16), 4) == []  # evicted
    assert not proposer._trees.get(seq)
    with_drafts = finished([1], [40, 41, 42])
    with_drafts.add_draft_tokens([43, 44])  # a failed verify step's request is aborted with its drafts
    proposer.finish(with_drafts)
    assert proposer.propose(Sequence([0, 41, 42], 16), 4) == []  # learnt [40, 41, 42], not the drafts
    assert proposer.propose(Sequence([0, 40, 41], 16), 4) == [42]


def test_the_better_scoring_tree_wins():
    proposer = suffix(max_cached_requests=4)
    for _ in range(3):  # "7 8" -> 9 in the global tree, three times
        proposer.finish(finished([0], [7, 8, 9]))
    # locally "7 8" was followed by 6 once and by 9 once: share 1/2 against 1 in the global tree
    seq = Sequence([7, 8, 6, 1, 7, 8, 9, 2, 7, 8], 16)
    assert proposer.propose(seq, 1) == [9]
    local = suffix(max_cached_requests=0)
    assert local.propose(seq, 1) == [6]  # the tie between 6 and 9 goes to the smaller token


# --- config ----------------------------------------------------------------------------------
def test_suffix_config_defaults_and_keys():
    cfg = SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 6, '
                                  '"suffix_decoding_max_tree_depth": 32, "suffix_decoding_min_token_prob": 0.2}')
    assert (cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_min_token_prob) == (32, 0.2)
    assert (cfg.suffix_decoding_max_cached_requests, cfg.suffix_decoding_max_spec_factor) == (64, 1.0)
    assert cfg.prompt_lookup_min is None and cfg.prompt_lookup_max is None
    ngram = SpeculativeConfig()
    assert (ngram.prompt_lookup_min, ngram.prompt_lookup_max, ngram.suffix_decoding_max_tree_depth) == (3, 4, None)
    assert SpeculativeConfig(method="suffix", suffix_decoding_max_cached_requests=0).suffix_decoding_max_cached_requests == 0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "suffix", "prompt_lookup_min": 2}, "do not apply to method 'suffix'"),
        ({"method": "ngram", "suffix_decoding_max_tree_depth": 24}, "do not apply to method 'ngram'"),
        ({"method": "suffix", "suffix_decoding_max_tree_depth": 1}, "suffix_decoding_max_tree_depth"),
        ({"method": "suffix", "suffix_decoding_max_tree_depth": 4.0}, "suffix_decoding_max_tree_depth"),
        ({"method": "suffix", "num_speculative_tokens": 24}, "must be < suffix_decoding_max_tree_depth"),
        ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests"),
        ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "suffix_decoding_max_spec_factor"),
        ({"method": "suffix", "suffix_decoding_max_spec_factor": float("inf")}, "suffix_decoding_max_spec_factor"),
        ({"method": "suffix", "suffix_decoding_max_spec_factor": "2"}, "suffix_decoding_max_spec_factor"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": -0.1}, "suffix_decoding_min_token_prob"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": True}, "suffix_decoding_min_token_prob"),
        ({"method": "suffix", "suffix_decoding_typo": 1}, "unknown speculative_config keys"),
    ],
)
def test_bad_suffix_configs_are_value_errors(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)
