"""thinking_token_budget: the reasoning block's end forced through the engine after N tokens.

The rule (``pagedllm/thinking_budget.py``) is checked on a hand-made
vocabulary in ``tests/core/test_thinking_budget_rule.py``; here it runs end
to end on a tiny random Llama: greedy output with a budget must be the unconstrained greedy output up to the budget, then the
end marker's tokens exactly, then what the model writes greedily after a
prompt that already holds all of that (computed by a second, unconstrained
run), which is what "the answer continues" means.
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams


@pytest.fixture(scope="module")
def llm(tiny_model_dirs: dict[str, str]) -> LLM:
    return LLM(tiny_model_dirs["llama"], num_kv_blocks=64, max_model_len=256, block_size=16, num_threads=1)


def _ids(llm: LLM, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text, add_special_tokens=False)


def _greedy(llm: LLM, prompt_ids: list[int], max_tokens: int, **kwargs) -> list[int]:  # noqa: ANN003
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)
    out = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def test_budget_forces_the_end_then_the_answer_continues(llm: LLM) -> None:
    prompt = _ids(llm, "Question: why is the sky blue?\n<think>\n")  # the template opened the block
    forced = _ids(llm, "</think>") + _ids(llm, "\n\n")
    free = _greedy(llm, prompt, 24)
    budget = 5
    capped = _greedy(llm, prompt, 24, thinking_token_budget=budget)
    assert capped[:budget] == free[:budget]
    assert capped[budget : budget + len(forced)] == forced
    head = budget + len(forced)
    assert capped[head:] == _greedy(llm, prompt + capped[:head], 24 - head)
    assert "</think>" in llm.get_tokenizer().decode(capped)
    # budget 0: the block closes at the first token
    assert _greedy(llm, prompt, len(forced) + 2, thinking_token_budget=0)[: len(forced)] == forced


def test_a_prompt_that_glued_the_marker_to_its_neighbour_opens_the_block(llm: LLM) -> None:
    """SmolLM2's tokenizer spells " <think>" as `` <`` ``think`` ``>``: not the tokens of ``<think>`` alone."""
    prompt = _ids(llm, "Question: why is the sky blue? <think>")
    assert _ids(llm, "<think>")[0] not in prompt[-3:]  # the space and "<" are one token here
    forced = _ids(llm, "</think>") + _ids(llm, "\n\n")
    free = _greedy(llm, prompt, 16)
    capped = _greedy(llm, prompt, 16, thinking_token_budget=3)
    assert capped[:3] == free[:3] and capped[3 : 3 + len(forced)] == forced


def test_budget_counts_from_an_opening_marker_in_the_output(llm: LLM) -> None:
    # the prompt does not open the block; the model writes no <think>: the budget never acts
    prompt = _ids(llm, "Question: why is the sky blue?\n")
    free = _greedy(llm, prompt, 16)
    assert _greedy(llm, prompt, 16, thinking_token_budget=2) == free
    # a marker the model does write (its own 3rd and 4th tokens) opens the block there
    text = llm.get_tokenizer().decode(free[2:4])
    if _ids(llm, text) != free[2:4]:
        pytest.skip("those tokens do not round-trip through text")
    capped = _greedy(llm, prompt, 16, thinking_token_budget=3, think_start_str=text, think_end_str="</think>")
    close = _ids(llm, "</think>")
    assert capped[:7] == free[:7] and capped[7 : 7 + len(close)] == close


def test_every_sample_gets_the_budget(llm: LLM) -> None:
    prompt = _ids(llm, "Question: why?\n<think>\n")
    forced = _ids(llm, "</think>") + _ids(llm, "\n\n")
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, thinking_token_budget=4)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    for c in out.outputs:
        assert list(c.token_ids[4 : 4 + len(forced)]) == forced


def test_bad_budgets_are_value_errors(llm: LLM) -> None:
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-1)
    with pytest.raises(ValueError, match="think_end_str"):
        SamplingParams(thinking_token_budget=2, think_end_str="  ")
    assert llm.llm_engine.has_unfinished_requests() is False


def test_budget_then_a_grammar_from_the_block_end(llm: LLM) -> None:
    """With structured outputs the thinking is free and the grammar holds from the block's end."""
    prompt = _ids(llm, "Question: yes or no?\n<think>\n")
    forced = _ids(llm, "</think>") + _ids(llm, "\n\n")
    free = _greedy(llm, prompt, 4)
    choices = ["maybe so", "no way"]
    out = _greedy(llm, prompt, 40, thinking_token_budget=4,
                  structured_outputs=StructuredOutputsParams(choice=choices))
    head = 4 + len(forced)
    assert out[:4] == free and out[4:head] == forced  # the thinking, unconstrained; then the forced end
    assert llm.get_tokenizer().decode(out[head:], skip_special_tokens=True) in choices  # then the grammar's output, ended by it
    # without an open block the grammar holds from the first token (there is no reasoning to skip)
    plain = _greedy(llm, _ids(llm, "Question: yes or no?\n"), 40, thinking_token_budget=4,
                    structured_outputs=StructuredOutputsParams(choice=choices))
    assert llm.get_tokenizer().decode(plain, skip_special_tokens=True) in choices
