"""Sampling settings that leave no token to sample (issue 53, item 2), through the offline API.

Where it can be known before the request runs, ``LLM.generate`` raises
ValueError and the engine holds nothing; where it shows only while it runs (a
``choice`` written in fewer tokens than ``min_tokens``), the sequence ends
with finish reason ``"no_valid_token"`` and what it wrote, and the requests
beside it are untouched. The expected token ids come from the tokenizer, not
from the code under test.
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams

PROMPT = "Once"


@pytest.fixture(scope="module")
def llm(tiny_model_dirs: dict[str, str]) -> LLM:
    return LLM(tiny_model_dirs["llama"], num_kv_blocks=64, max_model_len=128, block_size=8, num_threads=1)


def _one_token(llm: LLM, word: str) -> int:
    ids = llm.llm_engine.tokenizer.encode(word, add_special_tokens=False)
    assert len(ids) == 1, (word, ids)
    return ids[0]


def _assert_idle(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_the_issues_bad_words_trigger_is_a_value_error(llm: LLM) -> None:
    # the issue's {"allowed_token_ids": [0], "bad_words": ["<|endoftext|>"]}: token 0 is that word
    assert _one_token(llm, "<|endoftext|>") == 0
    params = SamplingParams(max_tokens=4, allowed_token_ids=[0], bad_words=["<|endoftext|>"])
    with pytest.raises(ValueError, match=r"^allowed_token_ids \[0\] are all banned by bad_words"):
        llm.generate(PROMPT, params, use_tqdm=False)
    _assert_idle(llm)


def test_allowed_ids_banned_by_bad_words_and_min_tokens_together(llm: LLM) -> None:
    eos = sorted(llm.llm_engine.tokenizer.eos_token_ids)
    yes = _one_token(llm, "yes")
    # each alone leaves a token; together (bad_words take "yes", min_tokens the EOS ids) none
    for ok in (dict(bad_words=["yes"]), dict(min_tokens=2)):
        out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=[yes, *eos], **ok),
                           use_tqdm=False)[0].outputs[0]
        assert out.finish_reason in ("stop", "length")
    with pytest.raises(ValueError, match="^min_tokens would ban every token"):
        llm.generate(PROMPT, SamplingParams(max_tokens=3, allowed_token_ids=[yes, *eos], bad_words=["yes"],
                                            min_tokens=2), use_tqdm=False)
    _assert_idle(llm)


def test_allowed_ids_that_cannot_start_the_structured_output_are_a_value_error(llm: LLM) -> None:
    # the issue's structured_outputs.json with allowed_token_ids 0..99 and n: 2; "{" is none of them
    assert _one_token(llm, "{") >= 100
    params = SamplingParams(n=2, max_tokens=8, allowed_token_ids=list(range(100)),
                            structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    with pytest.raises(ValueError, match="^allowed_token_ids leave no token that can start the structured output"):
        llm.generate(PROMPT, params, use_tqdm=False)
    # with "{" allowed, the same request runs
    params.allowed_token_ids = [*range(100), _one_token(llm, "{")]
    outs = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs
    assert len(outs) == 2 and all(o.text.startswith("{") for o in outs)
    _assert_idle(llm)


def test_min_tokens_past_every_choice_is_a_value_error() -> None:
    choice = StructuredOutputsParams(choice=["yes", "no"])
    with pytest.raises(ValueError, match=r"^min_tokens=4 is more tokens than any structured_outputs.choice"):
        SamplingParams(max_tokens=8, min_tokens=4, structured_outputs=choice)
    SamplingParams(max_tokens=8, min_tokens=3, structured_outputs=choice)  # "yes" may take 3 tokens


def test_a_choice_that_ends_before_min_tokens_finishes_cleanly(llm: LLM) -> None:
    eos = sorted(llm.llm_engine.tokenizer.eos_token_ids)
    yes, no = _one_token(llm, "yes"), _one_token(llm, "no")
    # only whole-word tokens: every output is one token long, and then only EOS, banned until min_tokens=2
    dead_end = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=4, min_tokens=2,
                              allowed_token_ids=[yes, no, *eos],
                              structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate(PROMPT, plain, use_tqdm=False)[0].outputs[0].token_ids
    ended, beside = llm.generate([PROMPT, PROMPT], [dead_end, plain], use_tqdm=False)
    assert getattr(ended, "error", None) is None
    for out in ended.outputs:
        assert out.finish_reason == "no_valid_token"
        assert out.text in ("yes", "no") and len(out.token_ids) == 1
    assert beside.outputs[0].token_ids == alone  # the request beside it never noticed
    _assert_idle(llm)
    # the engine goes on serving
    assert llm.generate(PROMPT, plain, use_tqdm=False)[0].outputs[0].token_ids == alone
