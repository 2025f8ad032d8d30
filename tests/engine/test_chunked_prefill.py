"""Chunked prefill: prompts longer than the step's token budget, computed over several steps.

Every expectation comes from the same engine with a budget large enough for
whole prompts, or from transformers; the chunked run must match them.
"""

from __future__ import annotations

import random

import pytest
from conftest import TINY_ARCHS, hf_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.engine.scheduler import SchedulerOutput

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(lengths: list[int], seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(n)]} for n in lengths]


def _record_steps(llm: LLM) -> list[list[tuple[int, int, bool, int]]]:
    """Wrap the scheduler so every planned step is kept, as planned, for inspection.

    Per step: (num_computed_tokens, num_new_tokens, samples, number of forks)
    of each scheduled sequence, read before the step runs.
    """
    scheduler = llm.llm_engine.scheduler
    plan = scheduler.schedule
    steps: list[list[tuple[int, int, bool, int]]] = []

    def recording() -> SchedulerOutput:
        out = plan()
        steps.append([(s.num_computed_tokens, s.num_new_tokens, s.samples, len(s.forks)) for s in out.scheduled])
        return out

    scheduler.schedule = recording
    return steps


def _num_cut_prompts(steps: list[list[tuple[int, int, bool, int]]]) -> int:
    return sum(1 for step in steps for _, _, samples, _ in step if not samples)


def _tokens(outs) -> list[list[int]]:  # noqa: ANN001
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_chunked_greedy_matches_transformers(arch: str, tiny_model_dirs, hf_tiny) -> None:  # noqa: ANN001
    # budget 16 with blocks of 8: chunks end inside and on block boundaries,
    # decodes of the first prompts share steps with the later prompts' chunks
    llm = LLM(tiny_model_dirs[arch], num_kv_blocks=64, max_model_len=256, block_size=8, max_num_batched_tokens=16)
    steps = _record_steps(llm)
    prompts = _prompts([5, 37, 60, 23], seed=21)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _num_cut_prompts(steps) >= 6
    assert all(sum(new for _, new, _, _ in step) <= 16 for step in steps)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_tiny[arch], prompt["prompt_token_ids"], 12)
    assert llm.llm_engine.block_manager.num_free_blocks == 64


@pytest.mark.slow
def test_smollm_chunked_equals_whole_prompts(smollm_tokenizer) -> None:  # noqa: ANN001
    texts = ["The capital of France is", "Write a haiku about the sea, the moon and the old lighthouse keeper:"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # the default (8-bit) activations, batch-invariant: by default a whole prompt's attention runs the prefill
    # kernel and a chunk's the decode kernel, sums in other orders, and on 8-bit activations a last-bit
    # difference can move a rounding step and a near-tie; with the mode every prompt token runs the decode
    # kernel, so the chunked run equals the whole one bit for bit (docs/batch-invariance.md)
    whole = LLM(num_kv_blocks=64, max_model_len=256, batch_invariant=True)
    chunked = LLM(num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=7, batch_invariant=True)
    steps = _record_steps(chunked)
    assert _tokens(chunked.generate(texts, params, use_tqdm=False)) == _tokens(whole.generate(texts, params, use_tqdm=False))
    assert _num_cut_prompts(steps) >= 2
    assert chunked.llm_engine.block_manager.num_free_blocks == 64


def test_prompt_logprobs_are_whole_when_the_prompt_is_chunked(tiny_model_dirs) -> None:  # noqa: ANN001
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, ignore_eos=True)
    prompts = _prompts([30, 9], seed=4)
    whole = LLM(tiny_model_dirs["qwen2"], num_kv_blocks=64, max_model_len=128, block_size=8)
    chunked = LLM(tiny_model_dirs["qwen2"], num_kv_blocks=64, max_model_len=128, block_size=8,
                  max_num_batched_tokens=8)
    steps = _record_steps(chunked)
    want = whole.generate(prompts, params, use_tqdm=False)
    got = chunked.generate(prompts, params, use_tqdm=False)
    assert _num_cut_prompts(steps) >= 3
    for w, g, p in zip(want, got, prompts):
        assert len(g.prompt_logprobs) == len(p["prompt_token_ids"]) and g.prompt_logprobs[0] is None
        for wpos, gpos in zip(w.prompt_logprobs[1:], g.prompt_logprobs[1:]):
            assert list(wpos) == list(gpos)  # the same tokens, in the same order
            for token_id, lp in wpos.items():
                assert gpos[token_id].rank == lp.rank
                assert gpos[token_id].logprob == pytest.approx(lp.logprob, abs=1e-4)
        assert g.outputs[0].token_ids == w.outputs[0].token_ids


def test_samples_fork_after_the_last_chunk(tiny_model_dirs) -> None:  # noqa: ANN001
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    prompt = _prompts([29], seed=9)
    whole = LLM(tiny_model_dirs["llama"], num_kv_blocks=64, max_model_len=128, block_size=4)
    chunked = LLM(tiny_model_dirs["llama"], num_kv_blocks=64, max_model_len=128, block_size=4,
                  max_num_batched_tokens=8)
    steps = _record_steps(chunked)
    want = whole.generate(prompt, params, use_tqdm=False)[0]
    got = chunked.generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    # 29 tokens at 8 a step: 3 cut steps, then the last chunk starts the 2 forks
    assert _num_cut_prompts(steps) == 3
    assert steps[:4] == [[(0, 8, False, 0)], [(8, 8, False, 0)], [(16, 8, False, 0)], [(24, 5, True, 2)]]
    assert chunked.llm_engine.block_manager.num_free_blocks == 64


def test_abort_in_the_middle_of_a_chunked_prompt_frees_its_blocks(tiny_model_dirs) -> None:  # noqa: ANN001
    llm = LLM(tiny_model_dirs["qwen3"], num_kv_blocks=32, max_model_len=128, block_size=8, max_num_batched_tokens=8)
    engine = llm.llm_engine
    engine.add_request("long", _prompts([50], seed=1)[0], SamplingParams(n=2, max_tokens=4, seed=0))
    assert engine.step() == []  # the first 8 of 50 prompt tokens: nothing to report
    seq = engine.scheduler.running[0]
    # blocks come chunk by chunk: one block of 8 per step
    assert seq.num_computed_tokens == 8 and len(seq.block_table) == 1
    assert engine.step() == []
    assert seq.num_computed_tokens == 16 and len(seq.block_table) == 2
    assert engine.block_manager.num_free_blocks == 32 - 2
    engine.abort_request("long")
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == 32


def test_chunks_take_blocks_as_they_go_and_a_tight_pool_gives_the_same_tokens(tiny_model_dirs) -> None:  # noqa: ANN001
    """Under a pool too small for every prompt at once, chunks are cut to the free blocks and requests
    preempted; the greedy tokens still equal an ample pool's and the pool ends whole."""
    prompts = _prompts([60, 45, 70, 30, 52], seed=33)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kwargs = dict(max_model_len=128, block_size=4, max_num_batched_tokens=24, enable_prefix_caching=False,
                  itl_target_ms=None)  # cuts by the pool only, not by the latency target's share
    ample = LLM(tiny_model_dirs["llama"], num_kv_blocks=256, **kwargs)
    want = _tokens(ample.generate(prompts, params, use_tqdm=False))
    assert ample.llm_engine.scheduler.num_preemptions == 0

    tight = LLM(tiny_model_dirs["llama"], num_kv_blocks=40, **kwargs)  # 160 slots for 257 prompt tokens
    engine, bm = tight.llm_engine, tight.llm_engine.block_manager
    plan, cut_by_pool = engine.scheduler.schedule, []

    def recording() -> SchedulerOutput:
        out = plan()
        # a prompt chunk shorter than both its remaining prompt and the budget left: cut by the pool
        for s in out.scheduled:
            if not s.samples and out.num_batched_tokens < engine.scheduler.max_num_batched_tokens:
                cut_by_pool.append(bm.num_free_blocks)
        return out

    engine.scheduler.schedule = recording
    got = _tokens(tight.generate(prompts, params, use_tqdm=False))
    assert got == want
    assert cut_by_pool and all(free == 0 for free in cut_by_pool)
    assert engine.scheduler.num_preemptions > 0
    assert bm.num_free_blocks == bm.num_blocks
