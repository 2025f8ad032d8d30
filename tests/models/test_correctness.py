"""Greedy tokens equal transformers' on the same float32 weights, however we batch or page."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from conftest import TINY_ARCHS, assert_greedy_within_q8_noise, hf_greedy
from conftest import CapturingLLM as LLM  # decode steps captured from the first, as the tests mean

from pagedllm import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in lengths]


def _token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.fixture(scope="module")
def hf_tokens(hf_tiny: dict) -> Callable[[str, list[int], int], list[int]]:
    """``hf_greedy`` on a tiny model, computed once per (arch, prompt, length) for the module: every attention
    backend is compared with the same oracle tokens."""
    computed: dict[tuple, list[int]] = {}

    def tokens(arch: str, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (arch, tuple(prompt), max_new_tokens)
        if key not in computed:
            computed[key] = hf_greedy(hf_tiny[arch], prompt, max_new_tokens)
        return computed[key]

    return tokens


@pytest.fixture(scope="module")
def smollm() -> LLM:
    return LLM(num_kv_blocks=512, max_model_len=1024)


SMOLLM_TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
SMOLLM_NEW = 24


@pytest.fixture(scope="module")
def smollm_prompts_and_hf_tokens(hf_smollm, smollm_tokenizer) -> list[tuple[list[int], list[int]]]:  # noqa: ANN001
    """(prompt ids, transformers' greedy tokens) of each of ``SMOLLM_TEXTS``: the oracle both activations' tests
    compare with, computed once for the module."""
    prompts = [smollm_tokenizer.encode(t) for t in SMOLLM_TEXTS]
    return [(p, hf_greedy(hf_smollm, p, SMOLLM_NEW)) for p in prompts]


@pytest.mark.slow
def test_smollm_gguf_greedy_matches_transformers(smollm: LLM, hf_smollm, smollm_prompts_and_hf_tokens) -> None:  # noqa: ANN001
    """The bundled Q4_1/Q8_0 blocks, multiplied on activations rounded to 8 bits per block of 32 (the x16
    kernels, the default): transformers' tokens on the dequantized weights, or parting from them at a
    near-tie only (``assert_greedy_within_q8_noise``)."""
    prompts = [p for p, _ in smollm_prompts_and_hf_tokens]
    outs = smollm.generate(_token_prompts(prompts), SamplingParams(temperature=0, max_tokens=SMOLLM_NEW, ignore_eos=True))
    for text, (prompt, want), out in zip(SMOLLM_TEXTS, smollm_prompts_and_hf_tokens, outs):
        ours = out.outputs[0].token_ids
        assert len(ours) == SMOLLM_NEW
        # equal to the shared oracle tokens, or checked where they part (the helper recomputes them)
        gap = None if ours == want else assert_greedy_within_q8_noise(hf_smollm, prompt, ours)
        print(f"{text!r}: {'equal' if gap is None else f'parts at a logit gap of {gap:.3f}'}")


@pytest.mark.slow
def test_smollm_float32_activations_match_transformers(smollm_prompts_and_hf_tokens) -> None:  # noqa: ANN001
    """gguf_activations="float32": the file's blocks on float32 activations, transformers' own computation."""
    llm = LLM(num_kv_blocks=128, max_model_len=1024, gguf_activations="float32")
    assert llm.llm_engine.model_runner.model.lm_head.quant_method.name == "gguf-q8_0"  # the file's order
    prompts = [p for p, _ in smollm_prompts_and_hf_tokens]
    outs = llm.generate(_token_prompts(prompts), SamplingParams(temperature=0, max_tokens=SMOLLM_NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [want for _, want in smollm_prompts_and_hf_tokens]


@pytest.mark.slow
def test_smollm_batch_equals_one_at_a_time(smollm: LLM, smollm_tokenizer) -> None:  # noqa: ANN001
    texts = [
        "Hi",
        "The three primary colors are",
        "List five fruits:",
        "In 1969, the first humans to walk on the Moon were",
        "Translate to French: good morning",
        "A long time ago in a galaxy far, far away, there lived a young farmer who dreamed of",
    ]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in smollm.generate(texts, params, use_tqdm=False)]
    alone = [smollm.generate(t, params, use_tqdm=False)[0].outputs[0].token_ids for t in texts]
    assert batched == alone


# cpu_paged: decode steps captured (one trace); cpu_paged_eager: the same kernels, module by module
@pytest.mark.parametrize("backend", ["cpu_paged", "cpu_paged_eager", "sdpa", "reference"])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_models_greedy_match_transformers(arch: str, backend: str, tiny_model_dirs, hf_tokens) -> None:  # noqa: ANN001
    # block_size 8: prompts shorter than, equal to and spanning several blocks
    llm = LLM(tiny_model_dirs[arch], num_kv_blocks=64, max_model_len=256, block_size=8,
              attention_backend=backend.removesuffix("_eager"), enforce_eager=backend.endswith("_eager"))
    prompts = _random_prompts([1, 5, 8, 16, 37], seed=7)
    outs = llm.generate(_token_prompts(prompts), GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_tokens(arch, prompt, GREEDY.max_tokens)
    captured = llm.llm_engine.model_runner.captured_decode
    assert (captured is not None and captured.num_traces == 1) == (backend == "cpu_paged")
    assert llm.llm_engine.block_manager.num_free_blocks == 64


def test_llama3_rope_scaling_matches_transformers(tiny_model_dirs) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    from pagedllm.loader import load_model_config

    path = tiny_model_dirs["llama3"]
    assert load_model_config(path).rope_scaling["rope_type"] == "llama3"
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, num_kv_blocks=64, max_model_len=256, block_size=8)
    # long prompts: positions past original_max_position_embeddings (64)
    prompts = _random_prompts([70, 100], seed=8)
    outs = llm.generate(_token_prompts(prompts), GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)


def test_preemption_gives_the_same_tokens(tiny_model_dirs, hf_tiny) -> None:  # noqa: ANN001
    prompts = _random_prompts([12, 20, 9, 30, 17, 25, 14, 22], seed=3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ample = LLM(tiny_model_dirs["llama"], num_kv_blocks=256, max_model_len=128, block_size=4)
    # 8 sequences growing to ~60 tokens need ~120 blocks of 4; give them 40
    tight = LLM(tiny_model_dirs["llama"], num_kv_blocks=40, max_model_len=128, block_size=4)
    want = [o.outputs[0].token_ids for o in ample.generate(_token_prompts(prompts), params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in tight.generate(_token_prompts(prompts), params, use_tqdm=False)]
    assert ample.llm_engine.scheduler.num_preemptions == 0
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert got == want
    assert want[0] == hf_greedy(hf_tiny["llama"], prompts[0], 40)
    assert tight.llm_engine.block_manager.num_free_blocks == 40


def test_prefix_cache_hit_gives_the_same_tokens(tiny_model_dirs, hf_tiny) -> None:  # noqa: ANN001
    prefix = _random_prompts([45], seed=11)[0]
    tails = _random_prompts([3, 10, 1, 7], seed=12)
    prompts = [prefix + t for t in tails]
    cached = LLM(tiny_model_dirs["qwen3"], num_kv_blocks=128, max_model_len=256, block_size=8)
    plain = LLM(tiny_model_dirs["qwen3"], num_kv_blocks=128, max_model_len=256, block_size=8,
                enable_prefix_caching=False)
    # the first request fills the cache, the rest hit its 5 full prefix blocks
    first = cached.generate(_token_prompts(prompts[:1]), GREEDY, use_tqdm=False)
    rest = cached.generate(_token_prompts(prompts[1:]), GREEDY, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 40 for o in rest)
    want = plain.generate(_token_prompts(prompts), GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in want)
    assert [o.outputs[0].token_ids for o in first + rest] == [o.outputs[0].token_ids for o in want]
    assert rest[0].outputs[0].token_ids == hf_greedy(hf_tiny["qwen3"], prompts[1], GREEDY.max_tokens)


def test_identical_prompts_in_one_step_share_the_cache(tiny_model_dirs) -> None:  # noqa: ANN001
    # both are admitted in the same step; the second reads blocks the first
    # writes in that very step
    prompt = _random_prompts([33], seed=5)[0]
    llm = LLM(tiny_model_dirs["qwen2"], num_kv_blocks=64, max_model_len=128, block_size=8)
    outs = llm.generate(_token_prompts([prompt, prompt]), GREEDY, use_tqdm=False)
    assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens == 32
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
