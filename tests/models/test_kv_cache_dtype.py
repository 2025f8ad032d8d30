"""A KV cache narrower than the model's dtype (``kv_cache_dtype``) on the bundled SmolLM2.

A 2-byte cache rounds K and V once when they are written. The expectations
come from the same engine with a float32 cache (teacher-forced on the tokens
the 2-byte run chose) or from the same 2-byte engine run another way (whole
prompts vs chunks, SDPA vs the native kernel); none are hard-coded.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FLOAT_ACTIVATIONS

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.runner.decode_graph import num_programs

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
]
NUM_NEW = 24
MEMORY = 64 << 20  # the same bytes for every cache dtype


def _engine(kv_cache_dtype: str, **kwargs) -> LLM:  # noqa: ANN003
    return LLM(kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=MEMORY, max_model_len=512,
               **FLOAT_ACTIVATIONS, **kwargs)


def _pool_whole(llm: LLM) -> bool:
    bm = llm.llm_engine.block_manager
    return bm.num_free_blocks == bm.num_blocks


@pytest.fixture(scope="module")
def float32_llm() -> LLM:
    return _engine("auto")


def test_unknown_kv_cache_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(model="model.gguf", kv_cache_dtype="fp8")


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype,tolerance", [("float16", 0.02), ("bfloat16", 0.08)])
def test_half_cache_doubles_the_blocks_and_stays_close_to_float32(
    float32_llm: LLM, kv_cache_dtype: str, tolerance: float
) -> None:
    llm = _engine(kv_cache_dtype)
    runner, ref_runner = llm.llm_engine.model_runner, float32_llm.llm_engine.model_runner
    assert runner.kv_cache.dtype == getattr(torch, kv_cache_dtype)
    assert ref_runner.kv_cache.dtype == torch.float32
    assert runner.num_kv_blocks == 2 * ref_runner.num_kv_blocks

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NUM_NEW, logprobs=0, ignore_eos=True), use_tqdm=False)
    assert _pool_whole(llm)
    # teacher-forced: the float32-cache engine scores the tokens the 2-byte run chose
    tok = llm.get_tokenizer()
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]
    forced = float32_llm.generate(
        [{"prompt_token_ids": ids + o.outputs[0].token_ids} for ids, o in zip(prompt_ids, outs)],
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
        use_tqdm=False,
    )
    worst_gap, worst_diff = 0.0, 0.0
    for ids, out, ref in zip(prompt_ids, outs, forced):
        chosen = out.outputs[0].token_ids
        assert len(chosen) == NUM_NEW
        for i, token in enumerate(chosen):
            position = ref.prompt_logprobs[len(ids) + i]  # {token id: Logprob} at that position
            best = max(lp.logprob for lp in position.values())
            # greedy under a 2-byte cache picks float32's best token, or one within the tolerance of it
            worst_gap = max(worst_gap, best - position[token].logprob)
            worst_diff = max(worst_diff, abs(out.outputs[0].logprobs[i][token].logprob - position[token].logprob))
    assert worst_gap <= tolerance, worst_gap
    assert worst_diff <= tolerance, worst_diff
    assert _pool_whole(float32_llm)


@pytest.mark.slow
def test_half_cache_gives_the_same_tokens_whole_or_chunked() -> None:
    """New K/V are seen as stored on every path, so chunking a prompt changes nothing."""
    prompts = [{"prompt_token_ids": list(range(200 + 37 * i, 200 + 37 * i + n))} for i, n in enumerate([90, 150, 33])]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    whole = _engine("float16", max_num_batched_tokens=512).generate(prompts, params, use_tqdm=False)
    chunked_llm = _engine("float16", max_num_batched_tokens=40)
    chunked = chunked_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in chunked] == [o.outputs[0].token_ids for o in whole]
    assert _pool_whole(chunked_llm)


@pytest.mark.slow
def test_half_cache_sdpa_and_native_kernel_agree() -> None:
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW)
    native = _engine("bfloat16")
    assert native.llm_engine.model_runner.backend.name == "cpu_paged"
    sdpa = _engine("bfloat16", attention_backend="sdpa")
    got = native.generate(PROMPTS, params, use_tqdm=False)
    want = sdpa.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


@pytest.mark.slow
def test_int8_with_a_half_cache_runs_native_step_programs() -> None:
    """Replayed int8 decode steps (native step programs) read a 2-byte cache too, and agree with the eager path."""
    llm = _engine("float16", quantization="int8")
    runner = llm.llm_engine.model_runner
    assert runner.captured_decode is not None and runner.captured_decode.native_programs
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    replayed = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    graphs = runner.captured_decode.graphs
    assert graphs and all(num_programs(g.runs) == len(g.runs) == 1 for g in graphs.values())
    kept, runner.captured_decode = runner.captured_decode, None
    try:
        eager = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        runner.captured_decode = kept
    assert [len(t) for t in replayed] == [8] * len(PROMPTS) and replayed == eager
    assert _pool_whole(llm)
