"""``dtype="bfloat16"`` on the CPU: bf16 weights and matmuls, float32 activations between them.

Expectations are derived independently:
- the kernel against a float64 product of the bf16-rounded operands, and
  bitwise against torch's own bf16 rounding;
- whole models against transformers' float32 model made to compute the same
  scheme (every weight rounded to bf16, every linear layer's input rounded
  to bf16 by a hook), and the bundled SmolLM2 against the plain float32
  oracle, teacher-forced, within a stated tolerance.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TINY_ARCHS
from torch import nn

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.layers.linear import Linear
from pagedllm.layers.quantization.bf16_linear import TorchBF16LinearMethod
from pagedllm.layers.quantization.onednn_linear import (
    OneDnnLinearMethod,
    onednn_available,
    onednn_bf16_supported,
)
from pagedllm.layers.quantization.packed_linear import (
    PackedBF16LinearMethod,
    pack_weight_panels_bf16,
    packed_linear_available,
    packed_linear_bf16,
    packed_linear_bf16_native,
)
from pagedllm.runner.model_loader import Precision, make_linear_method

needs_kernels = pytest.mark.skipif(not packed_linear_available(), reason="the native CPU kernels do not build here")


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``bf16(x) @ bf16(w).T + bias`` and the sum of |terms| (the scale of float32 summation error)."""
    xd, wd = _bf16(x).double(), _bf16(w).double()
    ref = xd @ wd.T
    scale = xd.abs() @ wd.abs().T
    if b is not None:
        ref = ref + b.double()
        scale = scale + b.double().abs()
    return ref, scale


@needs_kernels
@pytest.mark.parametrize(
    "rows,in_features,out_features,bias",
    [
        (1, 576, 960, False),
        (7, 575, 97, True),  # odd K (a zero-padded pair), N not a multiple of the panel
        (64, 1536, 576, False),
        (300, 576, 100, True),  # more rows than one L2 block of activations (224 at K=576)
        (3, 5, 1, True),
    ],
)
def test_packed_bf16_kernel_matches_a_float64_product_of_the_rounded_operands(
    rows: int, in_features: int, out_features: int, bias: bool
) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen)
    b = _bf16(torch.randn(out_features, generator=gen)) if bias else None
    y = packed_linear_bf16(x, pack_weight_panels_bf16(w), b, out_features, in_features)
    ref, scale = _reference(x, w, b)
    # float32 sums of exact products: error at most ~K ulps of the sum of |terms|
    bound = in_features * 2.0**-24 * scale + 1e-30
    assert ((y.double() - ref).abs() <= bound).all()
    # and not merely close to a float32 result: far from the unrounded product
    if in_features >= 64:
        assert (y.double() - x.double() @ w.double().T - (0 if b is None else b.double())).abs().max() > 1e-3


@needs_kernels
def test_packed_bf16_rounds_activations_like_torch() -> None:
    """An identity weight returns bf16(x) bit for bit: round to nearest even, ties included.

    Infinities are left out (inf times the identity's zeros is NaN in any
    matmul); denormals are flushed to zero (checked at the end), where torch keeps them.
    """
    k = 64
    bits = torch.randint(-(2**31), 2**31 - 1, (k,), generator=torch.Generator().manual_seed(3), dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32).clone()
    x[~torch.isfinite(x) | (x.abs() < torch.finfo(torch.float32).tiny) | (x.abs() > 3e38)] = 1.0
    # exact ties (low half 0x8000) with even and odd kept halves, both signs, and the largest finite bf16
    ties = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x7F7F0000, 0x7F7E8000], dtype=torch.int64)
    x[: len(ties)] = ties.to(torch.int32).view(torch.float32)
    y = packed_linear_bf16(x.unsqueeze(0), pack_weight_panels_bf16(torch.eye(k)), None, k, k)
    want = _bf16(x)
    assert torch.equal(y[0].view(torch.int32), want.view(torch.int32))
    assert want[0] == 1.0 and want[1] == 1.015625  # ties went to the even half, down and up
    # denormal activations are flushed to zero, as AVX512-BF16's conversion does (in every build)
    tiny = torch.tensor([1e-39, -3e-40] + [0.0] * (k - 2))
    y = packed_linear_bf16(tiny.unsqueeze(0), pack_weight_panels_bf16(torch.eye(k)), None, k, k)
    assert torch.equal(y[0], torch.zeros(k))


@needs_kernels
def test_packed_bf16_refuses_what_it_cannot_compute() -> None:
    w = torch.randn(10, 8)
    packed = pack_weight_panels_bf16(w)
    with pytest.raises(ValueError, match="float32 activations"):
        packed_linear_bf16(torch.randn(2, 8, dtype=torch.float64), packed, None, 10, 8)
    with pytest.raises(ValueError, match="expects 8"):
        packed_linear_bf16(torch.randn(2, 9), packed, None, 10, 8)
    with pytest.raises(ValueError, match="does not fit"):
        packed_linear_bf16(torch.randn(2, 8), packed, None, 10, 12)
    with pytest.raises(ValueError, match="2-D"):
        pack_weight_panels_bf16(torch.randn(2, 3, 4))


@pytest.mark.parametrize("backend", ["packed", "onednn", "torch"])
def test_bf16_linear_backends_compute_the_same_scheme(backend: str) -> None:
    if backend == "packed" and not packed_linear_available():
        pytest.skip("the native CPU kernels do not build here")
    if backend == "onednn" and not onednn_bf16_supported():
        pytest.skip("oneDNN has no bf16 kernels on this CPU (needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT); "
                    "test_onednn_bf16_is_refused_where_the_cpu_lacks_it covers the refusal")
    gen = torch.Generator().manual_seed(11)
    model = nn.Sequential(nn.Linear(96, 130, bias=True), nn.Linear(130, 40, bias=False))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    first_w, first_b, second_w = model[0].weight.clone(), model[0].bias.clone(), model[1].weight.clone()
    bf16 = Precision(torch.bfloat16, torch.float32, bf16_matmul_only=True)  # dtype="bfloat16" on the CPU
    model = nn.Sequential(*(Linear.from_linear(m, make_linear_method(bf16, backend)) for m in model))
    kind = {"packed": PackedBF16LinearMethod, "onednn": OneDnnLinearMethod, "torch": TorchBF16LinearMethod}[backend]
    assert all(isinstance(m.quant_method, kind) for m in model)
    x = torch.randn(20, 96, generator=gen)
    got = model(x)
    assert got.dtype == torch.float32
    hidden = _bf16(x) @ _bf16(first_w).T + _bf16(first_b)
    want = _bf16(hidden) @ _bf16(second_w).T
    # oneDNN and torch round their bf16 output once more (the widening copy), ours writes float32
    tolerance = 2e-5 if backend == "packed" else 2**-7
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * want.abs().max().item())


def _emulate_bf16_matmuls(hf_model, round_outputs: bool):  # noqa: ANN001, ANN202
    """transformers' float32 model computing our CPU bf16 scheme: bf16 weights, bf16 inputs to every linear.

    ``round_outputs``: also round each linear's output to bf16, as the
    oneDNN and torch layers do (they compute a bf16 tensor and widen it).
    """
    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(_bf16(p))
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(lambda _m, args: (_bf16(args[0]), *args[1:]))
            if round_outputs:
                module.register_forward_hook(lambda _m, _args, out: _bf16(out))
    return model


def _teacher_forced(model, prompt_ids: list[int], chosen: list[int]) -> tuple[list[float], list[float]]:  # noqa: ANN001
    """For each chosen token: (oracle's best logprob - its logprob for the token, its logprob for the token)."""
    ids = prompt_ids + chosen
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    gaps, values = [], []
    for i, token in enumerate(chosen):
        row = logprobs[len(prompt_ids) + i - 1]
        gaps.append(float(row.max() - row[token]))
        values.append(float(row[token]))
    return gaps, values


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_models_in_bf16_match_transformers_computing_the_same_scheme(arch: str, tiny_model_dirs, hf_tiny) -> None:  # noqa: ANN001
    """Each bf16 linear backend against transformers computing exactly its scheme, teacher-forced on its tokens.

    Ours writes float32 sums, which differ from the oracle's only in the order
    of additions; that moves an input to the next layer across a bf16 rounding
    boundary now and then, so logprobs agree to ~1e-6 mostly and ~1e-2 at
    worst (measured: 1e-2 on Qwen3). oneDNN and torch round each output to
    bf16, where exact logit ties happen; their tokens may lose to the
    oracle's best by one bf16 step of a logit (1/16 at |logit| < 16). A
    layer wired wrong (weights, packing, bias) moves logits by whole units.
    """
    oracles = {rounded: _emulate_bf16_matmuls(hf_tiny[arch], rounded) for rounded in (False, True)}
    prompts = [list(range(300 + 11 * i, 300 + 11 * i + n)) for i, n in enumerate([5, 23, 40])]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True)
    for backend in ("packed", "onednn", "torch"):
        if backend == "packed" and not packed_linear_available():
            continue
        if backend == "onednn" and not onednn_bf16_supported():
            continue  # no bf16 kernels in oneDNN on this CPU: refused, see the test below
        llm = LLM(
            tiny_model_dirs[arch], dtype="bfloat16", kv_cache_dtype="float32", linear_backend=backend,
            num_kv_blocks=64, max_model_len=256, block_size=8,
        )
        runner = llm.llm_engine.model_runner
        assert runner.compute_dtype == torch.float32 and runner.kv_cache.dtype == torch.float32
        tolerance = 0.03 if backend == "packed" else 1 / 16
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for p, out in zip(prompts, outs):
            chosen = out.outputs[0].token_ids
            assert len(chosen) == 12
            gaps, want = _teacher_forced(oracles[backend != "packed"], p, chosen)
            got = [out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(chosen)]
            assert max(gaps) <= tolerance, (arch, backend, gaps)
            assert max(abs(g - w) for g, w in zip(got, want)) <= tolerance, (arch, backend)
        bm = llm.llm_engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.slow
def test_smollm_bf16_defaults_and_closeness_to_float32(hf_smollm, smollm_tokenizer) -> None:  # noqa: ANN001
    """The bundled model with dtype="bfloat16": what it builds, and tokens float32's oracle rates near its best.

    quantization="none": every weight in bf16 (the file's blocks dequantized, then rounded), not the blocks.
    """
    llm = LLM(dtype="bfloat16", quantization="none", num_kv_blocks=128, max_model_len=512)
    runner = llm.llm_engine.model_runner
    assert runner.kv_cache.dtype == torch.bfloat16  # kv_cache_dtype="auto" follows dtype
    assert runner.compute_dtype == torch.float32
    if packed_linear_available() and packed_linear_bf16_native():
        assert runner.linear_backend == "packed"
        assert isinstance(runner.model.model.layers[0].mlp.down_proj.quant_method, PackedBF16LinearMethod)
        assert runner.backend.name == "cpu_paged" and runner.native_ops is not None
    prompts = ["The capital of France is", "def fibonacci(n):"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, logprobs=0, ignore_eos=True), use_tqdm=False)
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    worst_gap = 0.0
    for prompt, out in zip(prompts, outs):
        ids = smollm_tokenizer(prompt)["input_ids"] + out.outputs[0].token_ids
        with torch.inference_mode():
            logprobs = torch.log_softmax(hf_smollm(input_ids=torch.tensor([ids])).logits[0].double(), -1)
        start = len(ids) - len(out.outputs[0].token_ids)
        for pos in range(start, len(ids)):
            row = logprobs[pos - 1]
            worst_gap = max(worst_gap, float(row.max() - row[ids[pos]]))
    # measured 0.0 (every token is float32's best); bf16 weights move logits by hundredths, a wrong layer by units
    assert worst_gap < 0.1, worst_gap


def test_onednn_bf16_is_refused_where_the_cpu_lacks_it() -> None:
    """oneDNN's bf16 needs AVX-512 or AVX-NE-CONVERT: elsewhere a clear ValueError, not torch's RuntimeError."""
    if not onednn_available() or onednn_bf16_supported():
        pytest.skip("this CPU runs oneDNN's bf16 kernels; the refusal cannot happen here")
    with pytest.raises(ValueError, match="linear_backend='packed'"):
        OneDnnLinearMethod(torch.bfloat16)


def test_bf16_config_validation() -> None:
    with pytest.raises(ValueError, match="computes in float32"):
        EngineConfig(model="m", quantization="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="float32 or bfloat16 weights on the CPU only"):
        EngineConfig(model="m", dtype="float16", linear_backend="packed")
