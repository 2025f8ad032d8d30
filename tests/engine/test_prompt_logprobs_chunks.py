"""Prompt logprobs inside the step budget (issue 53, item 4).

A prompt whose tokens are scored is computed at most ``MAX_SCORED_PROMPT_TOKENS``
a step whatever ``max_num_batched_tokens`` allows, and its logits a few rows at
a time (``PROMPT_LOGITS_ROWS``); the scored values must still be the whole
prompt's. The oracle is transformers' one forward over the whole prompt in
float64, on the tiny random Llama's weights; another request that scores
nothing is not held to that chunk size.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.scheduler import SchedulerOutput
from pagedllm.engine.step_budget import MAX_SCORED_PROMPT_TOKENS
from pagedllm.runner.prompt_scoring import PROMPT_LOGITS_ROWS

PROMPT_LEN = 2 * MAX_SCORED_PROMPT_TOKENS + 77  # three chunks, the last one cut short
NUM_TOP = 5
TOL = 1e-4


@pytest.fixture(scope="module")
def prompt_ids() -> list[int]:
    rng = random.Random(53)
    return [rng.randrange(100, 49000) for _ in range(PROMPT_LEN)]


def _planned(llm: LLM) -> list[list[tuple[str, int, int]]]:
    """Record every step as planned: (request id, num_computed_tokens, num_new_tokens) of each entry."""
    scheduler = llm.llm_engine.scheduler
    plan = scheduler.schedule
    steps: list[list[tuple[str, int, int]]] = []

    def recording() -> SchedulerOutput:
        out = plan()
        steps.append([(s.seq.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled])
        return out

    scheduler.schedule = recording
    return steps


def _whole_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """log p(v | ids[:t]) for every t >= 1 and every v, from one transformers forward in float64."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)[:-1]  # [len(ids) - 1, vocab]


def test_scored_prompt_in_chunks_equals_the_whole_prompt(tiny_model_dirs, hf_tiny, prompt_ids) -> None:  # noqa: ANN001
    # a budget that would take the whole prompt in one step
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=128, block_size=16, max_model_len=1024,
              max_num_batched_tokens=4096, num_threads=1)
    steps = _planned(llm)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=NUM_TOP, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0]
    chunks = [n for step in steps for _, c, n in step if c < PROMPT_LEN]
    assert chunks == [MAX_SCORED_PROMPT_TOKENS, MAX_SCORED_PROMPT_TOKENS, 77]
    assert MAX_SCORED_PROMPT_TOKENS > PROMPT_LOGITS_ROWS  # each chunk's logits take several passes

    want = _whole_prompt_logprobs(hf_tiny["llama"], prompt_ids)
    assert len(out.prompt_logprobs) == PROMPT_LEN and out.prompt_logprobs[0] is None
    for t, got in enumerate(out.prompt_logprobs[1:]):
        row = want[t]
        target = prompt_ids[t + 1]
        for tok, lp in got.items():
            assert lp.logprob == pytest.approx(float(row[tok]), abs=TOL), (t, tok)
        # ranks and the top set, up to values the two computations may order differently (within TOL)
        assert int((row > row[target] + TOL).sum()) + 1 <= got[target].rank <= int((row >= row[target] - TOL).sum()), t
        top = [tok for tok, lp in got.items() if lp.rank <= NUM_TOP]
        assert len(top) == NUM_TOP and len(got) in (NUM_TOP, NUM_TOP + 1), t
        kth = float(row.topk(NUM_TOP).values[-1])
        assert all(float(row[tok]) >= kth - TOL for tok in top), t
    assert llm.llm_engine.block_manager.num_free_blocks == 128


def test_only_a_scored_prompt_is_held_to_the_chunk(tiny_model_dirs, prompt_ids) -> None:  # noqa: ANN001
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=128, block_size=16, max_model_len=1024,
              max_num_batched_tokens=4096, num_threads=1)
    steps = _planned(llm)
    engine = llm.llm_engine
    engine.add_request("scored", {"prompt_token_ids": prompt_ids},
                       SamplingParams(max_tokens=1, prompt_logprobs=0))
    engine.add_request("plain", {"prompt_token_ids": prompt_ids[::-1]}, SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    # the plain prompt is admitted beside the first chunk, with the rest of the budget: whole
    assert steps[0] == [("scored", 0, MAX_SCORED_PROMPT_TOKENS), ("plain", 0, PROMPT_LEN)]
    assert engine.block_manager.num_free_blocks == 128
