"""oneDNN packed linear layers compute what F.linear computes, and the engine picks them sensibly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.models.onednn_linear import OneDnnLinear, onednn_available, use_onednn_linear

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_rows", [1, 3, 64, 300])
def test_onednn_linear_matches_f_linear(num_rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    linear = nn.Linear(576, 1536, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(1536, 576, generator=gen) * 0.05)
        if bias:
            linear.bias.copy_(torch.randn(1536, generator=gen))
    packed = OneDnnLinear(linear)
    x = torch.randn(num_rows, 576, generator=gen)
    want = F.linear(x, linear.weight, linear.bias)
    torch.testing.assert_close(packed(x), want, rtol=1e-4, atol=1e-4)
    # a non-contiguous input and a leading batch dimension
    wide = torch.randn(num_rows, 1152, generator=gen)[:, ::2]
    torch.testing.assert_close(packed(wide), F.linear(wide, linear.weight, linear.bias), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed(x.unsqueeze(0)), want.unsqueeze(0), rtol=1e-4, atol=1e-4)


def test_use_onednn_linear_replaces_every_linear_and_keeps_embeddings() -> None:
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4, bias=False))
    x = model[0](torch.tensor([1, 2, 3]))
    want = model[1:](x)
    assert use_onednn_linear(model) == 2
    assert isinstance(model[1], OneDnnLinear) and isinstance(model[3], OneDnnLinear)
    assert isinstance(model[0], nn.Embedding)
    torch.testing.assert_close(model[1:](x), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="float32"):
        model[1](x.double())


def test_linear_backend_validation() -> None:
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        EngineConfig(model="m", linear_backend="mkl")
    with pytest.raises(ValueError, match="float32 on the CPU"):
        EngineConfig(model="m", linear_backend="onednn", dtype="bfloat16")


def test_linear_backends_agree_on_greedy_tokens(tiny_model_dirs: dict[str, str]) -> None:
    prompts = [{"prompt_token_ids": list(range(200 + i, 230 + 3 * i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "onednn"):
        llm = LLM(tiny_model_dirs["qwen2"], num_kv_blocks=64, max_model_len=256, block_size=8, linear_backend=backend)
        assert llm.llm_engine.model_runner.linear_backend == backend
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["torch"] == tokens["onednn"]
    auto = LLM(tiny_model_dirs["qwen2"], num_kv_blocks=64, max_model_len=256, block_size=8)
    assert auto.llm_engine.model_runner.linear_backend == "onednn"


def test_bfloat16_on_a_cpu_without_native_bf16_warns(tiny_model_dirs: dict[str, str], monkeypatch, caplog) -> None:  # noqa: ANN001
    from pagedllm.runner import model_runner

    monkeypatch.setattr(model_runner, "_cpu_has_native_bf16", lambda: False)
    with caplog.at_level("WARNING", logger="pagedllm.runner.model_runner"):
        LLM(tiny_model_dirs["llama"], num_kv_blocks=64, max_model_len=256, block_size=8, dtype="bfloat16")
    assert any("without native bf16" in r.getMessage() for r in caplog.records)
    caplog.clear()
    monkeypatch.setattr(model_runner, "_cpu_has_native_bf16", lambda: True)
    with caplog.at_level("WARNING", logger="pagedllm.runner.model_runner"):
        LLM(tiny_model_dirs["llama"], num_kv_blocks=64, max_model_len=256, block_size=8, dtype="bfloat16")
    assert not any("without native bf16" in r.getMessage() for r in caplog.records)
