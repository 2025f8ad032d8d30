"""The grouped-expert GGUF linear (``gguf_moe_linear``) against the dense op run expert by expert.

The oracle is the dense ``gguf_linear`` (itself checked against gguf's
dequantization in test_gguf_quantized.py and test_gguf_iq4_mxfp4.py) called
on each expert's rows of the stacked weight with that expert's tokens,
gathered by a plain Python loop over the routing: the grouped op must give
the same bits, for every block type in both layouts, whatever the routing.
test_kernel_variants.py runs this file on every ISA variant the CPU runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from test_gguf_iq4_mxfp4 import random_blocks as iq_random_blocks
from test_gguf_quantized import ALL_TYPES, FLOAT_TYPES, random_blocks

from pagedllm.kernels import load_kernels
from pagedllm.layers.linear import Linear
from pagedllm.layers.quantization.gguf_linear import GGUFLinearMethod
from pagedllm.layers.quantization.gguf_moe import (
    gguf_experts_layer,
    gguf_experts_linear,
    route_pairs,
)

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="the GGUF kernels need the native build")

Q = GGMLQuantizationType
IQ_TYPES = [Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4]
# (type, interleaved): every type the dense op takes, in file order and (all but F16 / BF16) interleaved x16
CASES = [(t, False) for t in ALL_TYPES + IQ_TYPES] + [(t, True) for t in ALL_TYPES + IQ_TYPES if t not in FLOAT_TYPES]
ops = torch.ops.pagedllm
K = 256  # one k-quant super-block per row: the smallest row every type takes


def stacked_weight(ggml_type: GGMLQuantizationType, interleaved: bool, rows: int, seed: int) -> tuple[torch.Tensor, int]:
    """Random valid blocks ``[rows, row bytes]`` of ``K`` inputs, and the kernels' number for their layout."""
    make = iq_random_blocks if ggml_type in IQ_TYPES else random_blocks
    weight = torch.from_numpy(np.ascontiguousarray(make(ggml_type, rows, K, seed)))
    if not interleaved:
        return weight, int(ggml_type)
    ops.gguf_interleave_(weight, int(ggml_type), K)
    return weight, 512 + int(ggml_type)


def pairs_of(routing: list[list[int]], num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """token_ids, expert_offsets (int32) of a routing (each token's experts), by a plain loop: experts in
    order, each one's tokens in order."""
    token_ids, offsets = [], [0]
    for e in range(num_experts):
        token_ids += [t for t, experts in enumerate(routing) for chosen in experts if chosen == e]
        offsets.append(len(token_ids))
    return torch.tensor(token_ids, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int32)


def per_expert_loop(x: torch.Tensor, weight: torch.Tensor, type_: int, num_experts: int, token_ids: torch.Tensor,
                    offsets: torch.Tensor) -> torch.Tensor:
    """The dense op on each expert's tokens and rows: ``[num_pairs, N]``."""
    n = weight.shape[0] // num_experts
    out = torch.full((token_ids.shape[0], n), float("nan"))
    for e in range(num_experts):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if hi > lo:
            rows = x[token_ids[lo:hi].long()].contiguous()
            out[lo:hi] = ops.gguf_linear(rows, weight[e * n : (e + 1) * n], type_, K, None)
    return out


def routings(num_tokens: int, num_experts: int, seed: int) -> dict[str, list[list[int]]]:
    rng = np.random.default_rng(seed)
    spread = [list(rng.permutation(num_experts)[:2]) for _ in range(num_tokens)]  # top-2
    spread[0], spread[1] = [0, num_experts - 1], [num_experts - 1, 0]  # the first and last experts in use
    return {
        "spread": spread,
        "one_expert": [[num_experts // 2] for _ in range(num_tokens)],
        "some_idle": [[1, 3] if t % 3 == 0 else [1 + 2 * (t % 2)] for t in range(num_tokens)],  # only 1 and 3
    }


@pytest.mark.parametrize(("ggml_type", "interleaved"), CASES,
                         ids=[f"{t.name}-{'x16' if i else 'file'}" for t, i in CASES])
def test_grouped_op_is_the_dense_op_per_expert_bit_for_bit(ggml_type: GGMLQuantizationType, interleaved: bool) -> None:
    for num_experts, num_tokens, n in ((4, 9, 32), (5, 13, 48), (8, 6, 16)):
        weight, type_ = stacked_weight(ggml_type, interleaved, num_experts * n, seed=num_experts)
        x = torch.randn(num_tokens, K, generator=torch.Generator().manual_seed(num_experts))
        for name, routing in routings(num_tokens, num_experts, seed=num_experts).items():
            token_ids, offsets = pairs_of(routing, num_experts)
            got = ops.gguf_moe_linear(x, weight, type_, num_experts, token_ids, offsets)
            want = per_expert_loop(x, weight, type_, num_experts, token_ids, offsets)
            assert got.shape == (token_ids.shape[0], n) and got.dtype == torch.float32
            assert torch.equal(got, want), f"E={num_experts} {name}"
    # decode: one token to all 8 experts, one of them twice (a repeated pair is only another row)
    token_ids, offsets = pairs_of([[0, 1, 2, 3, 4, 5, 6, 7, 3]], 8)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(1))
    got = ops.gguf_moe_linear(x, weight, type_, 8, token_ids, offsets)
    assert torch.equal(got, per_expert_loop(x, weight, type_, 8, token_ids, offsets))


@pytest.mark.parametrize(("ggml_type", "interleaved", "n"), [(Q.Q4_0, False, 131), (Q.Q6_K, False, 130),
                                                              (Q.Q4_K, True, 272), (Q.Q8_0, True, 160)])
def test_long_inputs_and_wide_experts_match_too(ggml_type: GGMLQuantizationType, interleaved: bool, n: int) -> None:
    """Several channel chunks per expert (a last strip part full, for file order), and an expert with more rows
    than the dense op's row blocks hold (its rows run in blocks, as the dense op's do)."""
    num_experts, num_tokens = 4, 600
    weight, type_ = stacked_weight(ggml_type, interleaved, num_experts * n, seed=5)
    x = torch.randn(num_tokens, K, generator=torch.Generator().manual_seed(5))
    routing = [[2] if t < 590 else [0, 2] for t in range(num_tokens)]  # 600 rows on expert 2, 10 on expert 0
    token_ids, offsets = pairs_of(routing, num_experts)
    got = ops.gguf_moe_linear(x, weight, type_, num_experts, token_ids, offsets)
    assert torch.equal(got, per_expert_loop(x, weight, type_, num_experts, token_ids, offsets))


@pytest.mark.parametrize("interleaved", [False, True], ids=["file", "x16"])
def test_no_pairs_give_an_empty_output(interleaved: bool) -> None:
    weight, type_ = stacked_weight(Q.Q4_1, interleaved, 4 * 16, seed=2)
    for num_tokens in (0, 3):
        x = torch.randn(num_tokens, K)
        got = ops.gguf_moe_linear(x, weight, type_, 4, torch.zeros(0, dtype=torch.int32),
                                  torch.zeros(5, dtype=torch.int32))
        assert got.shape == (0, 16) and got.dtype == torch.float32


def test_bad_inputs_are_value_errors() -> None:
    weight, type_ = stacked_weight(Q.Q4_K, True, 4 * 16, seed=3)
    x = torch.randn(3, K)
    ids, offsets = torch.tensor([0, 2, 1, 1], dtype=torch.int32), torch.tensor([0, 2, 2, 3, 4], dtype=torch.int32)
    ops.gguf_moe_linear(x, weight, type_, 4, ids, offsets)  # the good call these spoil one thing of
    bad = {
        "x float64": (x.double(), weight, type_, 4, ids, offsets),
        "x 1-D": (x[0], weight, type_, 4, ids, offsets),
        "x of other width": (torch.randn(3, 512), weight, type_, 4, ids, offsets),
        "x not contiguous": (torch.randn(K, 3).T, weight, type_, 4, ids, offsets),
        "weight not uint8": (x, weight.view(torch.int8), type_, 4, ids, offsets),
        "no such type": (x, weight, 99, 4, ids, offsets),
        "rows not E experts": (x, weight, type_, 3, ids, torch.tensor([0, 2, 3, 4], dtype=torch.int32)),
        "no experts": (x, weight, type_, 0, ids, torch.tensor([4], dtype=torch.int32)),
        "x16 experts of 8 rows": (x, weight, type_, 8, ids, torch.tensor([0, 2, 2, 3, 4, 4, 4, 4, 4], dtype=torch.int32)),
        "token_ids int64": (x, weight, type_, 4, ids.long(), offsets),
        "token_ids 2-D": (x, weight, type_, 4, ids.view(2, 2), offsets),
        "offsets int64": (x, weight, type_, 4, ids, offsets.long()),
        "offsets of E entries": (x, weight, type_, 4, ids, offsets[:4]),
        "offsets decrease": (x, weight, type_, 4, ids, torch.tensor([0, 3, 2, 3, 4], dtype=torch.int32)),
        "offsets end short of P": (x, weight, type_, 4, ids, torch.tensor([0, 2, 2, 3, 3], dtype=torch.int32)),
        "offsets end past P": (x, weight, type_, 4, ids, torch.tensor([0, 2, 2, 3, 5], dtype=torch.int32)),
        "offsets start past 0": (x, weight, type_, 4, ids, torch.tensor([1, 2, 2, 3, 4], dtype=torch.int32)),
        "token id past T": (x, weight, type_, 4, torch.tensor([0, 3, 1, 1], dtype=torch.int32), offsets),
        "token id negative": (x, weight, type_, 4, torch.tensor([0, -1, 1, 1], dtype=torch.int32), offsets),
    }
    for name, args in bad.items():
        with pytest.raises(ValueError, match="gguf_moe_linear"):
            ops.gguf_moe_linear(*args)
            pytest.fail(name)
    file_weight, file_type = stacked_weight(Q.Q4_0, False, 4 * 5, seed=3)  # file order takes experts of 5 rows
    assert ops.gguf_moe_linear(x, file_weight, file_type, 4, ids, offsets).shape == (4, 5)


def test_fake_implementation_gives_the_kernels_shape() -> None:
    weight, type_ = stacked_weight(Q.Q8_0, True, 4 * 16, seed=4)
    x = torch.randn(3, K)
    ids, offsets = torch.tensor([0, 2, 1], dtype=torch.int32), torch.tensor([0, 2, 2, 3, 3], dtype=torch.int32)
    real = ops.gguf_moe_linear(x, weight, type_, 4, ids, offsets)
    fake = ops.gguf_moe_linear(x.to("meta"), weight.to("meta"), type_, 4, ids.to("meta"), offsets.to("meta"))
    assert fake.device.type == "meta" and (fake.shape, fake.dtype) == (real.shape, real.dtype)
    torch.library.opcheck(ops.gguf_moe_linear.default, (x, weight, type_, 4, ids, offsets),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_route_pairs_sorts_the_pairs_by_expert() -> None:
    topk_ids = torch.tensor([[3, 0], [0, 1], [3, 1], [0, 3]])
    order, token_ids, offsets = route_pairs(topk_ids, 5)
    # pairs (token, slot) flat: 0:(0,3) 1:(0,0) 2:(1,0) 3:(1,1) 4:(2,3) 5:(2,1) 6:(3,0) 7:(3,3)
    assert order.tolist() == [1, 2, 6, 3, 5, 0, 4, 7]
    assert token_ids.tolist() == [0, 1, 3, 1, 2, 0, 2, 3] and token_ids.dtype == torch.int32
    assert offsets.tolist() == [0, 3, 5, 5, 8, 8] and offsets.dtype == torch.int32
    _, none_ids, none_offsets = route_pairs(torch.zeros(0, 8, dtype=torch.int64), 4)
    assert none_ids.shape == (0,) and none_offsets.tolist() == [0] * 5
    for bad in (torch.tensor([[0, 5]]), torch.tensor([[-1, 0]]), torch.tensor([0, 1]), torch.tensor([[0.0, 1.0]])):
        with pytest.raises(ValueError, match="topk_ids"):
            route_pairs(bad, 5)


class _GGUFConfig:
    """A quantization config holding every layer in GGUF blocks of one type, interleaved after loading."""

    def __init__(self, ggml_type: int) -> None:
        self.ggml_type = ggml_type

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> GGUFLinearMethod:
        return GGUFLinearMethod(self.ggml_type, interleave=True)


@pytest.mark.parametrize("ggml_type", [Q.Q6_K, Q.F16], ids=lambda t: t.name)
def test_a_stacked_experts_layer_with_bias_is_the_dense_layer_per_expert(ggml_type: GGMLQuantizationType) -> None:
    num_experts, n, num_tokens = 6, 32, 5
    layer = Linear(K, num_experts * n, bias=True, quant_config=_GGUFConfig(int(ggml_type)))
    layer.qweight.copy_(torch.from_numpy(random_blocks(ggml_type, num_experts * n, K, seed=6)))
    layer.bias.data.copy_(torch.randn(num_experts * n))
    layer.quant_method.process_weights_after_loading(layer)  # Q6_K: interleaved; F16 stays in file order
    method = layer.quant_method
    x = torch.randn(num_tokens, K, generator=torch.Generator().manual_seed(6))
    topk_ids = torch.tensor([[0, 5], [5, 2], [2, 0], [0, 2], [5, 0]])
    order, token_ids, offsets = route_pairs(topk_ids, num_experts)
    got = gguf_experts_layer(layer, x, token_ids, offsets, num_experts)
    assert got is not None
    for p in range(token_ids.shape[0]):  # pair p is token order[p] // 2's, to expert topk_ids.flatten()[order[p]]
        e = int(topk_ids.flatten()[order[p]])
        want = ops.gguf_linear(x[int(token_ids[p])][None], layer.qweight[e * n : (e + 1) * n], method.ggml_type, K,
                               layer.bias[e * n : (e + 1) * n].detach())
        assert torch.equal(got[p], want[0])
    with pytest.raises(ValueError, match="float32"):
        gguf_experts_linear(x.double(), layer.qweight, method.ggml_type, num_experts, token_ids, offsets)
    assert gguf_experts_layer(Linear(K, 12), x, token_ids, offsets, num_experts) is None  # not GGUF blocks

