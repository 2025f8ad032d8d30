"""Speculative decoding with a draft model (method "draft_model"), on tiny random-weight models.

The draft engine is a second engine of our own; its greedy drafts are
verified by the target. Lossless: greedy output equals plain decoding token
for token. Each test asserts that drafts were proposed (and, with the target
as its own draft, accepted), so none passes with speculation idle.
"""

from __future__ import annotations

import shutil

import pytest

from pagedllm import LLM, SamplingParams

MAX_TOKENS = 24
PROMPT = {"prompt_token_ids": [1000 + (i % 7) for i in range(40)]}


def spec(model: str) -> dict:
    # cost_model off: the tests run drafts whatever this machine's timings say
    return {"method": "draft_model", "model": model, "num_speculative_tokens": 3, "cost_model": False}


def generate(llm: LLM, prompts: list) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_pools_whole(llm: LLM) -> None:
    engine = llm.llm_engine
    for e in (engine, engine.draft_proposer.engine):
        assert not e.requests
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks


@pytest.fixture(scope="module")
def plain_llama(tiny_model_dirs):
    return LLM(tiny_model_dirs["llama"], num_kv_blocks=128, block_size=4, max_model_len=256)


def test_the_target_as_its_own_draft_is_accepted_and_lossless(tiny_model_dirs, plain_llama):
    path = tiny_model_dirs["llama"]
    llm = LLM(path, num_kv_blocks=128, block_size=4, max_model_len=256, speculative_config=spec(path))
    prompts = [PROMPT, {"prompt_token_ids": [2000 + 3 * i for i in range(9)]}]
    assert generate(llm, prompts) == generate(plain_llama, prompts)
    s = llm.llm_engine.speculator
    assert s.num_draft_tokens > 0
    # the same weights draft what the target computes: nearly every draft is accepted
    assert s.num_accepted_tokens >= 0.9 * s.num_draft_tokens
    assert_pools_whole(llm)


@pytest.mark.parametrize("draft_arch", ["qwen3", "llama3"])
def test_another_model_drafts_and_the_output_is_still_plain_decoding(tiny_model_dirs, plain_llama, draft_arch):
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=128, block_size=4, max_model_len=256,
              speculative_config=spec(tiny_model_dirs[draft_arch]))
    assert generate(llm, [PROMPT]) == generate(plain_llama, [PROMPT])
    assert llm.llm_engine.speculator.num_draft_tokens > 0
    assert_pools_whole(llm)


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_model_dirs, tmp_path):
    from transformers import AutoTokenizer

    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_model_dirs["qwen3"], other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<a-token-the-target-lacks>"])
    tok.save_pretrained(other)
    with pytest.raises(ValueError, match="another tokenizer"):
        LLM(tiny_model_dirs["llama"], num_kv_blocks=128, block_size=4, max_model_len=256,
            speculative_config=spec(str(other)))
