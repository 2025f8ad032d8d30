"""GGUF weights kept in their blocks: the kernels against gguf's own dequantization, and whole models.

References are independent of our kernels: the ``gguf`` package quantizes
and dequantizes, float64 matmuls on its dequantized weights are the oracle
for a layer, and transformers running those dequantized weights is the
oracle for a model.
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import torch
from conftest import CapturingLLM as LLM  # decode steps captured from the first, as the tests mean
from conftest import assert_greedy_within_q8_noise, hf_greedy
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from pagedllm import SamplingParams
from pagedllm.kernels import load_kernels
from pagedllm.layers.quantization.gguf_linear import GGUFLinearMethod
from pagedllm.runner.capture.decode_graph import num_programs
from pagedllm.runner.model_loader import model_tensors, resident_bytes

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="the GGUF kernels need the native build")

Q = GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]  # 32-weight blocks; gguf's writer quantizes to these
K_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K]  # 256-weight super-blocks (Q4_K_M files)
LOW_K_TYPES = [Q.Q2_K, Q.Q3_K]  # Q2_K / Q3_K_M files
FLOAT_TYPES = [Q.F16, Q.BF16]
# the whole-model comparisons with transformers check the weights' blocks: a float32 cache, as
# transformers keeps, not the float16 one that kv_cache_dtype="auto" gives GGUF files
F32_KV = {"kv_cache_dtype": "float32"}
ALL_TYPES = TYPES + K_TYPES + LOW_K_TYPES + FLOAT_TYPES
# the fp16 fields of a block that scale its quants: (byte offset, size of the values drawn)
_HALF_FIELDS = {
    Q.Q4_0: [(0, 0.02)], Q.Q4_1: [(0, 0.02), (2, -0.1)], Q.Q8_0: [(0, 0.02)],
    Q.Q5_0: [(0, 0.01)], Q.Q5_1: [(0, 0.01), (2, -0.1)],
    Q.Q4_K: [(0, 0.002), (2, 0.002)], Q.Q5_K: [(0, 0.002), (2, 0.002)], Q.Q6_K: [(208, 0.002)],
    Q.Q2_K: [(80, 0.01), (82, 0.01)], Q.Q3_K: [(108, 0.01)],
}


def random_blocks(ggml_type: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid random blocks: random quants and packed scales, fp16 scales of a sane size; uint8 [rows, bytes]."""
    rng = np.random.default_rng(seed)
    if ggml_type in FLOAT_TYPES:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        if ggml_type == Q.F16:
            return w.astype(np.float16).view(np.uint8)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # bf16: the high halves
    block_weights, size = GGML_QUANT_SIZES[ggml_type]
    num_blocks = cols // block_weights
    raw = rng.integers(0, 256, size=(rows, num_blocks, size), dtype=np.uint8)
    if ggml_type == Q.NVFP4:  # 4 unsigned E4M3 scales, of a sane size (no kernel here: the loader's fallback)
        raw[:, :, :4] = rng.integers(0x10, 0x30, size=(rows, num_blocks, 4), dtype=np.uint8)
    for offset, scale in _HALF_FIELDS.get(ggml_type, []):
        halves = (rng.random((rows, num_blocks)) * scale + 0.05 * scale).astype(np.float16)
        raw[:, :, offset : offset + 2] = halves.view(np.uint8).reshape(rows, num_blocks, 2)
    return raw.reshape(rows, num_blocks * size)


def reference_weights(raw: np.ndarray, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(np.asarray(dequantize(raw, ggml_type), dtype=np.float64))


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("num_rows", [1, 7, 32, 300])
@pytest.mark.parametrize(("out_features", "in_features"), [(37, 256), (130, 512), (576, 1536)])
def test_gguf_linear_matches_the_dequantized_weights_in_float64(
    ggml_type: GGMLQuantizationType, num_rows: int, out_features: int, in_features: int
) -> None:
    raw = random_blocks(ggml_type, out_features, in_features, seed=num_rows + out_features)
    weight = reference_weights(raw, ggml_type)  # [out, in] float64
    gen = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    got = torch.ops.pagedllm.gguf_linear(x, torch.from_numpy(raw), int(ggml_type), in_features, bias)
    want = x.double() @ weight.T + bias.double()
    # float32 sums of in_features products: each term's rounding is at most eps of the running sum,
    # so the error is bounded by in_features * eps * sum |x w| (the bound is loose; random errors cancel)
    bound = in_features * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.abs().T) + 1e-6
    assert got.shape == (num_rows, out_features) and got.dtype == torch.float32
    assert ((got.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_a_rows_result_does_not_depend_on_its_batch(ggml_type: GGMLQuantizationType) -> None:
    """Bit for bit the same row whatever the others, one row alone (a single sequence decoding, which
    dequantizes in registers) included."""
    raw = torch.from_numpy(random_blocks(ggml_type, 300, 768, seed=3))
    x = torch.randn(300, 768, generator=torch.Generator().manual_seed(3))
    together = torch.ops.pagedllm.gguf_linear(x, raw, int(ggml_type), 768, None)
    for r in (0, 5, 133, 298):
        pair = torch.ops.pagedllm.gguf_linear(x[r : r + 2].contiguous(), raw, int(ggml_type), 768, None)
        assert torch.equal(pair, together[r : r + 2])
    alone = torch.ops.pagedllm.gguf_linear(x[:1].contiguous(), raw, int(ggml_type), 768, None)
    assert torch.equal(alone, together[:1])


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_embedding_rows_and_dequantize_equal_gguf(ggml_type: GGMLQuantizationType) -> None:
    raw = random_blocks(ggml_type, 50, 512, seed=7)
    want = reference_weights(raw, ggml_type).float()
    table = torch.from_numpy(raw)
    ids = torch.tensor([3, 0, 49, 3, 17])
    # gguf computes in float32 too, in another order of operations (a scale times a scale first)
    torch.testing.assert_close(torch.ops.pagedllm.gguf_embedding(table, int(ggml_type), 512, ids), want[ids],
                               rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.ops.pagedllm.gguf_dequantize(table, int(ggml_type), 512), want,
                               rtol=1e-6, atol=1e-7)


def test_bad_gguf_inputs_are_value_errors() -> None:
    raw = torch.from_numpy(random_blocks(GGMLQuantizationType.Q4_1, 8, 64, seed=1))
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="no kernel for GGUF tensor type 40"):
        torch.ops.pagedllm.gguf_linear(x, raw, int(GGMLQuantizationType.NVFP4), 64, None)
    with pytest.raises(ValueError, match="multiple of 256"):
        torch.ops.pagedllm.gguf_linear(x, raw, int(GGMLQuantizationType.Q4_K), 64, None)
    with pytest.raises(ValueError, match="rows of 40 bytes"):
        torch.ops.pagedllm.gguf_linear(x, raw[:, :20].contiguous(), int(GGMLQuantizationType.Q4_1), 64, None)
    with pytest.raises(ValueError, match="multiple of 32"):
        torch.ops.pagedllm.gguf_linear(torch.randn(2, 48), raw, int(GGMLQuantizationType.Q4_1), 48, None)
    with pytest.raises(ValueError, match="input has 32 features"):
        torch.ops.pagedllm.gguf_linear(torch.randn(2, 32), raw, int(GGMLQuantizationType.Q4_1), 64, None)
    with pytest.raises(ValueError, match="outside the table of 8 rows"):
        torch.ops.pagedllm.gguf_embedding(raw, int(GGMLQuantizationType.Q4_1), 64, torch.tensor([1, 8]))
    with pytest.raises(ValueError, match="no GGUF kernel"):
        GGUFLinearMethod(int(GGMLQuantizationType.NVFP4))


def test_a_step_program_runs_gguf_nodes_as_the_ops_do() -> None:
    q41, q80 = int(GGMLQuantizationType.Q4_1), int(GGMLQuantizationType.Q8_0)
    table = torch.from_numpy(random_blocks(GGMLQuantizationType.Q8_0, 40, 64, seed=2))
    weight = torch.from_numpy(random_blocks(GGMLQuantizationType.Q4_1, 24, 64, seed=4))
    ids = torch.tensor([5, 39, 0, 12, 7, 7])
    emb, out = torch.empty(6, 64), torch.empty(6, 24)
    program = torch.classes.pagedllm.StepProgram(6)
    program.add("gguf_embedding", [table, ids, emb], [q80, 64], [])
    program.add("gguf_linear", [emb, weight, None, out], [q41, 64], [])
    for n in (6, 2):
        out.zero_()
        program.run(n)
        want = torch.ops.pagedllm.gguf_linear(
            torch.ops.pagedllm.gguf_embedding(table, q80, 64, ids[:n]), weight, q41, 64, None
        )
        assert torch.equal(out[:n], want)
    ids[1] = 40  # a step's index outside the table is refused before anything runs
    with pytest.raises(ValueError, match="outside the table"):
        program.run(6)


# --- interleaved blocks and 8-bit activations (kernels/gguf/gguf_x16.h) ----------------------------------
X16_TYPES = TYPES + K_TYPES + LOW_K_TYPES
X16 = {t: 512 + int(t) for t in X16_TYPES}  # the kernels' numbers for the types interleaved 16 rows at a time


def interleaved(raw: np.ndarray, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    weight = torch.from_numpy(raw.copy())
    block_weights, block_bytes = GGML_QUANT_SIZES[ggml_type]
    torch.ops.pagedllm.gguf_interleave_(weight, int(ggml_type), raw.shape[1] // block_bytes * block_weights)
    return weight


K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def act_group(ggml_type: GGMLQuantizationType) -> int:
    """Inputs sharing one activation grid: a super-block of 256 for the k-quants (llama.cpp's Q8_K), else 32 (Q8_0)."""
    return 256 if ggml_type in K_QUANTS else 32


def q8_rows(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """x as llama.cpp's Q8 activations hold it: each run of `group` inputs dx * round(x / dx), dx = max |x| / 127
    (32: Q8_0's blocks; 256: Q8_K's, for the k-quants)."""
    blocks = x.reshape(x.shape[0], -1, group)
    dx = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    return (torch.round(blocks * inv).clamp(-127, 127) * dx).reshape(x.shape)


@pytest.mark.parametrize("ggml_type", X16_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("num_rows", [1, 7, 32, 300])
@pytest.mark.parametrize(("out_features", "in_features"), [(48, 256), (160, 512), (576, 1536)])
def test_interleaved_linear_is_the_float64_product_of_rounded_activations(
    ggml_type: GGMLQuantizationType, num_rows: int, out_features: int, in_features: int
) -> None:
    """Integer sums over the blocks and 8-bit rows: exact, so only the float32 combination of the blocks'
    sums rounds; and within the rounding of the activations of the unrounded product."""
    raw = random_blocks(ggml_type, out_features, in_features, seed=num_rows + out_features)
    weight = reference_weights(raw, ggml_type)  # [out, in] float64
    gen = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, in_features, generator=gen) * 3
    x[0, :32] = 0.0  # a block of zeros: dx = 0
    bias = torch.randn(out_features, generator=gen)
    got = torch.ops.pagedllm.gguf_linear(x, interleaved(raw, ggml_type), X16[ggml_type], in_features, bias).double()
    group = act_group(ggml_type)
    rounded = q8_rows(x, group).double()
    want = rounded @ weight.T + bias.double()
    # one float32 product and fma per block (per super-block for the k-quants), summed over in_features / 32
    # blocks: well inside this
    bound = in_features * torch.finfo(torch.float32).eps * (rounded.abs() @ weight.abs().T) + 1e-5
    assert ((got - want).abs() <= bound).all()
    # against the unrounded rows: each input moved by at most dx / 2
    dx = x.double().reshape(num_rows, -1, group).abs().amax(-1, keepdim=True) / 127
    moved = (dx / 2).expand(-1, -1, group).reshape(num_rows, in_features) @ weight.abs().T
    assert ((got - (x.double() @ weight.T + bias.double())).abs() <= moved + bound).all()


@pytest.mark.parametrize("ggml_type", X16_TYPES, ids=lambda t: t.name)
def test_interleaved_rows_do_not_depend_on_their_batch(ggml_type: GGMLQuantizationType) -> None:
    weight = interleaved(random_blocks(ggml_type, 64, 768, seed=3), ggml_type)
    x = torch.randn(300, 768, generator=torch.Generator().manual_seed(3))
    together = torch.ops.pagedllm.gguf_linear(x, weight, X16[ggml_type], 768, None)
    for r in (0, 5, 133, 298, 299):
        for n in (1, 2):
            part = torch.ops.pagedllm.gguf_linear(x[r : r + n].contiguous(), weight, X16[ggml_type], 768, None)
            assert torch.equal(part, together[r : r + n])


@pytest.mark.parametrize("ggml_type", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_long_k_quant_rows_summed_a_slice_of_the_tile_at_a_time(ggml_type: GGMLQuantizationType) -> None:
    """A tile of 16 channels of a long input (4864 inputs, 19 super-blocks: 44-64 KiB) is summed a slice of
    about 32 KiB at a time, every row per slice, the partial sums left in the output between slices (and the
    bias added once, after the last): the float64 product's bound as in one pass, and a row's bits whatever its
    batch (one row, a few, a block of rows, several blocks). Up to 8 rows (one pass) are summed in one slice,
    so the single rows check the sliced sums against the unsliced ones bit for bit."""
    in_features, out_features = 4864, 48
    raw = random_blocks(ggml_type, out_features, in_features, seed=11)
    weight, reference = interleaved(raw, ggml_type), reference_weights(raw, ggml_type)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(300, in_features, generator=gen) * 3
    bias = torch.randn(out_features, generator=gen)
    together = torch.ops.pagedllm.gguf_linear(x, weight, X16[ggml_type], in_features, bias)
    rounded = q8_rows(x, 256).double()
    want = rounded @ reference.T + bias.double()
    bound = in_features * torch.finfo(torch.float32).eps * (rounded.abs() @ reference.abs().T) + 1e-5
    assert ((together.double() - want).abs() <= bound).all()
    for r, n in ((0, 1), (7, 1), (150, 9), (299, 1), (0, 70)):
        part = torch.ops.pagedllm.gguf_linear(x[r : r + n].contiguous(), weight, X16[ggml_type], in_features, bias)
        assert torch.equal(part, together[r : r + n])


def test_activations_are_rounded_to_int8_exactly_as_llama_cpp_rounds_them() -> None:
    """Q8_0 rows that each pick one input (quant 1, scale 1) make y the rounded input itself, dx * round(x / dx):
    every value of q8_rows, bitwise, including ties to even, a block of zeros, tiny values and a NaN (the
    vector and the plain C rounding give the same integers and scales; test_kernel_variants runs this on
    every build the CPU can run)."""
    k = 128
    raw = np.zeros((k, k // 32, 34), dtype=np.uint8)  # row c: block c // 32 has quant 1 at input c % 32
    raw[:, :, 0:2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    for c in range(k):
        raw[c, c // 32, 2 + c % 32] = 1
    weight = interleaved(raw.reshape(k, -1), Q.Q8_0)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(37, k, generator=gen) * torch.rand(37, 1, generator=gen) * 50
    x[1, :32] = torch.arange(32) - 15.5  # amax 16.5 -> dx 16.5/127: values off the grid
    x[2, :32] = torch.arange(32) * 0.5 - 8.0  # a half-step grid
    x[3, :32] = torch.tensor([127.0] + [i + 0.5 for i in range(-16, 15)])  # dx = 1: x.5 rounds to even
    x[4, :32] = 0.0  # dx = 0: every quant 0
    x[5, 32:64] = -0.0
    x[6, 64:96] = torch.tensor([1e-30] * 31 + [-1e-30])
    x[7, 29] = float("nan")  # fmaxf's rule in every build: max |x| skips it, the clamp makes it -127
    got = torch.ops.pagedllm.gguf_linear(x, weight, X16[Q.Q8_0], k, None)
    assert torch.equal(got[:7], q8_rows(x[:7])) and torch.equal(got[8:], q8_rows(x[8:]))
    assert got[3, 1:8].tolist() == [-16.0, -14.0, -14.0, -12.0, -12.0, -10.0, -10.0]  # ties to even
    without_nan = x[7:8].clone()
    without_nan[0, 29] = 0.0
    want = q8_rows(without_nan)[0]
    want[29] = -127 * (without_nan[0, :32].abs().amax() / 127)
    assert torch.equal(got[7], want)


@pytest.mark.parametrize("ggml_type", X16_TYPES, ids=lambda t: t.name)
def test_interleaving_keeps_every_weight(ggml_type: GGMLQuantizationType) -> None:
    raw = random_blocks(ggml_type, 48, 512, seed=7)
    weight = interleaved(raw, ggml_type)
    assert weight.shape == raw.shape and not np.array_equal(weight.numpy(), raw)  # the same size, another order
    want = torch.ops.pagedllm.gguf_dequantize(torch.from_numpy(raw), int(ggml_type), 512)
    assert torch.equal(torch.ops.pagedllm.gguf_dequantize(weight, X16[ggml_type], 512), want)
    ids = torch.tensor([47, 0, 16, 15, 31, 3])
    assert torch.equal(torch.ops.pagedllm.gguf_embedding(weight, X16[ggml_type], 512, ids), want[ids])


def test_bad_interleave_inputs_are_value_errors() -> None:
    raw = torch.from_numpy(random_blocks(Q.Q4_1, 40, 64, seed=1))
    with pytest.raises(ValueError, match="16 rows at a time, got 40"):
        torch.ops.pagedllm.gguf_interleave_(raw, int(Q.Q4_1), 64)
    with pytest.raises(ValueError, match="interleaves Q4_0"):
        torch.ops.pagedllm.gguf_interleave_(torch.from_numpy(random_blocks(Q.F16, 16, 256, seed=1)), int(Q.F16), 256)
    with pytest.raises(ValueError, match="multiple of 16 rows, got 40"):
        torch.ops.pagedllm.gguf_linear(torch.randn(2, 64), raw, X16[Q.Q4_1], 64, None)


def test_a_step_program_runs_interleaved_nodes_as_the_ops_do() -> None:
    """The nodes share one scratch for their 8-bit rows, sized for the largest; run(n) of fewer rows too."""
    table = interleaved(random_blocks(Q.Q8_0, 48, 64, seed=2), Q.Q8_0)
    w1 = interleaved(random_blocks(Q.Q4_1, 32 * 9, 64, seed=4), Q.Q4_1)  # 64 -> 288: the second node's rows are wider
    w2 = interleaved(random_blocks(Q.Q4_0, 16, 32 * 9, seed=5), Q.Q4_0)
    ids = torch.tensor([5, 47, 0, 12, 7, 7, 30])
    emb, mid, out = torch.empty(7, 64), torch.empty(7, 32 * 9), torch.empty(7, 16)
    program = torch.classes.pagedllm.StepProgram(7)
    program.add("gguf_embedding", [table, ids, emb], [X16[Q.Q8_0], 64], [])
    program.add("gguf_linear", [emb, w1, None, mid], [X16[Q.Q4_1], 64], [])
    program.add("gguf_linear", [mid, w2, None, out], [X16[Q.Q4_0], 32 * 9], [])
    for n in (7, 3, 1):
        mid.zero_(), out.zero_()
        program.run(n)
        first = torch.ops.pagedllm.gguf_linear(
            torch.ops.pagedllm.gguf_embedding(table, X16[Q.Q8_0], 64, ids[:n]), w1, X16[Q.Q4_1], 64, None
        )
        assert torch.equal(mid[:n], first)
        assert torch.equal(out[:n], torch.ops.pagedllm.gguf_linear(first, w2, X16[Q.Q4_0], 32 * 9, None))


def test_a_fused_layer_of_mixed_types_keeps_each_part_in_its_type() -> None:
    """q/k in Q4_K and v in Q6_K (as Q4_K_M files hold some layers), with a bias: each part's blocks as stored
    in one flat buffer, multiplied part by part, in the file's order and interleaved."""
    from pagedllm.layers.linear import Linear, replace_parameter
    from pagedllm.layers.quantization.gguf_linear import GGUFPartsLinearMethod

    spans = [(0, 64, Q.Q4_K), (64, 32, Q.Q4_K), (96, 32, Q.Q6_K), (128, 8, Q.Q8_0)]  # the Q8_0 part: 8 rows
    layer = Linear(512, 136)
    method = GGUFPartsLinearMethod([(o, n, int(t)) for o, n, t in spans], 512)
    layer.quant_method = method
    replace_parameter(layer, "weight", None)
    layer.register_buffer("qweight", torch.empty(method.num_bytes, dtype=torch.uint8))  # [bytes]
    raws = [random_blocks(t, n, 512, seed=o) for o, n, t in spans]
    for (o, n, _), raw in zip(spans, raws):
        method.qweight_rows(layer, o, n).copy_(torch.from_numpy(raw))
    assert method.num_bytes == sum(raw.nbytes for raw in raws)
    weight = torch.cat([reference_weights(raw, t) for raw, (_, _, t) in zip(raws, spans)])  # [136, 512] float64
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(9))
    bias = layer.bias.detach().double()
    got = layer(x).double()
    bound = 512 * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.abs().T) + 1e-6
    assert method.name == "gguf-q4_k+q4_k+q6_k+q8_0"
    assert ((got - (x.double() @ weight.T + bias)).abs() <= bound).all()
    with pytest.raises(ValueError, match="no part of rows 0..96"):
        method.qweight_rows(layer, 0, 96)
    # interleaved where the rows allow (the 8-row part stays in the file's order), on 8-bit activations
    assert method.interleave(layer) == 3
    assert method.name == "gguf-q4_k-x16+q4_k-x16+q6_k-x16+q8_0"
    got = layer(x).double()
    rounded = q8_rows(x, 256).double()  # the k-quant parts: Q8_K's runs of 256
    want = rounded @ weight.T + bias
    want[:, 128:] = (x.double() @ weight[128:].T + bias[128:])  # the Q8_0 part: float activations
    bound = 512 * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.abs().T) + 1e-5
    assert ((got - want).abs() <= bound).all()


def test_parts_of_a_fused_layer_must_cover_its_rows() -> None:
    from pagedllm.layers.quantization.gguf_linear import GGUFPartsLinearMethod

    with pytest.raises(ValueError, match="cover its rows in turn"):
        GGUFPartsLinearMethod([(0, 16, int(Q.Q4_K)), (32, 16, int(Q.Q6_K))], 256)


# --- whole models -------------------------------------------------------------------------------


@pytest.mark.slow
def test_bundled_model_holds_its_blocks(smollm_path: str) -> None:
    from gguf import GGUFReader

    smollm = LLM(num_kv_blocks=64, max_model_len=256)
    model = smollm.llm_engine.model_runner.model
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(smollm_path).tensors)
    held = resident_bytes(model_tensors(model))
    # measured from what the model holds (the RoPE tables are its only other tensors)
    assert held <= 1.15 * file_bytes, (held, file_bytes)
    assert smollm.weight_bytes == held
    assert model.lm_head.quant_method.name == "gguf-q8_0-x16"  # interleaved: 49152 rows
    assert model.lm_head.qweight is model.model.embed_tokens.qweight  # the tied head: the same bytes
    assert model.model.layers[0].mlp.gate_up_proj.quant_method.name == "gguf-q4_1-x16"
    assert not any(p.dtype == torch.float32 and p.dim() == 2 and p.shape[0] >= 192 for p in model.parameters())
    # kv_cache_dtype="auto" with the blocks kept: a float16 cache, llama.cpp's default for the file
    assert smollm.llm_engine.model_runner.kv_cache.dtype == torch.float16
    # the parsed file (metadata objects and the mapping) is let go once the weights are loaded
    from pagedllm.loader.gguf_loader import open_reader

    assert open_reader.cache_info().currsize == 0


def _permute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (per head: halves -> interleaved), as its converter writes GGUF files."""
    shape = w.shape
    return w.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """The inverse of ``_permute_rope_rows``: a file's Q/K rows back in Hugging Face's order."""
    shape = w.shape
    return w.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


_GGUF_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def write_quantized_gguf(
    hf_model, arch: str, ggml_type: GGMLQuantizationType, path: str,  # noqa: ANN001
    types: dict[str, GGMLQuantizationType] | None = None,
) -> dict[str, torch.Tensor]:
    """``hf_model``'s weights as a GGUF file, 2-D tensors in ``ggml_type`` (or ``types[name]``, by HF name
    suffix); returns them dequantized (HF names)."""
    cfg = hf_model.config
    writer = GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_eos_token_id(cfg.eos_token_id)
    rounded: dict[str, torch.Tensor] = {}
    for name, tensor in hf_model.state_dict().items():
        w = tensor.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{_GGUF_NAMES[rest]}"
        stored = w
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_attention_heads if "attn_q" in gguf_name else cfg.num_key_value_heads
            stored = _permute_rope_rows(w, heads)
        kind = next((t for sfx, t in (types or {}).items() if name.endswith(sfx)), ggml_type)
        if w.ndim == 2 and kind in [*K_TYPES, *LOW_K_TYPES, Q.NVFP4]:
            # gguf cannot quantize to K types (nor NVFP4): the file gets random valid blocks, and the model
            # (transformers too) runs what they hold
            blocks = random_blocks(kind, *w.shape, seed=zlib.crc32(name.encode()))
            writer.add_tensor(gguf_name, blocks, raw_dtype=kind)
            held = np.asarray(dequantize(blocks, kind), np.float32)
            if stored is not w:  # the file's q/k rows are in llama.cpp's order
                heads = cfg.num_attention_heads if "attn_q" in gguf_name else cfg.num_key_value_heads
                held = _unpermute_rope_rows(held, heads)
            rounded[name] = torch.from_numpy(np.ascontiguousarray(held))
        elif w.ndim == 2:
            blocks = quantize(stored, kind)
            writer.add_tensor(gguf_name, blocks, raw_dtype=kind)
            # rows are whole blocks, so quantizing in llama.cpp's row order rounds each row the same
            rounded[name] = torch.from_numpy(np.asarray(dequantize(quantize(w, kind), kind), np.float32))
        else:
            writer.add_tensor(gguf_name, stored)
            rounded[name] = tensor.detach().float()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return rounded


# The block type and the family are independent here (the type decides the linear layers' kernels, the
# family the model around them): every type on Llama, and Qwen3 (q/k norms) on one of them; Qwen3 on K-quant
# blocks is test_tiny_q4_k_m_models_match_transformers_on_the_blocks_weights[qwen3-Q4_K_M]'s
@pytest.mark.parametrize(("arch", "ggml_type"), [
    ("llama", Q.Q4_0), ("llama", Q.Q4_1), ("llama", Q.Q8_0),
    pytest.param("qwen3", Q.Q8_0, marks=pytest.mark.slow),  # qwen3: `make test`
], ids=["llama-Q4_0", "llama-Q4_1", "llama-Q8_0", "qwen3-Q8_0"])
def test_tiny_gguf_models_match_transformers_on_the_dequantized_weights(
    arch: str, ggml_type: GGMLQuantizationType, tiny_model_dirs: dict[str, str], hf_tiny: dict,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    import copy

    hf = copy.deepcopy(hf_tiny[arch])
    path = os.path.join(tmp_path_factory.mktemp(f"gguf-{arch}"), f"tiny-{ggml_type.name}.gguf")
    rounded = write_quantized_gguf(hf, arch, ggml_type, path)
    hf.load_state_dict(rounded)  # transformers runs the weights the file's blocks hold
    llm = LLM(path, tokenizer=tiny_model_dirs[arch], max_model_len=256, num_kv_blocks=64, **F32_KV)
    model = llm.llm_engine.model_runner.model
    assert model.lm_head.quant_method.name == f"gguf-{ggml_type.name.lower()}-x16"
    assert type(model.model.embed_tokens.quant_method).__name__ == "GGUFEmbeddingMethod"
    prompts = [[1, 400, 3000, 77, 12000, 5], [1, 9, 9, 9], list(range(100, 140))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):  # interleaved blocks: 8-bit activations (kernels/gguf/gguf_x16.h)
        assert_greedy_within_q8_noise(hf, prompt, out.outputs[0].token_ids)
    # on float32 activations, the file's blocks give transformers' tokens exactly
    llm = LLM(path, tokenizer=tiny_model_dirs[arch], max_model_len=256, num_kv_blocks=64, **F32_KV,
              gguf_activations="float32")
    assert llm.llm_engine.model_runner.model.lm_head.quant_method.name == f"gguf-{ggml_type.name.lower()}"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12)


@pytest.mark.parametrize("ggml_type", [Q.F16, Q.BF16], ids=lambda t: t.name)
def test_half_precision_files_are_held_as_their_bytes_and_match_transformers(
    ggml_type: GGMLQuantizationType, tiny_model_dirs: dict[str, str], hf_tiny: dict,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """F16 / BF16 matrices (``convert_hf_to_gguf.py --outtype f16`` / ``bf16``) are held as the file's bytes.

    gguf hands F16 tensors over as float16 values, not bytes: read as uint8 they were cast value by value
    (a load error, or worse); the loader reinterprets them instead.
    """
    import copy

    hf = copy.deepcopy(hf_tiny["llama"])
    path = os.path.join(tmp_path_factory.mktemp("gguf-half"), f"tiny-{ggml_type.name}.gguf")
    rounded = write_quantized_gguf(hf, "llama", ggml_type, path)
    hf.load_state_dict(rounded)
    llm = LLM(path, tokenizer=tiny_model_dirs["llama"], max_model_len=256, num_kv_blocks=64, **F32_KV,
              gguf_activations="float32")
    assert llm.llm_engine.model_runner.weight_format == f"gguf:{ggml_type.name}"
    prompts = [[1, 400, 3000, 77, 12000, 5], list(range(100, 140))]
    assert_greedy_like_transformers(llm, hf, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                    "float32")


def assert_greedy_like_transformers(llm: LLM, hf, prompts: list[list[int]], params: SamplingParams,  # noqa: ANN001
                                    activations: str, group: int = 32) -> None:
    """``llm``'s greedy tokens are transformers' on the same weights: exactly on float32 activations, up to a
    near-tie on 8-bit ones (``assert_greedy_within_q8_noise``, its noise from runs of ``group`` inputs)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        if activations == "int8":
            assert_greedy_within_q8_noise(hf, prompt, out.outputs[0].token_ids, group)
        else:
            assert out.outputs[0].token_ids == hf_greedy(hf, prompt, params.max_tokens)


def _k_quant_model(arch: str):  # noqa: ANN202
    """A random 2-layer model whose rows hold whole 256-weight super-blocks (hidden 256, MLP 512)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  rope_theta=10000.0)
    config = LlamaConfig(**common) if arch == "llama" else Qwen3Config(**common)
    torch.manual_seed(4321)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.slow  # seconds per case: `make test` (the dequantized-weights test above keeps the fast tier's)
@pytest.mark.parametrize(("arch", "base"), [("llama", Q.Q4_K), ("qwen3", Q.Q4_K), ("llama", Q.Q5_K)],
                         ids=["llama-Q4_K_M", "qwen3-Q4_K_M", "llama-Q5_K_M"])
def test_tiny_q4_k_m_models_match_transformers_on_the_blocks_weights(
    arch: str, base: GGMLQuantizationType, tiny_model_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A Q4_K_M-like file (Q4_K, with Q6_K for v_proj and down_proj; Q5_K_M: Q5_K and Q6_K) runs from its
    super-blocks: interleaved on 8-bit activations by default, in the file's order on float32 activations."""
    hf = _k_quant_model(arch)
    path = os.path.join(tmp_path_factory.mktemp(f"gguf-k-{arch}"), f"tiny-{base.name}_M.gguf")
    rounded = write_quantized_gguf(hf, arch, base, path, {"v_proj.weight": Q.Q6_K, "down_proj.weight": Q.Q6_K})
    hf.load_state_dict(rounded)
    prompts = [[1, 400, 3000, 77, 12000, 5], list(range(100, 140))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for activations, suffix in (("int8", "-x16"), ("float32", "")):
        llm = LLM(path, tokenizer=tiny_model_dirs[arch], max_model_len=256, num_kv_blocks=64, **F32_KV,
                  gguf_activations=activations)
        model = llm.llm_engine.model_runner.model
        low = base.name.lower()
        assert llm.llm_engine.model_runner.weight_format == f"gguf:{base.name}+Q6_K"
        assert model.model.layers[0].mlp.down_proj.quant_method.name == f"gguf-q6_k{suffix}"
        assert model.model.layers[0].mlp.gate_up_proj.quant_method.name == f"gguf-{low}{suffix}"
        # q/k in Q4_K (Q5_K), v in Q6_K: the fused layer keeps each part in its type, nothing dequantized
        assert model.model.layers[0].self_attn.qkv_proj.quant_method.name == "gguf-" + "+".join(
            f"{t}{suffix}" for t in (low, low, "q6_k"))
        assert not any(p.dim() == 2 for p in model.parameters())  # no float weight matrix left
        assert_greedy_like_transformers(llm, hf, prompts, params, activations, group=256)  # Q8_K's runs


@pytest.mark.slow  # seconds per case: `make test`
@pytest.mark.parametrize(("base", "others"), [(Q.Q3_K, (Q.Q5_K, Q.Q4_K)), (Q.Q2_K, (Q.Q3_K, Q.Q3_K))],
                         ids=["Q3_K_M", "Q2_K"])
def test_tiny_q2_k_and_q3_k_files_run_from_their_blocks(
    base: GGMLQuantizationType, others: tuple[GGMLQuantizationType, GGMLQuantizationType],
    tiny_model_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Q3_K_M-like (Q3_K, v_proj Q5_K, down_proj Q4_K) and Q2_K-like (Q2_K, Q3_K v/down) files: the low k-quants
    stay in their blocks, float weights nowhere; tokens equal transformers' on the blocks' weights on float32
    activations (the file's order), and part from them at a near-tie only on int8 ones (interleaved)."""
    hf = _k_quant_model("llama")
    path = os.path.join(tmp_path_factory.mktemp("gguf-low-k"), f"tiny-{base.name}.gguf")
    rounded = write_quantized_gguf(hf, "llama", base, path, {"v_proj.weight": others[0], "down_proj.weight": others[1]})
    hf.load_state_dict(rounded)
    llm = LLM(path, tokenizer=tiny_model_dirs["llama"], max_model_len=256, num_kv_blocks=64, **F32_KV,
              gguf_activations="float32")
    model = llm.llm_engine.model_runner.model
    low = base.name.lower()
    assert model.model.layers[0].mlp.gate_up_proj.quant_method.name == f"gguf-{low}"
    assert model.model.layers[0].self_attn.qkv_proj.quant_method.name == f"gguf-{low}+{low}+{others[0].name.lower()}"
    assert not any(p.dim() == 2 for p in model.parameters())
    prompts = [[1, 400, 3000, 77, 12000, 5], list(range(100, 140))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12)
    # by default every part is interleaved, each in its own type
    llm = LLM(path, tokenizer=tiny_model_dirs["llama"], max_model_len=256, num_kv_blocks=64, **F32_KV)
    layer = llm.llm_engine.model_runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.quant_method.name == f"gguf-{low}-x16+{low}-x16+{others[0].name.lower()}-x16"
    assert layer.mlp.gate_up_proj.quant_method.name == f"gguf-{low}-x16"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    group = 256 if any(t in K_QUANTS for t in (base, *others)) else 32  # Q3_K_M's Q4_K / Q5_K layers: Q8_K's runs
    for prompt, out in zip(prompts, outs):
        assert_greedy_within_q8_noise(hf, prompt, out.outputs[0].token_ids, group)


@pytest.mark.parametrize("base", [Q.Q5_0, Q.Q5_1], ids=["Q4_K_M-narrow", "Q5_K_M-narrow"])
def test_k_quant_files_of_narrow_rows_run_their_q5_fallbacks_from_their_blocks(
    base: GGMLQuantizationType, tiny_model_dirs: dict[str, str], hf_tiny: dict,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Where a row is not whole super-blocks of 256 (SmolLM2's 576, Qwen2.5-0.5B's 896), llama-quantize's
    Q4_K_M writes Q5_0 for Q4_K and Q8_0 for Q6_K; its Q5_K_M writes Q5_1 for Q5_K. Such a file (here the tiny
    Llama's rows of 64 and 128) keeps every layer in its blocks: interleaved on 8-bit activations by default,
    the file's order on float32 activations, where its tokens equal transformers' on the blocks' weights."""
    import copy

    hf = copy.deepcopy(hf_tiny["llama"])
    path = os.path.join(tmp_path_factory.mktemp("gguf-q5"), f"tiny-{base.name}.gguf")
    rounded = write_quantized_gguf(hf, "llama", base, path, {"v_proj.weight": Q.Q8_0, "down_proj.weight": Q.Q8_0})
    hf.load_state_dict(rounded)
    prompts = [[1, 400, 3000, 77, 12000, 5], list(range(100, 140))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    low = base.name.lower()
    for activations, suffix in (("int8", "-x16"), ("float32", "")):
        llm = LLM(path, tokenizer=tiny_model_dirs["llama"], max_model_len=256, num_kv_blocks=64, **F32_KV,
                  gguf_activations=activations)
        model = llm.llm_engine.model_runner.model
        assert llm.llm_engine.model_runner.weight_format == f"gguf:{base.name}+Q8_0"
        assert model.model.layers[0].self_attn.qkv_proj.quant_method.name == "gguf-" + "+".join(
            f"{t}{suffix}" for t in (low, low, "q8_0"))
        assert model.model.layers[0].mlp.gate_up_proj.quant_method.name == f"gguf-{low}{suffix}"
        assert not any(p.dim() == 2 for p in model.parameters())  # no float weight matrix left
        assert_greedy_like_transformers(llm, hf, prompts, params, activations)
        # the mixed q/k/v's parts joined inside the step's native program: a decode step is one program
        graphs = llm.llm_engine.model_runner.captured_decode.graphs
        assert graphs and all(num_programs(g.runs) == len(g.runs) == 1 for g in graphs.values())


def test_a_type_with_no_kernel_is_dequantized_with_a_warning(
    tiny_model_dirs: dict[str, str], hf_tiny: dict, tmp_path_factory: pytest.TempPathFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """NVFP4 has no kernel here: those layers (v_proj, so the fused qkv, and down_proj) load as bfloat16
    (tests/models/test_gguf_dequantized.py)."""
    import copy
    import logging

    hf = copy.deepcopy(hf_tiny["llama"])
    path = os.path.join(tmp_path_factory.mktemp("gguf-mixed"), "mixed.gguf")
    rounded = write_quantized_gguf(hf, "llama", Q.Q8_0, path, {"v_proj.weight": Q.NVFP4, "down_proj.weight": Q.NVFP4})
    hf.load_state_dict(rounded)
    with caplog.at_level(logging.WARNING, logger="pagedllm.runner.model_loader"):
        llm = LLM(path, tokenizer=tiny_model_dirs["llama"], max_model_len=256, num_kv_blocks=64, **F32_KV)
    assert "dequantized to bfloat16" in caplog.text and "NVFP4" in caplog.text
    layer = llm.llm_engine.model_runner.model.model.layers[0]
    assert not layer.self_attn.qkv_proj.quant_method.name.startswith("gguf")
    assert not layer.mlp.down_proj.quant_method.name.startswith("gguf")
    assert layer.mlp.gate_up_proj.quant_method.name == "gguf-q8_0-x16"
    prompt = [1, 400, 3000, 77, 12000, 5]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert_greedy_within_q8_noise(hf, prompt, out[0].outputs[0].token_ids)  # the Q8_0 layers: 8-bit activations


_PAGES_SCRIPT = """
import json, sys
from pagedllm.loader.gguf_loader import iter_weights, open_reader, read_config

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

path = sys.argv[1]
weights = iter_weights(path, read_config(open_reader(path)))
weights.keep = set(weights.quantized)  # every quantized tensor as its bytes
before, total, growth = rss(), 0, 0
for name, tensor in weights:
    size = tensor.numel() * tensor.element_size()
    total += size
    # resident now, beyond the tensor in hand (its copy, and the file's pages it was copied from)
    growth = max(growth, rss() - before - 2 * size)
    del tensor
print(json.dumps({"growth": growth, "total": total}))
"""


@pytest.mark.slow
def test_the_files_pages_leave_resident_memory_as_tensors_are_read(smollm_path: str) -> None:
    """A load reads the file through its mapping; each tensor's pages are let go once it is copied, so the
    file does not stay resident beside the weights made from it (without that, the growth is the file)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _PAGES_SCRIPT, smollm_path], capture_output=True, text=True,
                         timeout=300, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["total"] > 80e6  # the bundled file's ~92 MB of tensors went through
    assert result["growth"] < 0.15 * result["total"], result


def test_a_truncated_gguf_is_a_clear_error(smollm_path: str, tmp_path) -> None:  # noqa: ANN001
    cut = tmp_path / "cut.gguf"
    with open(smollm_path, "rb") as f:
        cut.write_bytes(f.read(os.path.getsize(smollm_path) // 2))
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        LLM(str(cut), max_model_len=256, num_kv_blocks=64)
