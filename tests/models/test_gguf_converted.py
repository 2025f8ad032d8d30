"""GGUF files written by llama.cpp's own converter, as users make them, against transformers on the same weights.

Each tiny random checkpoint of ``tests/conftest.py`` is converted by
``convert_hf_to_gguf.py`` from the llama-cpp-python sdist (``llama_cpp_gguf``,
``tests/gguf_convert.py``) with ``--outtype f32`` and ``f16``, and run on
float32 activations and a float32 KV cache: greedy tokens must be
transformers' and every logprob pagedllm reports (prompt and output, top 5)
within ``LOGPROB_TOL`` of transformers' one-forward logprobs, where
transformers runs the folder's weights as the file holds them (rounded to
float16 for ``f16``). The converter's layout is what is tested: its tensor
names, its Q/K row order, its metadata and tokenizer, and for Llama 3.1+
its ``rope_freqs`` in place of the ``llama3`` scaling.

The ``llama3`` checkpoint's scaling has ``original_max_position_embeddings``
64; prompts of 100 tokens and 20 generated run well past it, where the
frequency divisors change the angles.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import hf_greedy
from gguf_convert import read_gguf

from pagedllm import LLM, SamplingParams
from pagedllm.layers.rotary import rope_parameters
from pagedllm.loader import load_model_config

pytestmark = pytest.mark.slow  # converts checkpoints in subprocesses (seconds each), fetches the converter once

# float32 activations and KV cache on both sides; F16 files are compared with transformers on the same
# float16-rounded weights, so only summation order differs (measured: ~1e-5)
LOGPROB_TOL = 1e-4
GENERATED = 20
ORIGINAL = 64  # original_max_position_embeddings of conftest's "llama3" checkpoint
ENGINE = dict(max_model_len=256, num_kv_blocks=64, block_size=8, kv_cache_dtype="float32",
              gguf_activations="float32")


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in lengths]


def _hf_as_stored(path: str, gguf_path: str, rope: dict | None = None):  # noqa: ANN202
    """transformers' model of the folder, its matrices rounded as the GGUF file stores them (float32 math).

    The converter writes every matrix in the outtype and every vector in
    F32 (checked here against the file), so rounding the 2-D parameters
    gives transformers the file's weights. ``rope`` replaces the RoPE parameters.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if rope is not None:
        config.rope_parameters = rope
    hf = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    types = {(len(t.shape), t.tensor_type.name) for t in read_gguf(gguf_path).tensors}
    matrix_types = {name for dims, name in types if dims == 2}
    assert {name for dims, name in types if dims == 1} == {"F32"} and len(matrix_types) == 1, types
    if matrix_types == {"F16"}:
        with torch.no_grad():
            for p in hf.parameters():
                if p.dim() == 2:
                    p.copy_(p.half().float())
    return hf


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    with torch.inference_mode():
        return torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)


def _max_logprob_error(out, want: torch.Tensor) -> float:  # noqa: ANN001
    """Largest gap between pagedllm's reported logprobs (prompt and output, top 5 and chosen) and ``want``."""
    prompt_len = len(out.prompt_token_ids)
    rows = [(i - 1, lps) for i, lps in enumerate(out.prompt_logprobs) if lps is not None]
    rows += [(prompt_len - 1 + i, lps) for i, lps in enumerate(out.outputs[0].logprobs)]
    return max(abs(lp.logprob - float(want[row, token])) for row, lps in rows for token, lp in lps.items())


def _run(gguf_path: str, prompts: list[list[int]]) -> tuple[LLM, list]:
    """The file's engine and its greedy outputs (top-5 logprobs of prompt and output)."""
    llm = LLM(gguf_path, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


# Llama's F32 and F16 files; Qwen2's and Qwen3's F16 ones, where their own 1-D tensors (biases, q/k norms) stay
# F32 between F16 matrices: an all-F32 file is read as Llama's is, whatever the family
@pytest.mark.parametrize(("arch", "outtype"), [("llama", "f32"), ("llama", "f16"), ("qwen2", "f16"), ("qwen3", "f16")])
def test_converted_models_match_transformers(
    arch: str, outtype: str, llama_cpp_gguf, tiny_model_dirs: dict[str, str],  # noqa: ANN001
) -> None:
    """The converter's file of each family (its names, Q/K row order, metadata, tokenizer) runs the folder's
    model: transformers' greedy tokens, its logprobs within LOGPROB_TOL."""
    path = llama_cpp_gguf(arch, outtype)
    folder = tiny_model_dirs[arch]
    assert load_model_config(path).rope_freq_factors == ()  # no llama3 scaling, no rope_freqs
    hf = _hf_as_stored(folder, path)
    prompts = _prompts([40, 9], seed=5)
    llm, outs = _run(path, prompts)
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        assert tokens == hf_greedy(hf, prompt, GENERATED)
        assert _max_logprob_error(out, _hf_logprobs(hf, prompt + tokens)) < LOGPROB_TOL
    # the file's own tokenizer (SmolLM2's, as the converter wrote it) tokenizes as the Llama folder's does
    from transformers import AutoTokenizer

    text = "The quick brown fox, 33 times.\n  Indented: café"
    want = AutoTokenizer.from_pretrained(tiny_model_dirs["llama"]).encode(text, add_special_tokens=False)
    assert llm.get_tokenizer().encode(text, add_special_tokens=False) == want


# F16 matrices around the F32 rope_freqs the converter writes in either outtype (F32 files: the test above)
@pytest.mark.parametrize("outtype", ["f16"])
def test_llama31_gguf_rope_freqs_match_transformers_llama3_scaling(
    outtype: str, llama_cpp_gguf, tiny_model_dirs: dict[str, str],  # noqa: ANN001
) -> None:
    """A Llama 3.1-style checkpoint (rope_type llama3) converted by llama.cpp carries ``rope_freqs`` and no
    scaling keys; pagedllm divides the frequencies by it once and gives transformers' llama3 model's tokens
    and logprobs, past original_max_position_embeddings."""
    path = llama_cpp_gguf("llama3", outtype)
    folder = tiny_model_dirs["llama3"]
    cfg = load_model_config(path)
    stored = next(t for t in read_gguf(path).tensors if t.name == "rope_freqs.weight")
    assert cfg.rope_scaling is None  # the converter writes no rope.scaling.* key for llama3
    assert cfg.rope_freq_factors == tuple(float(v) for v in np.asarray(stored.data, np.float32))
    assert max(cfg.rope_freq_factors) == 8.0 and min(cfg.rope_freq_factors) == 1.0  # scaled, kept and between

    # the frequencies are transformers' llama3 ones, up to float32 rounding of the divisions
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = _hf_as_stored(folder, path)
    want_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, torch.device("cpu"))
    inv_freq, factor = rope_parameters(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                       cfg.rope_freq_factors)
    assert factor == 1.0
    torch.testing.assert_close(inv_freq, want_freq, rtol=1e-6, atol=0)

    prompts = _prompts([100, 37], seed=21)  # 120 and 57 positions: past ORIGINAL, and within it
    _, outs = _run(path, prompts)
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        assert tokens == hf_greedy(hf, prompt, GENERATED)
        assert _max_logprob_error(out, _hf_logprobs(hf, prompt + tokens)) < LOGPROB_TOL
    # the check discriminates: the same weights without the llama3 scaling are far from pagedllm's logprobs
    plain = _hf_as_stored(folder, path, {"rope_type": "default", "rope_theta": cfg.rope_theta})
    ids = prompts[0] + outs[0].outputs[0].token_ids
    assert _max_logprob_error(outs[0], _hf_logprobs(plain, ids)) > 100 * LOGPROB_TOL
    assert len(ids) > 1.5 * ORIGINAL
