"""Weight-only int8 / int4 (quantization="int8" / "int4"): the kernel against float64, whole models against
transformers on the same rounded weights, and the memory the blocks save.

References are independent of the kernels: the blocks are unpacked and
dequantized here in float64 (``unpack_groups``, ``dequantize_groups``: plain
torch), and transformers runs a model whose weights are those dequantized
values.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import pytest
import torch
from conftest import hf_greedy, q8_linear_inputs
from torch import nn

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.kernels import load_kernels
from pagedllm.layers.linear import Linear
from pagedllm.layers.quantization.quantized_linear import (
    GROUP_RUN,
    QuantizedLinearMethod,
    group_block_bytes,
    layer_group_size,
    pack_groups,
    quantize_groups,
)
from pagedllm.runner.model_loader import model_tensors, resident_bytes

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="int8/int4 need the native build")

ops = torch.ops.pagedllm
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def unpack_groups(
    blocks: torch.Tensor, bits: int, group: int, in_features: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``pack_groups`` undone: (q ``[N, K]``, scales ``[N, K / group]``, mins or None)."""
    n, num_groups = blocks.shape[0], in_features // group
    b = blocks.reshape(n, num_groups, group_block_bytes(bits, group))
    head = 4 if bits == 8 else 8
    header = b[..., :head].contiguous().view(torch.float32)  # [N, groups, 1 or 2]
    scales, mins = header[..., 0].contiguous(), None if bits == 8 else header[..., 1].contiguous()
    if bits == 8:
        return b[..., head:].contiguous().view(torch.int8).reshape(n, in_features), scales, mins
    packed = b[..., head:].reshape(n, num_groups, group // GROUP_RUN, 16)
    q = torch.cat([packed & 0x0F, packed >> 4], dim=3)  # [N, groups, runs, 32]
    return q.reshape(n, in_features), scales, mins


def dequantize_groups(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    """The weights the blocks hold, ``[N, K]`` float64 (the kernels round each to float32 once)."""
    n, k = q.shape
    groups = q.double().reshape(n, scales.shape[1], -1) * scales.double().unsqueeze(2)  # [N, groups, group]
    if mins is not None:
        groups = groups + mins.double().unsqueeze(2)
    return groups.reshape(n, k)


def _blocks(out_features: int, in_features: int, bits: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights (rows of very different sizes) as blocks, and the weights they hold in float64."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen) * torch.logspace(-2, 1, out_features).unsqueeze(1)
    w[0, :group] = 0.25  # a constant group: int4 holds it exactly (q = 0, the min)
    q, scales, mins = quantize_groups(w, bits, group)
    blocks = pack_groups(q, scales, mins, bits)
    return blocks, dequantize_groups(*unpack_groups(blocks, bits, group, in_features))


# --- the rounding ------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
def test_rounding_is_to_the_nearest_level_and_the_blocks_round_trip(bits: int) -> None:
    w = torch.randn(9, 192, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 9).unsqueeze(1)
    q, scales, mins = quantize_groups(w, bits, 64)
    assert scales.shape == (9, 3) and scales.dtype == torch.float32
    groups = q.reshape(9, 3, 64)
    if bits == 8:
        assert q.dtype == torch.int8 and mins is None
        assert (groups.abs().amax(dim=2) == 127).all()  # each group's largest weight maps to +-127
    else:
        assert q.dtype == torch.uint8 and mins.shape == (9, 3)
        assert (groups.amin(dim=2) == 0).all() and (groups.amax(dim=2) == 15).all()  # min and max on the grid
    err = (dequantize_groups(q, scales, mins) - w.double()).abs().reshape(9, 3, 64)
    assert (err <= scales.double().unsqueeze(2) / 2 * (1 + 1e-5)).all()  # at most half a step
    blocks = pack_groups(q, scales, mins, bits)
    assert blocks.shape == (9, 3 * (4 + 64 if bits == 8 else 8 + 32)) and blocks.dtype == torch.uint8
    q2, scales2, mins2 = unpack_groups(blocks, bits, 64, 192)
    assert torch.equal(q2, q) and torch.equal(scales2, scales) and (mins is None or torch.equal(mins2, mins))


def test_all_zero_and_constant_groups_stay_finite() -> None:
    w = torch.zeros(3, 64)
    w[1] = 1.5
    for bits in (8, 4):
        q, scales, mins = quantize_groups(w, bits, 32)
        assert torch.isfinite(scales).all()
        got = dequantize_groups(q, scales, mins)
        assert torch.equal(got[[0, 2]], w[[0, 2]].double())  # zeros exactly
        # int4 holds a constant as its min (q = 0); int8 as 127 steps of a float32 scale
        assert torch.equal(got[1], w[1].double()) if bits == 4 else torch.allclose(got[1], w[1].double(), rtol=1e-7)


def test_group_sizes_a_layer_takes() -> None:
    assert layer_group_size(1536, 128) == 128
    assert layer_group_size(576, 128) == 96  # SmolLM2's hidden size: the largest multiple of 32 dividing it
    assert layer_group_size(64, 128) == 64
    assert layer_group_size(576, None) == 576  # one group per channel
    with pytest.raises(ValueError, match="not a multiple of 32"):
        layer_group_size(100, 32)


# --- the kernel ------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("num_rows", [1, 7, 32, 300])
@pytest.mark.parametrize(("out_features", "in_features", "group"),
                         [(37, 256, 128), (131, 512, 64), (577, 1536, 128), (9, 96, 96), (3, 576, 576)])
def test_quantized_linear_matches_the_dequantized_weights_in_float64(
    bits: int, num_rows: int, out_features: int, in_features: int, group: int
) -> None:
    blocks, weight = _blocks(out_features, in_features, bits, group, seed=num_rows + out_features)
    gen = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    got = ops.quantized_linear(x, blocks, bits, group, in_features, bias)
    want = x.double() @ weight.T + bias.double()
    # each weight is rounded to float32 once (half an ulp), then float32 sums of in_features products: the
    # error is bounded by (in_features + 1) * eps * sum |x w| (loose: random errors cancel)
    bound = (in_features + 1) * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.abs().T) + 1e-6
    assert got.shape == (num_rows, out_features) and got.dtype == torch.float32
    assert ((got.double() - want).abs() <= bound).all()
    # the bias is added last, to the same sums
    assert torch.equal(ops.quantized_linear(x, blocks, bits, group, in_features, None) + bias, got)


def _q8_rows(x: torch.Tensor) -> torch.Tensor:
    """Each run of 32 inputs of a row as llama.cpp's Q8 activations, in float64: ``dx * round(x / dx)``,
    ``dx = max |x| / 127`` (ties to even), from that definition (as conftest's ``q8_linear_inputs``)."""
    runs = x.reshape(x.shape[0], -1, 32)
    dx = runs.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    return (torch.round(runs * inv).clamp(-127, 127).double() * dx.double()).reshape(x.shape)


def _interleaved(blocks: torch.Tensor, bits: int, group: int, in_features: int) -> torch.Tensor:
    out = blocks.clone()
    ops.quantized_interleave_(out, bits, group, in_features)
    return out


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("num_rows", [1, 7, 32, 300])
@pytest.mark.parametrize(("out_features", "in_features", "group"),
                         [(48, 256, 128), (144, 512, 64), (592, 1536, 128), (16, 96, 96), (32, 576, 576)])
def test_interleaved_blocks_multiply_the_rows_rounded_to_int8(
    bits: int, num_rows: int, out_features: int, in_features: int, group: int
) -> None:
    """The interleaved layout (integer dot products): the float64 product of the same weights with each row
    rounded to int8 per run of 32, within float32's error over the run, group and row sums."""
    blocks, weight = _blocks(out_features, in_features, bits, group, seed=num_rows + out_features)
    gen = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, in_features, generator=gen) * torch.logspace(-1, 1, num_rows).unsqueeze(1)
    bias = torch.randn(out_features, generator=gen)
    interleaved = _interleaved(blocks, bits, group, in_features)
    assert interleaved.shape == blocks.shape and not torch.equal(interleaved, blocks)  # the same size, reordered
    got = ops.quantized_linear(x, interleaved, bits, group, in_features, bias, True)
    xq = _q8_rows(x)
    want = xq @ weight.T + bias.double()
    bound = (in_features + 8) * torch.finfo(torch.float32).eps * (xq.abs() @ weight.abs().T + bias.double().abs()) + 1e-6
    assert got.shape == (num_rows, out_features) and got.dtype == torch.float32
    assert ((got.double() - want).abs() <= bound).all()
    # the activations really are rounded (8 bits, not float32): the float path's result differs
    assert not torch.equal(got, ops.quantized_linear(x, blocks, bits, group, in_features, bias))


@pytest.mark.parametrize("bits", [8, 4])
def test_a_rows_result_does_not_depend_on_its_batch(bits: int) -> None:
    """Every row count, one row alone (the decode path, no strip buffer) included: bit for bit the same row."""
    blocks, _ = _blocks(301, 768, bits, 128, seed=3)
    x = torch.randn(300, 768, generator=torch.Generator().manual_seed(3))
    together = ops.quantized_linear(x, blocks, bits, 128, 768, None)
    for r in (0, 5, 133, 299):
        alone = ops.quantized_linear(x[r : r + 1].contiguous(), blocks, bits, 128, 768, None)
        assert torch.equal(alone, together[r : r + 1])
    for start, count in ((0, 2), (7, 7), (100, 33), (250, 50)):
        part = ops.quantized_linear(x[start : start + count].contiguous(), blocks, bits, 128, 768, None)
        assert torch.equal(part, together[start : start + count])
    blocks = _interleaved(blocks[:288].contiguous(), bits, 128, 768)  # 18 tiles of 16 channels
    together = ops.quantized_linear(x, blocks, bits, 128, 768, None, True)
    for start, count in ((0, 1), (5, 1), (0, 2), (7, 7), (100, 33), (250, 50), (299, 1)):
        part = ops.quantized_linear(x[start : start + count].contiguous(), blocks, bits, 128, 768, None, True)
        assert torch.equal(part, together[start : start + count])


@pytest.mark.parametrize("bits", [8, 4])
def test_embedding_rows_are_the_dequantized_rows(bits: int) -> None:
    blocks, weight = _blocks(50, 192, bits, 64, seed=7)
    ids = torch.tensor([3, 0, 49, 3, 17])
    got = ops.quantized_embedding(blocks, bits, 64, 192, ids)
    # float64 values rounded once to float32: what the kernel computes in one rounding (int4: an fma)
    assert torch.equal(got, weight.float()[ids])
    # a table interleaved for a tied LM head: the same rows
    table = _interleaved(torch.cat([blocks, blocks[:14]]), bits, 64, 192)  # 64 rows: four tiles
    assert torch.equal(ops.quantized_embedding(table, bits, 64, 192, ids, True), got)
    assert torch.equal(ops.quantized_embedding(table, bits, 64, 192, torch.tensor([52, 63]), True),
                       weight.float()[[2, 13]])


def test_bad_inputs_are_value_errors() -> None:
    blocks, _ = _blocks(8, 128, 4, 64, seed=1)
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        ops.quantized_linear(x, blocks, 3, 64, 128, None)
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 32"):
        ops.quantized_linear(x, blocks, 4, 48, 128, None)
    with pytest.raises(ValueError, match="multiple of group_size 64"):
        ops.quantized_linear(torch.randn(2, 96), blocks, 4, 64, 96, None)
    with pytest.raises(ValueError, match="rows of 80 bytes"):  # half a row of groups
        ops.quantized_linear(x, blocks[:, :40].contiguous(), 4, 64, 128, None)
    with pytest.raises(ValueError, match="rows of 136 bytes"):  # 4-bit groups read as 8-bit
        ops.quantized_linear(x, blocks, 8, 64, 128, None)
    with pytest.raises(ValueError, match="input has 64 features"):
        ops.quantized_linear(torch.randn(2, 64), blocks, 4, 64, 128, None)
    with pytest.raises(ValueError, match="float32"):
        ops.quantized_linear(x.double(), blocks, 4, 64, 128, None)
    with pytest.raises(ValueError, match="uint8"):
        ops.quantized_linear(x, blocks.to(torch.int16), 4, 64, 128, None)
    with pytest.raises(ValueError, match="bias"):
        ops.quantized_linear(x, blocks, 4, 64, 128, torch.randn(7))
    with pytest.raises(ValueError, match="outside the table of 8 rows"):
        ops.quantized_embedding(blocks, 4, 64, 128, torch.tensor([1, 8]))
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 32"):
        QuantizedLinearMethod(4, 40)
    with pytest.raises(ValueError, match="interleaves 16 rows at a time, got 8"):
        ops.quantized_interleave_(blocks.clone(), 4, 64, 128)
    with pytest.raises(ValueError, match="rows of 136 bytes"):
        ops.quantized_interleave_(torch.cat([blocks, blocks]), 8, 64, 128)
    with pytest.raises(ValueError, match="multiple of 16 rows, got 8"):
        ops.quantized_linear(x, blocks, 4, 64, 128, None, True)
    with pytest.raises(ValueError, match="multiple of 16 rows, got 8"):
        ops.quantized_embedding(blocks, 4, 64, 128, torch.tensor([1]), True)


def test_a_step_program_runs_quantized_nodes_as_the_ops_do() -> None:
    table, _ = _blocks(40, 64, 8, 32, seed=2)
    weight, _ = _blocks(24, 64, 4, 64, seed=4)
    ids = torch.tensor([5, 39, 0, 12, 7, 7])
    emb, out = torch.empty(6, 64), torch.empty(6, 24)
    program = torch.classes.pagedllm.StepProgram(6)
    program.add("quantized_embedding", [table, ids, emb], [8, 32, 64, 0], [])
    program.add("quantized_linear", [emb, weight, None, out], [4, 64, 64, 0], [])
    interleaved = _interleaved(torch.cat([weight, weight[:8]]), 4, 64, 64)  # 32 rows: two tiles
    out2 = torch.empty(6, 32)
    program.add("quantized_linear", [emb, interleaved, None, out2], [4, 64, 64, 1], [])
    for n in (6, 1):
        out.zero_()
        out2.zero_()
        program.run(n)
        rows = ops.quantized_embedding(table, 8, 32, 64, ids[:n])
        assert torch.equal(out[:n], ops.quantized_linear(rows, weight, 4, 64, 64, None))
        assert torch.equal(out2[:n], ops.quantized_linear(rows, interleaved, 4, 64, 64, None, True))
    ids[1] = 40  # a step's index outside the table is refused before anything runs
    with pytest.raises(ValueError, match="outside the table"):
        program.run(6)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_linear_layer_keeps_only_its_blocks(bits: int) -> None:
    linear = nn.Linear(320, 97, bias=True)
    layer = Linear.from_linear(linear, QuantizedLinearMethod(bits, 128))
    assert layer.group_size == 64  # 128 does not divide 320
    assert layer.weight is None and layer.qweight.dtype == torch.uint8
    x = torch.randn(3, 5, 320)
    want = x.double() @ dequantize_groups(*quantize_groups(linear.weight, bits, 64)).T + linear.bias.double()
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-4)  # a leading batch shape is kept
    with pytest.raises(ValueError, match="compute in float32"):
        layer(x.double())


# --- the configuration -------------------------------------------------------------------------


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model="m", quantization="int3")
    for q in ("int8", "int4"):
        with pytest.raises(ValueError, match="float32"):
            EngineConfig(model="m", quantization=q, dtype="bfloat16")
        with pytest.raises(ValueError, match="CPU only"):
            EngineConfig(model="m", quantization=q, device="cuda")
        with pytest.raises(ValueError, match="linear_backend applies to float weights"):
            EngineConfig(model="m", quantization=q, linear_backend="onednn")
        for bad in (0, 48, -32, 64.0, True):
            with pytest.raises(ValueError, match="positive multiple of 32"):
                EngineConfig(model="m", quantization=q, quantization_group_size=bad)
    with pytest.raises(ValueError, match="applies to quantization='int8' or 'int4' only"):
        EngineConfig(model="m", quantization_group_size=64)
    assert EngineConfig(model="m", quantization="int4").weight_group_size == 128
    assert EngineConfig(model="m", quantization="int8").weight_group_size is None  # per channel
    assert EngineConfig(model="m", quantization="int8", quantization_group_size=64).weight_group_size == 64


# --- whole models ------------------------------------------------------------------------------


def assert_greedy_of_q8_inputs(hf, prompt: list[int], ours: list[int], head_rounds: bool) -> None:  # noqa: ANN001
    """``ours`` (int8 activations: the blocks interleaved) against greedy transformers on the same rounded
    weights whose linear layers see their inputs rounded to int8 per run of 32 (``q8_linear_inputs``; the LM
    head too where ours is interleaved): equal, or parting at a near-tie of that oracle.

    Not exact: a float32 difference of an ulp (the sums' order) that lands on a rounding boundary moves an
    input by a whole int8 step. The oracle's own top-two gap where they part must be no larger than the
    largest change rounding the inputs makes to transformers' top-two gap at any position: what a few such
    steps can move it by is less than what rounding every input does.
    """
    skip = () if head_rounds else (hf.lm_head,)
    with q8_linear_inputs(hf, skip):
        want = hf_greedy(hf, prompt, len(ours))
    if ours == want:
        return
    i = next(i for i, (a, b) in enumerate(zip(ours, want)) if a != b)
    ids = torch.tensor([prompt + want])
    with torch.inference_mode():
        plain = hf(ids).logits[0, len(prompt) - 1 :]  # [len(ours) + 1, vocab]
        with q8_linear_inputs(hf, skip):
            rounded = hf(ids).logits[0, len(prompt) - 1 :]
    top2 = rounded.topk(2).indices  # [positions, 2]
    diff = torch.tensor([1.0, -1.0])
    moved = (plain.gather(1, top2) @ diff - rounded.gather(1, top2) @ diff).abs().max()
    # the oracle run over the whole sequence at once is not its token-by-token run either (the same boundary
    # effect), so the gap may come out negative: its size is what is bounded
    gap = float(rounded[i, want[i]] - rounded[i, ours[i]])
    assert abs(gap) <= float(moved), (i, gap, float(moved))


def round_like_pagedllm(hf_model: nn.Module, bits: int, group_size: int | None) -> nn.Module:
    """The same rounding applied to transformers' linear layers and token embedding, kept in float32: the oracle."""
    with torch.no_grad():
        for mod in hf_model.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                group = layer_group_size(mod.weight.shape[1], group_size)
                rounded = dequantize_groups(*quantize_groups(mod.weight, bits, group)).float()
                mod.weight = nn.Parameter(rounded)  # a new Parameter also unties a tied LM head
    return hf_model


_PROMPTS = [[1, 400, 3000, 77, 12000, 5], [1, 9, 9, 9], list(range(100, 140))]


@pytest.fixture(scope="module")
def rounded_hf(hf_tiny: dict) -> Callable[[str, str, int | None], nn.Module]:
    """The oracle of ``round_like_pagedllm`` for (arch, quantization, group size), shared by the two activations'
    tests, which run one after the other (the latest one kept; ``q8_linear_inputs`` removes its hooks)."""
    built: dict[tuple, nn.Module] = {}

    def oracle(arch: str, quantization: str, group_size: int | None) -> nn.Module:
        key = (arch, quantization, group_size)
        if key not in built:
            built.clear()
            group = EngineConfig(model="m", quantization=quantization, quantization_group_size=group_size)
            built[key] = round_like_pagedllm(copy.deepcopy(hf_tiny[arch]), 8 if quantization == "int8" else 4,
                                             group.weight_group_size)
        return built[key]

    return oracle


# Llama and Qwen3 (head_dim 32 and q/k norms: projections of other shapes, o_proj's 128 inputs taking the
# default group of 128) in every weight format; Qwen2 (biases on Llama's shapes) in both bit widths, one
# per-channel / default-group format and one of 32-groups: its shapes' groups are Llama's, the same kernels
WEIGHT_FORMATS = {
    "llama": [("int8", None), ("int8", 32), ("int4", None), ("int4", 32)],
    "qwen3": [("int8", None), ("int8", 32), ("int4", None), ("int4", 32)],
    "qwen2": [("int8", 32), ("int4", None)],
}


@pytest.mark.slow
@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize(("arch", "quantization", "group_size"),
                         [(arch, *f) for arch, formats in WEIGHT_FORMATS.items() for f in formats])
def test_tiny_models_match_transformers_on_the_rounded_weights(
    arch: str, quantization: str, group_size: int | None, activations: str, tiny_model_dirs: dict[str, str],
    rounded_hf: Callable[[str, str, int | None], nn.Module],
) -> None:
    """Llama, Qwen3 (q/k norms) and Qwen2 (biases): prompts prefilled together, decoded as a batch of 3.

    float32 activations (the blocks' own order) give transformers' tokens; int8 activations (the blocks
    interleaved, integer dot products) give them or part from them at a near-tie only, within what rounding
    the linear inputs to 8 bits moves transformers' own top-two gap (``assert_greedy_within_q8_noise``)."""
    hf = rounded_hf(arch, quantization, group_size)
    llm = LLM(tiny_model_dirs[arch], num_kv_blocks=64, max_model_len=256, block_size=8, quantization=quantization,
              quantization_group_size=group_size, gguf_activations=activations)
    model = llm.llm_engine.model_runner.model
    rows_of_16 = [m for m in model.modules() if isinstance(m, Linear) and m.qweight.shape[0] % 16 == 0]
    assert rows_of_16 and all(m.interleaved == (activations == "int8") for m in rows_of_16)
    outs = llm.generate([{"prompt_token_ids": p} for p in _PROMPTS], GREEDY, use_tqdm=False)
    for prompt, out in zip(_PROMPTS, outs):
        if activations == "float32":
            assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12)
        else:
            assert_greedy_of_q8_inputs(hf, prompt, out.outputs[0].token_ids, model.lm_head.interleaved)


@pytest.mark.slow
def test_gemma3_int4_matches_transformers_on_the_rounded_weights(window_dirs: dict[str, str]) -> None:
    from transformers import AutoModelForCausalLM

    for arch in ("gemma3", "gemma3_tied"):
        hf = AutoModelForCausalLM.from_pretrained(window_dirs[arch], dtype=torch.float32).eval()
        hf = round_like_pagedllm(hf, 4, 32)
        llm = LLM(window_dirs[arch], num_kv_blocks=128, max_model_len=256, block_size=4, quantization="int4",
                  quantization_group_size=32, gguf_activations="float32")
        prompt = list(range(300, 317))
        out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
        assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, 12)


@pytest.mark.slow
def test_chunked_prefill_and_beam_search_with_int4(tiny_model_dirs: dict[str, str], hf_tiny: dict) -> None:
    from test_beam_search import check_against_hf, pool_is_whole, random_prompt

    hf = round_like_pagedllm(copy.deepcopy(hf_tiny["llama"]), 4, 128)
    # a budget of 16 tokens: the 40-token prompt is prefilled in chunks beside the others' decodes
    chunked = LLM(tiny_model_dirs["llama"], num_kv_blocks=64, max_model_len=256, block_size=8, quantization="int4",
                  max_num_batched_tokens=16, gguf_activations="float32")
    outs = chunked.generate([{"prompt_token_ids": p} for p in _PROMPTS], GREEDY, use_tqdm=False)
    for prompt, out in zip(_PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12)
    from pagedllm.engine.beam_search import BeamSearchParams

    beams = LLM(tiny_model_dirs["llama"], num_kv_blocks=128, max_model_len=256, block_size=4, quantization="int4",
                gguf_activations="float32")
    eos = sorted(beams.llm_engine.tokenizer.eos_token_ids)
    prompt = random_prompt(9, seed=11)
    (ours,) = beams.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(3, 8))
    check_against_hf(ours, hf, prompt, 3, 1.0, 8, eos)
    assert pool_is_whole(beams)


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_no_float32_copy_is_kept(quantization: str, tiny_model_dirs: dict[str, str], caplog) -> None:  # noqa: ANN001
    """From the tensors the model holds: no float32 tensor of a linear weight's or the embedding's shape, and the
    blocks of int4 at most 0.2x (int8: 0.3x) the float32 bytes of the weights they replace."""
    kw = {"num_kv_blocks": 32, "max_model_len": 128, "block_size": 8}
    plain = LLM(tiny_model_dirs["llama"], **kw)
    with caplog.at_level(logging.WARNING, logger="pagedllm.runner.model_loader"):
        llm = LLM(tiny_model_dirs["llama"], quantization=quantization, **kw)
    model = llm.llm_engine.model_runner.model
    embedding = model.model.embed_tokens
    float_shapes = {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, Linear)}
    float_shapes.add((embedding.num_embeddings, embedding.embedding_dim))
    # the tiny model's hidden size (64) is below the default group of 128: those layers take 64, and say so
    assert (quantization == "int4") == ("use groups of 64" in caplog.text)
    held = model_tensors(model)
    assert not [t.shape for t in held if t.dtype == torch.float32 and tuple(t.shape) in float_shapes]
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight is None and m.qweight.dtype == torch.uint8 for m in linears)
    assert type(embedding.quant_method).__name__ == "QuantizedEmbeddingMethod"
    float_bytes = 4 * sum(m.in_features * m.out_features for m in linears)
    block_bytes = sum(m.qweight.numel() for m in linears)
    assert block_bytes <= (0.2 if quantization == "int4" else 0.3) * float_bytes, (block_bytes, float_bytes)
    assert llm.weight_bytes == resident_bytes(held)
    assert llm.weight_bytes <= (0.2 if quantization == "int4" else 0.3) * plain.weight_bytes
    runner = llm.llm_engine.model_runner
    # down_proj (128 inputs) keeps groups of 128
    assert runner.weight_format == ("int4-g64+g128" if quantization == "int4" else "int8-per-channel")


def test_a_tied_head_and_the_embedding_share_their_blocks(window_dirs: dict[str, str]) -> None:
    llm = LLM(window_dirs["gemma3_tied"], num_kv_blocks=64, max_model_len=128, block_size=4, quantization="int4")
    model = llm.llm_engine.model_runner.model
    assert model.lm_head.qweight is model.model.embed_tokens.qweight
    vocab = model.config.vocab_size
    assert not any(t.dtype == torch.float32 and t.dim() and t.shape[0] == vocab for t in model_tensors(model))


def test_kv_cache_default_size_follows_the_real_weight_bytes(
    tiny_model_dirs: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default pool is a share (half on the CPU) of what the weights leave of the memory free before
    loading: int4's smaller weights leave room for more blocks than float32's, with the same memory free."""
    import pagedllm.runner.kv_cache as kv_cache
    import pagedllm.runner.model_runner as model_runner
    from pagedllm.resolved_config import DEFAULT_KV_SHARE

    free = 40 << 20  # of the order of the tiny model's float32 weights (25 MiB)
    for module in (kv_cache, model_runner):  # wherever the free memory is read
        monkeypatch.setattr(module, "available_memory_bytes", lambda device: free, raising=False)
    # enough sequences that the pool's cap (max_num_seqs full sequences) is not what binds
    kw = {"max_model_len": 128, "block_size": 8, "max_num_seqs": 1024}
    blocks = {}
    for quantization in (None, "int4"):
        llm = LLM(tiny_model_dirs["llama"], quantization=quantization, **kw)
        runner = llm.llm_engine.model_runner
        want = int((free - llm.weight_bytes) * DEFAULT_KV_SHARE) // runner.kv_bytes_per_block
        assert runner.num_kv_blocks == want
        blocks[quantization] = want
    assert blocks["int4"] > 1.5 * blocks[None]


# --- the bundled model (a GGUF file, dequantized and rounded again) ---------------------------------


@pytest.mark.slow
def test_smollm_int8_greedy_matches_quantized_transformers(smollm_int8: LLM, hf_smollm, smollm_tokenizer) -> None:  # noqa: ANN001
    """int8 activations (the default): transformers' tokens, or a parting at a near-tie only; float32
    activations: transformers' tokens exactly."""
    hf = round_like_pagedllm(copy.deepcopy(hf_smollm), 8, None)  # the shared oracle stays float32
    exact = LLM(num_kv_blocks=64, max_model_len=256, quantization="int8", gguf_activations="float32")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for text in ["The capital of France is", "def fibonacci(n):"]:
        prompt = smollm_tokenizer.encode(text)
        out = smollm_int8.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        assert_greedy_of_q8_inputs(hf, prompt, out[0].outputs[0].token_ids, smollm_int8.llm_engine.model_runner.model.lm_head.interleaved)
        out = exact.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, 20)


@pytest.mark.slow
def test_smollm_int8_batch_equals_one_at_a_time(smollm_int8: LLM) -> None:
    texts = ["Hi", "The three primary colors are", "List five fruits:", "Water boils at", "My name is", "2 + 2 =",
             "Paris is", "Dogs are", "The sun", "Rain falls"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in smollm_int8.generate(texts, params, use_tqdm=False)]
    alone = [smollm_int8.generate(t, params, use_tqdm=False)[0].outputs[0].token_ids for t in texts]
    assert batched == alone


@pytest.mark.slow
def test_int4_on_a_gguf_file_rounds_its_dequantized_weights_again(caplog) -> None:  # noqa: ANN001
    with caplog.at_level(logging.WARNING, logger="pagedllm.runner.model_loader"):
        llm = LLM(num_kv_blocks=64, max_model_len=256, quantization="int4")
    assert "rounded again to int4" in caplog.text and "Q4_1" in caplog.text
    assert llm.llm_engine.model_runner.weight_format == "int4-g96+g128"  # SmolLM2: 576 inputs take groups of 96
