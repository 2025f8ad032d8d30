"""The float32 linear backends (our packed panels, oneDNN) compute what F.linear computes; the engine picks one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.kernels import load_kernels
from pagedllm.layers.linear import Linear
from pagedllm.layers.quantization.onednn_linear import OneDnnLinearMethod, onednn_available
from pagedllm.layers.quantization.packed_linear import (
    PackedLinearMethod,
    pack_weight_panels,
    packed_linear,
    packed_linear_available,
)

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
    packed = Linear.from_linear(linear, OneDnnLinearMethod())
    x = torch.randn(num_rows, 576, generator=gen)
    want = F.linear(x, linear.weight, linear.bias)
    torch.testing.assert_close(packed(x), want, rtol=1e-4, atol=1e-4)
    # a non-contiguous input and a leading batch dimension
    wide = torch.randn(num_rows, 1152, generator=gen)[:, ::2]
    torch.testing.assert_close(packed(wide), F.linear(wide, linear.weight, linear.bias), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed(x.unsqueeze(0)), want.unsqueeze(0), rtol=1e-4, atol=1e-4)


def test_linear_backend_validation() -> None:
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        EngineConfig(model="m", linear_backend="mkl")
    with pytest.raises(ValueError, match="runs float32 or bfloat16 weights on the CPU only"):
        EngineConfig(model="m", linear_backend="onednn", dtype="float16")
    with pytest.raises(ValueError, match="'packed' runs float32 or bfloat16 weights on the CPU only"):
        EngineConfig(model="m", linear_backend="packed", device="cuda")
    # bf16 weights on the CPU are what dtype="bfloat16" means there (tests/test_bf16_cpu.py)
    assert EngineConfig(model="m", linear_backend="onednn", dtype="bfloat16").linear_backend == "onednn"


@pytest.mark.slow
def test_linear_backends_agree_on_greedy_tokens(tiny_model_dirs: dict[str, str]) -> None:
    prompts = [{"prompt_token_ids": list(range(200 + i, 230 + 3 * i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "onednn", "packed"):
        llm = LLM(tiny_model_dirs["qwen2"], num_kv_blocks=64, max_model_len=256, block_size=8, linear_backend=backend)
        assert llm.llm_engine.model_runner.linear_backend == backend
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["torch"] == tokens["onednn"] == tokens["packed"]
    auto = LLM(tiny_model_dirs["qwen2"], num_kv_blocks=64, max_model_len=256, block_size=8)
    assert auto.llm_engine.model_runner.linear_backend == "packed"
    layer = auto.llm_engine.model_runner.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj.quant_method, PackedLinearMethod)


# --- our packed-panel kernel ----------------------------------------------------
packed_only = pytest.mark.skipif(not packed_linear_available(), reason="native kernels do not build here")


@packed_only
@pytest.mark.parametrize("bias", [False, True])
# rows: one tile or less, a partial last tile (8 / 6 rows per tile with
# AVX-512 / AVX2), many tiles and, with 700 x 576 inputs, several row blocks;
# columns: whole panels, a partial last panel (48 / 16 per panel), fewer than one
@pytest.mark.parametrize("num_rows", [1, 5, 6, 7, 8, 9, 13, 40, 700])
@pytest.mark.parametrize(("out_features", "in_features"), [(128, 576), (100, 96), (7, 33), (960, 1536)])
def test_packed_linear_matches_float64_reference(
    num_rows: int, out_features: int, in_features: int, bias: bool
) -> None:
    gen = torch.Generator().manual_seed(num_rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(num_rows, in_features, generator=gen)
    got = packed_linear(x, pack_weight_panels(weight), b, out_features)
    want = x.double() @ weight.double().T + (0 if b is None else b.double())
    assert got.shape == (num_rows, out_features) and got.dtype == torch.float32
    # a float32 sum of in_features products: error grows like sqrt(in_features)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * in_features**0.5 * 4)


@packed_only
def test_packed_linear_layout_and_padding() -> None:
    panel = load_kernels().packed_linear_panel()
    assert panel in (8, 16, 48)
    weight = torch.arange(3 * 5, dtype=torch.float32).view(3, 5)  # [out 3, in 5]
    packed = pack_weight_panels(weight)
    assert packed.shape == (1, 5, panel)
    # panel[k, j] = W[j, k] for the real columns, zero beyond them
    torch.testing.assert_close(packed[0, :, :3], weight.T)
    assert packed[0, :, 3:].abs().sum() == 0


@packed_only
def test_packed_linear_module_inputs_and_errors() -> None:
    gen = torch.Generator().manual_seed(3)
    linear = nn.Linear(96, 200, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(200, 96, generator=gen) * 0.1)
    layer = Linear.from_linear(linear, PackedLinearMethod())
    assert layer.weight is None and "weight" not in dict(layer.named_parameters())  # the plain copy is gone
    x = torch.randn(2, 9, 192, generator=gen)[..., ::2]  # non-contiguous, batch dims
    torch.testing.assert_close(layer(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="float32"):
        layer(x.double())
    with pytest.raises(ValueError, match="features"):
        layer(torch.randn(3, 95))
    empty = layer(torch.randn(0, 96))
    assert empty.shape == (0, 200)
    # a buffer that does not cover the outputs, or of another panel width, is refused
    with pytest.raises(ValueError, match="does not fit"):
        packed_linear(torch.randn(2, 96), layer.packed_weight, None, 10_000)
    with pytest.raises(ValueError, match="does not fit"):
        packed_linear(torch.randn(2, 96), layer.packed_weight[:, :, :4].contiguous(), None, 4)


def test_bfloat16_on_a_slow_cpu_path_warns(tiny_model_dirs: dict[str, str], caplog) -> None:  # noqa: ANN001
    """bf16 through torch's own matmul on the CPU is the slow path: say so; the default picks a fast one."""
    from pagedllm.layers.quantization.packed_linear import packed_linear_bf16_native

    with caplog.at_level("WARNING", logger="pagedllm.runner.model_loader"):
        LLM(tiny_model_dirs["llama"], num_kv_blocks=64, max_model_len=256, block_size=8, dtype="bfloat16",
            linear_backend="torch")
    assert any("slow path" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="pagedllm.runner.model_loader"):
        llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=64, max_model_len=256, block_size=8, dtype="bfloat16")
    if packed_linear_available() and packed_linear_bf16_native():
        # AVX512-BF16 or AVX2: the packed kernel, whatever the CPU's other features
        assert llm.llm_engine.model_runner.linear_backend == "packed"
        assert not any("slow path" in r.getMessage() for r in caplog.records)
