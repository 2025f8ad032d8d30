"""The n-gram proposer on hand-made token lists, the config's validation and the per-sequence policy (no torch)."""

from __future__ import annotations

import random

import pytest

from pagedllm.engine.sequence import Sequence
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.ngram_proposer import propose_ngram
from pagedllm.spec_decode.speculator import Speculator


# --- propose_ngram -------------------------------------------------------------------------
def test_the_tokens_after_an_earlier_copy_of_the_tail_are_drafted():
    tokens = [5, 1, 2, 3, 7, 8, 9, 4, 1, 2, 3]
    assert propose_ngram(tokens, 3, 1, 3) == [7, 8, 9]
    assert propose_ngram(tokens, 2, 1, 3) == [7, 8]


def test_the_draft_stops_at_the_end_of_the_list():
    assert propose_ngram([1, 2, 9, 1, 2], 5, 1, 2) == [9, 1, 2]


def test_longer_ngrams_win_over_later_shorter_ones():
    # tail [1, 2, 3]: the 3-gram recurs at 0 (-> 4); the 1-gram [3] recurs later at 7 (-> 6)
    tokens = [1, 2, 3, 4, 0, 0, 0, 3, 6, 1, 2, 3]
    assert propose_ngram(tokens, 1, 1, 3) == [4]
    assert propose_ngram(tokens, 1, 1, 1) == [6]


def test_the_latest_match_of_one_length_wins():
    tokens = [1, 2, 10, 1, 2, 20, 1, 2]
    assert propose_ngram(tokens, 1, 2, 2) == [20]


def test_no_recurring_ngram_no_draft():
    assert propose_ngram([1, 2, 3, 4, 5], 3, 1, 3) == []
    assert propose_ngram([1, 2, 3, 4, 2, 5], 3, 2, 3) == []  # only a 1-gram recurs, min_n is 2
    assert propose_ngram([7], 3, 1, 3) == []
    assert propose_ngram([], 3, 1, 3) == []
    assert propose_ngram([1, 1, 1], 0, 1, 3) == []


def test_a_match_may_run_into_the_tail_itself():
    # the latest earlier [3, 3] starts at 1: what follows it is the last token
    assert propose_ngram([3, 3, 3, 3], 4, 1, 2) == [3]
    assert propose_ngram([3, 3, 3, 3], 4, 1, 1) == [3]


def scan(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule written as a plain scan: longest n first, the latest earlier match that a token follows."""
    num = len(token_ids)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        for start in range(num - n - 1, -1, -1):
            if token_ids[start : start + n] == token_ids[num - n :]:
                return token_ids[start + n : start + n + k]
    return []


def test_the_byte_search_finds_what_a_plain_scan_finds():
    # small vocabularies make many matches; ids past 2**32 and byte patterns that recur off a token
    # boundary check that only aligned hits count
    rng = random.Random(0)
    for _ in range(2000):
        vocab = rng.choice([2, 3, 5, 300, 2**40, 257])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        lo, hi = sorted((rng.randint(1, 4), rng.randint(1, 4)))
        k = rng.randint(1, 5)
        assert propose_ngram(tokens, k, lo, hi) == scan(tokens, k, lo, hi), (tokens, k, lo, hi)


# --- SpeculativeConfig ----------------------------------------------------------------------
def test_config_from_vllm_keys_and_json():
    cfg = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 3}'
    )
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 5, 2, 3)
    assert SpeculativeConfig.parse({"method": "ngram"}) == SpeculativeConfig()
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "eagle"}, "not implemented yet"),
        ({"method": "draft_model"}, "needs a 'model'"),
        ({"method": "draft_model", "model": ""}, "needs a 'model'"),
        ({"method": "ngram", "model": "/some/path"}, "not 'ngram'"),
        ({"method": "draft_model", "model": "/m", "prompt_lookup_min": 2}, "do not apply to method 'draft_model'"),
        ({"method": "draft_model", "model": "/m", "suffix_decoding_max_tree_depth": 8}, "do not apply"),
        ({"method": "magic"}, "unknown speculative method"),
        ({"num_speculative_tokens": 3}, "needs a 'method'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "ngram", "typo": 1}, "unknown speculative_config keys"),
        ("{not json", "not valid JSON"),
        (["ngram"], "must be a dict"),
    ],
)
def test_bad_configs_are_value_errors(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_engine_config_takes_a_dict_and_refuses_the_contiguous_allocator(tmp_path):
    from pagedllm.config import EngineConfig

    model = str(tmp_path)
    cfg = EngineConfig(model=model, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert cfg.speculative_config == SpeculativeConfig(num_speculative_tokens=2)
    with pytest.raises(ValueError, match="kv_allocator='paged'"):
        EngineConfig(model=model, kv_allocator="contiguous", speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="unknown speculative method"):
        EngineConfig(model=model, speculative_config={"method": "nope"})


# --- Speculator: the per-sequence policy ---------------------------------------------------------
# (cost_model off: these are the rules around it; test_cost_model.py tests the cost model's)
def repeating(n: int = 12) -> Sequence:
    return Sequence([1, 2, 3, 4] * (n // 4), 16)


def test_only_registered_sequences_propose_within_their_length():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=3, cost_model=False), max_model_len=100)
    seq = repeating()
    assert spec.propose(seq, 10, 1) == []  # not registered (a beam, say)
    spec.register(seq, eligible=True, max_len=14)
    assert spec.propose(seq, 10, 1) == [1]  # 12 tokens, at most 14: one draft and the token after it
    spec.register(seq, eligible=True)
    assert spec.propose(seq, 10, 1) == [1, 2, 3]
    assert spec.propose(seq, 2, 1) == [1, 2]  # the step's token budget
    spec.register(seq, eligible=False)
    assert spec.propose(seq, 10, 1) == []


def test_a_large_batch_decodes_plainly():
    spec = Speculator(SpeculativeConfig(max_batch_size=4, cost_model=False), max_model_len=100)
    seq = repeating()
    spec.register(seq, eligible=True)
    assert spec.propose(seq, 10, 4) != []
    assert spec.propose(seq, 10, 5) == []


def test_a_sequence_whose_drafts_keep_failing_backs_off():
    spec = Speculator(SpeculativeConfig(max_failures=2, backoff_steps=3, cost_model=False), max_model_len=100)
    seq = repeating()
    spec.register(seq, eligible=True)
    spec.observe(seq, 4, 0)
    assert spec.propose(seq, 10, 1) != []  # one failure: still proposing
    spec.observe(seq, 4, 1)  # an acceptance resets the count
    spec.observe(seq, 4, 0)
    assert spec.propose(seq, 10, 1) != []
    spec.observe(seq, 4, 0)  # two in a row: three plain steps
    assert [spec.propose(seq, 10, 1) for _ in range(4)] == [[], [], [], [1, 2, 3, 4]]
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (4, 16, 1)
