"""Weight-only int8: the kernel computes what the dequantized weights compute, end to end too."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import hf_greedy
from torch import nn

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.layers.int8_linear import SMALL_BATCH_ROWS, Int8LinearMethod, quantize_per_channel
from pagedllm.layers.linear import Linear


def test_quantize_per_channel_round_trip() -> None:
    w = torch.randn(37, 53, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 37).unsqueeze(1)
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (37,)
    assert q.abs().max() == 127  # the largest weight of each row maps to +-127
    assert (q.abs().amax(dim=1) == 127).all()
    # round to nearest: error at most half a step per element
    err = (q.float() * scale.unsqueeze(1) - w).abs()
    assert (err <= scale.unsqueeze(1) / 2 + 1e-7).all()


def test_quantize_all_zero_row() -> None:
    w = torch.zeros(3, 8)
    w[1] = 1.0
    q, scale = quantize_per_channel(w)
    assert torch.isfinite(scale).all()
    assert (q[0] == 0).all() and (q[1] == 127).all()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_rows", [1, 2, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1, 40])
def test_int8_linear_kernel_matches_dequantized_matmul(num_rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    linear = nn.Linear(576, 1000, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(1000, 576, generator=gen))
        if bias:
            linear.bias.copy_(torch.randn(1000, generator=gen))
    layer = Linear.from_linear(linear, Int8LinearMethod())
    x = torch.randn(num_rows, 576, generator=gen)
    q, scale = quantize_per_channel(linear.weight)
    want = x @ (q.float() * scale.unsqueeze(1)).T + (linear.bias.detach() if bias else 0)
    got = layer(x)
    assert got.shape == (num_rows, 1000)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    # a leading batch shape is kept
    torch.testing.assert_close(layer(x.view(1, num_rows, 576)), want.view(1, num_rows, 1000), rtol=1e-4, atol=1e-3)


def test_int8_config_validation() -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model="m", quantization="int4")
    with pytest.raises(ValueError, match="float32"):
        EngineConfig(model="m", quantization="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(model="m", quantization="int8", device="cuda")


def _quantize_hf_model(model: nn.Module) -> nn.Module:
    """The same int8 rounding applied to transformers' model, kept in float32: the oracle."""
    with torch.no_grad():
        for _, mod in model.named_modules():
            if isinstance(mod, nn.Linear):
                q, scale = quantize_per_channel(mod.weight)
                # a new Parameter also unties a tied LM head from the embedding
                mod.weight = nn.Parameter(q.float() * scale.unsqueeze(1))
    return model


def test_smollm_int8_greedy_matches_quantized_transformers(smollm_int8: LLM, hf_smollm, smollm_tokenizer) -> None:  # noqa: ANN001
    hf = _quantize_hf_model(copy.deepcopy(hf_smollm))  # the shared oracle stays float32
    texts = ["The capital of France is", "def fibonacci(n):"]
    for text in texts:
        prompt = smollm_tokenizer.encode(text)
        # alone: decode steps run through the int8 kernel
        out = smollm_int8.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
        assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, 20)


def test_smollm_int8_batch_equals_one_at_a_time(smollm_int8: LLM) -> None:
    # 10 sequences decode through the dequantized float32 path, 1 through the kernel
    texts = ["Hi", "The three primary colors are", "List five fruits:", "Water boils at", "My name is", "2 + 2 =",
             "Paris is", "Dogs are", "The sun", "Rain falls"]
    assert len(texts) > SMALL_BATCH_ROWS
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in smollm_int8.generate(texts, params, use_tqdm=False)]
    alone = [smollm_int8.generate(t, params, use_tqdm=False)[0].outputs[0].token_ids for t in texts]
    assert batched == alone


def test_tiny_qwen2_int8_with_biases_matches_quantized_transformers(tiny_model_dirs: dict[str, str]) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_model_dirs["qwen2"]
    hf = _quantize_hf_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    llm = LLM(path, num_kv_blocks=64, max_model_len=256, block_size=8, quantization="int8")
    prompt = list(range(300, 317))
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, 16)


def test_int8_kernel_rows_do_not_depend_on_their_batch() -> None:
    """Up to SMALL_BATCH_ROWS rows, a row's output is bit-identical alone or with others."""
    gen = torch.Generator().manual_seed(5)
    linear = nn.Linear(584, 300, bias=True)  # 584 = 36 x 16 + 8: the tail path runs too
    with torch.no_grad():
        linear.weight.copy_(torch.randn(300, 584, generator=gen))
    layer = Linear.from_linear(linear, Int8LinearMethod())
    x = torch.randn(SMALL_BATCH_ROWS, 584, generator=gen)
    together = layer(x)
    for rows in range(1, SMALL_BATCH_ROWS + 1):
        assert torch.equal(layer(x[:rows]), together[:rows])
    for r in range(SMALL_BATCH_ROWS):
        assert torch.equal(layer(x[r : r + 1]), together[r : r + 1])
