"""Sliding-window attention (Mistral, Qwen2, Gemma 3) and Gemma 3 itself, against transformers.

The tiny models have a window of 8 tokens (``conftest.TINY_WINDOW``) and
blocks of 4, so prompts and generations run well past the window and whole
blocks fall out of it (window KV cache groups give them back: kv_groups.py). Gemma 3's
tiny config has both kinds of layer, linear RoPE scaling on its global
layers, a final logit softcap and a score softcap (which transformers'
Gemma 3 ignores, and so must we); it is untied, "gemma3_tied" tied.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import TINY_WINDOW, TINY_WINDOW_ARCHS, _tiny_config, hf_greedy
from conftest import CapturingLLM as LLM  # decode steps captured from the first, as the tests mean
from test_attention import HEAD_DIM, STEPS, _build_step

from pagedllm import SamplingParams
from pagedllm.layers.attention import make_backend
from pagedllm.loader.model_config import from_hf_config

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPT_LENGTHS = [1, 5, 8, 9, 16, 37]


def _random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in lengths]


def _token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def _tokens(outs) -> list[list[int]]:  # noqa: ANN001
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def hf_window(window_dirs: dict[str, str]) -> dict:
    """transformers' models on the same weights; eager attention, the implementation Gemma's softcaps need."""
    from transformers import AutoModelForCausalLM

    return {
        arch: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        for arch, path in window_dirs.items()
    }


@pytest.fixture(scope="module")
def hf_expected(hf_window: dict) -> dict[str, list[list[int]]]:
    """transformers' greedy tokens for PROMPT_LENGTHS, per architecture (computed once)."""
    prompts = _random_prompts(PROMPT_LENGTHS, seed=7)
    return {arch: [hf_greedy(hf_window[arch], p, GREEDY.max_tokens) for p in prompts] for arch in TINY_WINDOW_ARCHS}


def test_window_configs_parse_as_transformers_does(window_dirs: dict[str, str]) -> None:  # noqa: ANN001
    from pagedllm.loader import load_model_config

    w = TINY_WINDOW
    assert load_model_config(window_dirs["mistral"]).sliding_windows == (w, w)
    assert load_model_config(window_dirs["qwen2_window"]).sliding_windows == (None, w, w)
    gemma = load_model_config(window_dirs["gemma3"])
    assert gemma.sliding_windows == (w, None, w, w, None)
    assert gemma.rope_scaling["rope_type"] == "linear" and gemma.local_rope_theta == 10_000.0
    assert gemma.attn_scale == 32**-0.5 and gemma.final_logit_softcapping == 30.0
    # transformers' Gemma 3 never caps attention scores, whatever the config says
    assert gemma.attn_logit_softcapping is None


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", "sdpa", "reference"])
@pytest.mark.parametrize("arch", TINY_WINDOW_ARCHS)
def test_windowed_greedy_matches_transformers(arch: str, backend: str, window_dirs, hf_expected) -> None:  # noqa: ANN001
    llm = LLM(window_dirs[arch], num_kv_blocks=128, max_model_len=256, block_size=4, attention_backend=backend)
    runner = llm.llm_engine.model_runner
    # decode steps are captured and replayed where the backend reads the step as tensors only
    assert (runner.captured_decode is not None) == (runner.backend.name == "cpu_paged")
    if arch.startswith("gemma3"):
        # float32 on the CPU: Gemma's norms (1 + w) and q/k norms with RoPE run native, on either backend
        attn = runner.model.model.layers[0].self_attn
        assert runner.native_ops is not None and attn.native is runner.native_ops
        assert attn.q_norm.native_weight is not None
    outs = llm.generate(_token_prompts(_random_prompts(PROMPT_LENGTHS, seed=7)), GREEDY, use_tqdm=False)
    assert _tokens(outs) == hf_expected[arch]
    if runner.captured_decode is not None:  # Gemma 3 too: one trace ran every decode step
        assert runner.captured_decode.failed is None and runner.captured_decode.num_traces == 1
    # the window masks; it frees nothing early, and everything is freed at the end
    assert llm.llm_engine.block_manager.num_free_blocks == 128


def test_gemma3_tied_head_matches_transformers(window_dirs, hf_window) -> None:  # noqa: ANN001
    # a checkpoint of a tied model has no lm_head.weight: the head is the embedding
    prompts = _random_prompts([9, 37], seed=8)
    llm = LLM(window_dirs["gemma3_tied"], num_kv_blocks=64, max_model_len=256, block_size=4)
    outs = llm.generate(_token_prompts(prompts), GREEDY, use_tqdm=False)
    assert _tokens(outs) == [hf_greedy(hf_window["gemma3_tied"], p, GREEDY.max_tokens) for p in prompts]


@pytest.mark.parametrize("arch", TINY_WINDOW_ARCHS)
def test_windowed_chunked_prefill_matches_transformers(arch: str, window_dirs, hf_expected) -> None:  # noqa: ANN001
    # a budget of 6 tokens: prompts cut into chunks shorter than the window,
    # each chunk's window reaching back into cached context
    llm = LLM(window_dirs[arch], num_kv_blocks=128, max_model_len=256, block_size=4, max_num_batched_tokens=6)
    outs = llm.generate(_token_prompts(_random_prompts(PROMPT_LENGTHS, seed=7)), GREEDY, use_tqdm=False)
    assert _tokens(outs) == hf_expected[arch]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", "sdpa"])
@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_windowed_prefix_cache_hit_matches_transformers(arch: str, backend: str, window_dirs, hf_window) -> None:  # noqa: ANN001
    prefix = _random_prompts([30], seed=11)[0]
    prompts = [prefix + t for t in _random_prompts([3, 10, 1], seed=12)]
    llm = LLM(window_dirs[arch], num_kv_blocks=128, max_model_len=256, block_size=4, attention_backend=backend)
    first = llm.generate(_token_prompts(prompts[:1]), GREEDY, use_tqdm=False)
    rest = llm.generate(_token_prompts(prompts[1:]), GREEDY, use_tqdm=False)
    # 7 full blocks of the 30-token prefix come from the cache (the last prompt
    # token is always computed, so a 31-token prompt hits 28 tokens as well)
    assert first[0].num_cached_tokens == 0 and all(o.num_cached_tokens == 28 for o in rest)
    for prompt, out in zip(prompts, first + rest):
        assert out.outputs[0].token_ids == hf_greedy(hf_window[arch], prompt, GREEDY.max_tokens)


def test_gemma3_logprobs_match_transformers_softcapped_logits(window_dirs, hf_window) -> None:  # noqa: ANN001
    """The final logit softcap is monotonic, invisible to greedy tokens: logprobs show it."""
    prompt = _random_prompts([20], seed=5)[0]
    llm = LLM(window_dirs["gemma3"], num_kv_blocks=64, max_model_len=256, block_size=4)
    out = llm.generate(_token_prompts([prompt]), SamplingParams(temperature=0, max_tokens=1, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    with torch.inference_mode():
        logits = hf_window["gemma3"](input_ids=torch.tensor([prompt])).logits[0, -1]
    want = torch.log_softmax(logits.double(), dim=-1)
    for token, lp in out.logprobs[0].items():
        assert math.isclose(lp.logprob, float(want[token]), abs_tol=1e-4)


def _dense_windowed(q, k, v, q_start: int, window: int | None, softcap: float | None):  # noqa: ANN001, ANN202
    """Textbook attention with the window and softcap written out."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(q_start, q_start + q.shape[0]).unsqueeze(1)
    j = torch.arange(k.shape[0]).unsqueeze(0)
    hidden = (j > i) if window is None else (j > i) | (j <= i - window)
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("window,softcap", [(1, None), (3, None), (8, None), (5, 1.5), (None, 1.5)])
@pytest.mark.parametrize("seqs", STEPS)
@pytest.mark.parametrize("backend_name", ["reference", "sdpa", "cpu_paged"])
def test_backend_window_and_softcap_match_dense(seqs, backend_name: str, window, softcap) -> None:  # noqa: ANN001
    """Fresh and continued prefills and decodes, on scattered blocks.

    cpu_paged decodes windowed layers in its kernel and hands the rest (windowed prefills, softcaps) to SDPA.
    """
    backend = make_backend(backend_name)
    q, k, v, k_cache, v_cache, meta, full = _build_step(seqs, seed=len(seqs) + 3)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5, sliding_window=window, softcap=softcap)
    for i, (computed, _new) in enumerate(seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        want = _dense_windowed(q[start:end], full[i][0], full[i][1], computed, window, softcap)
        torch.testing.assert_close(out[start:end], want, rtol=1e-5, atol=1e-5)


def _qwen2(**overrides) -> dict:  # noqa: ANN003
    return {**_tiny_config("qwen2").to_dict(), "use_sliding_window": True, **overrides}


@pytest.mark.parametrize(
    "cfg",
    [
        _qwen2(sliding_window=0),
        _qwen2(sliding_window=-4),
        {**_tiny_config("mistral").to_dict(), "sliding_window": 0},
        {**_tiny_config("mistral").to_dict(), "sliding_window": 2.5},
        {**_tiny_config("gemma3").to_dict(), "sliding_window": None},
        {**_tiny_config("gemma3").to_dict(), "layer_types": ["sliding_attention"]},
        {**_tiny_config("gemma3").to_dict(), "layer_types": ["chunked_attention"] * 5},
        {**_tiny_config("gemma3").to_dict(), "use_bidirectional_attention": True},
        {"model_type": "gemma3", "text_config": _tiny_config("gemma3").to_dict()},
    ],
    ids=["qwen2-zero", "qwen2-negative", "mistral-zero", "mistral-float", "gemma3-no-window",
         "gemma3-short-layer-types", "gemma3-unknown-layer-type", "gemma3-bidirectional",
         "gemma3-multimodal"],
)
def test_bad_window_configs_raise(cfg: dict) -> None:
    with pytest.raises(ValueError):
        from_hf_config(cfg)


def test_window_off_or_longer_than_positions_is_full_attention() -> None:
    # Qwen2 carries a window but switches it off; a window as long as every position is no window
    assert not from_hf_config(_tiny_config("qwen2").to_dict()).has_sliding_window
    assert not from_hf_config(_qwen2(sliding_window=1024)).has_sliding_window
    assert not from_hf_config({**_tiny_config("mistral").to_dict(), "sliding_window": None}).has_sliding_window
    # Qwen2's derivation: layers from max_window_layers on slide
    derived = {k: v for k, v in _qwen2(num_hidden_layers=4, sliding_window=8, max_window_layers=2).items()
               if k != "layer_types"}
    cfg = from_hf_config(derived)
    assert cfg.sliding_windows == (None, None, 8, 8)


def test_gemma3_old_style_rope_keys() -> None:
    """Configs from before transformers 5 keep the RoPE bases in rope_theta / rope_local_base_freq."""
    cfg = {k: v for k, v in _tiny_config("gemma3").to_dict().items() if k not in ("rope_parameters", "layer_types")}
    cfg.update(rope_theta=500_000.0, rope_local_base_freq=2_000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
               sliding_window_pattern=3)
    parsed = from_hf_config(cfg)
    assert parsed.rope_theta == 500_000.0 and parsed.local_rope_theta == 2_000.0
    assert parsed.rope_scaling["factor"] == 8.0 and parsed.local_rope_scaling is None
    assert parsed.layer_types == ("sliding_attention", "sliding_attention", "full_attention") + (
        "sliding_attention", "sliding_attention")
