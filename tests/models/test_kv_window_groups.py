"""KV cache groups end to end: a tiny Gemma 3 (window 8, blocks of 4) gives back its out-of-window blocks
and still decodes transformers' greedy tokens, with chunked prompts, n=2 forks and preemption.

Its 5 layers (sliding, full, sliding, sliding, full) make 3 groups of 2 rows (kv_groups.py): full
(1, 4), window (0, 2), window (3, padded). The oracle is transformers' own cache (``hf_greedy``); the
block counts follow from the rule that a window group gives back a block once every key in it lies
before ``num_computed_tokens - 8 + 1``. Long prompts, prefix hits and each backend are covered against
transformers in tests/models/test_gemma3_sliding_window.py, which runs with the groups too.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import TINY_WINDOW, hf_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.llm import RequestFailedError
from pagedllm.kv_groups import model_kv_layout

BS = 4


@pytest.fixture(scope="module")
def gemma3(window_dirs: dict[str, str]):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    return window_dirs["gemma3"], AutoModelForCausalLM.from_pretrained(
        window_dirs["gemma3"], dtype=torch.float32, attn_implementation="eager").eval()


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in lengths]


def test_window_groups_give_back_blocks_and_keep_the_tokens(gemma3) -> None:  # noqa: ANN001
    path, hf = gemma3
    # eager: captured steps with groups are tests/models/test_gemma3_sliding_window.py's (a trace costs seconds)
    llm = LLM(path, num_kv_blocks=128, max_model_len=256, block_size=BS, max_num_batched_tokens=6, enforce_eager=True)
    engine = llm.llm_engine
    layout = model_kv_layout(engine.model_config)
    assert layout.windows == (None, TINY_WINDOW, TINY_WINDOW) and layout.num_rows == 2
    assert engine.model_runner.kv_cache.shape[1] == 2  # the pool's rows: one group's, not 5 layers
    prompt = _prompts([5], seed=3)[0]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 40)
    # the last step computes position 43: a window group gives back blocks 0..(43 - 8 + 1) // 4 - 1
    bm = engine.block_manager
    assert bm.num_window_released == 2 * ((43 - TINY_WINDOW + 1) // BS)
    # at most: the full group's 11 blocks (44 tokens), each window group the blocks of keys
    # c - 7 .. c + 5 (a chunk of 6): 5 blocks; without groups 3 x 11
    assert engine.peak_used_blocks <= 11 + 2 * 5
    assert bm.num_free_blocks == bm.num_blocks


def test_the_default_pool_holds_a_whole_prompt_in_every_group(gemma3) -> None:  # noqa: ANN001
    # The default pool was capped at max_num_seqs x max_model_len's blocks, one group's worth: a 60-token
    # prompt computed in one step holds 15 blocks in each of the 3 groups (its keys are all still in a window
    # while the step runs), 45 > 16, and the scheduler stalled with a RuntimeError
    path, hf = gemma3
    llm = LLM(path, max_model_len=64, max_num_seqs=1, block_size=BS, enforce_eager=True)
    assert llm.llm_engine.block_manager.num_blocks == 3 * (64 // BS)
    prompt = _prompts([60], seed=5)[0]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 4)


def test_a_prompt_step_the_pool_cannot_hold_fails_alone(gemma3) -> None:  # noqa: ANN001
    # 30 blocks hold one group's 16 for max_model_len, not the 45 a 60-token prompt computed in one step
    # holds in 3 groups: that request fails with the ways out named, a short one beside it still runs
    path, hf = gemma3
    llm = LLM(path, num_kv_blocks=30, max_model_len=64, block_size=BS, enforce_eager=True)
    long, short = _prompts([60, 6], seed=7)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(RequestFailedError, match="num_kv_blocks") as failed:
        llm.generate([{"prompt_token_ids": long}, {"prompt_token_ids": short}], params, use_tqdm=False)
    bad, good = failed.value.outputs
    assert bad.error is not None and "max_num_batched_tokens" in bad.error
    assert good.error is None and good.outputs[0].token_ids == hf_greedy(hf, short, 4)
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # nothing leaked
    # with prompts computed 8 tokens a step the window groups give blocks back as they go: at most 16 full
    # blocks and 5 in each window group (keys c - 7 .. c + 7), 26 <= 30
    chunked = LLM(path, num_kv_blocks=30, max_model_len=64, block_size=BS, max_num_batched_tokens=8,
                  enforce_eager=True)
    out = chunked.generate([{"prompt_token_ids": long}], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, long, 4)


@pytest.mark.slow
def test_window_groups_fork_n2_and_preempt(gemma3) -> None:  # noqa: ANN001
    path, hf = gemma3
    # one request of 41 + 2 x 24 tokens ends holding 10 shared + 2 x 7 full-group blocks and about 2 x 2 x 3
    # window blocks (36); 40 blocks cannot hold the three at once
    llm = LLM(path, num_kv_blocks=40, max_model_len=128, block_size=BS, max_num_batched_tokens=16,
              enforce_eager=True)
    prompts = _prompts([37, 30, 41], seed=5)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        expected = hf_greedy(hf, prompt, 24)
        assert [o.token_ids for o in out.outputs] == [expected, expected]
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_bench_memory_prints_each_groups_blocks(window_dirs: dict[str, str], capsys: pytest.CaptureFixture) -> None:
    """``bench memory`` on the windowed model: one 18-token prompt and 10 tokens out, in blocks of 4. The
    prompt's step holds the most blocks, 5 in every group (ceil(18 / 4)); a decode of token t holds
    ceil((t + 1) / 4) full blocks and at most 3 in each window group (keys t - 7 .. t span 3 blocks), so
    never more: 7 + 3 + 3 at t = 26, the last decode."""
    from pagedllm.bench.memory import MemoryWorkload, print_groups_and_state, run_allocator

    workload = MemoryWorkload(num_requests=1, min_prompt=18, max_prompt=18, median_output=10, sigma=0.0,
                              max_model_len=64, block_size=BS, num_kv_slots=256)
    assert workload.requests()[0][1] == 10
    summary, _ = run_allocator(window_dirs["gemma3"], workload, "paged", "max", None)
    per_block = summary["kv_bytes_per_block"]
    assert summary["kv_groups"] == [
        {"group": 0, "kind": "full", "window": None, "layers": [1, 4], "peak_blocks": 5, "peak_bytes": 5 * per_block},
        {"group": 1, "kind": "window", "window": TINY_WINDOW, "layers": [0, 2], "peak_blocks": 5,
         "peak_bytes": 5 * per_block},
        {"group": 2, "kind": "window", "window": TINY_WINDOW, "layers": [3], "peak_blocks": 5,
         "peak_bytes": 5 * per_block},
    ]
    assert "state_slots" not in summary
    print_groups_and_state(summary)
    lines = capsys.readouterr().out.splitlines()
    assert lines[3].split() == ["1", "window", str(TINY_WINDOW), "0", "2", "5", f"{5 * per_block / 2**20:.2f}"]
    assert len(lines) == 5  # the title, the header, 3 groups; no state slots
