"""The native router and pair grouping (``torch.ops.pagedllm.moe_route`` / ``moe_group``) against the torch ones.

``moe_route`` must give ``route_logits``' bits (``layers/router.py``) for every router kind a family uses:
softmax then top-k (renormalised or not, Qwen3-MoE / Mixtral), top-k then softmax (GraniteMoE, gpt-oss),
sigmoid with and without a correction bias (DeepSeek-V3-style), with a routed scaling factor; over logits
with many exact ties (integers), where the order among equal scores is the one thing a top-k of its own
would get wrong. ``moe_group`` must give ``PairGrouping``'s torch tensors (a stable argsort): tokens spread
over every expert, all on one, most experts empty, no rows. ``moe_slot_sum`` must give ``SlotSum``'s torch
loop's bits for the weighted sum of the slots (and the shared expert's term to float rounding), a row alike
alone and among others. Bad input is a ValueError, not a crash.
``tests/kernels/test_kernel_variants.py`` runs this file on every kernel variant the CPU runs.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import load_kernels
from pagedllm.layers.moe_pairs import PairGrouping
from pagedllm.layers.moe_slot_sum import SlotSum
from pagedllm.layers.native_ops import NativeOps
from pagedllm.layers.router import ROUTER_KINDS, RouterScores, RouterSpec, route_logits


@pytest.fixture(scope="module")
def ops() -> NativeOps:
    lib = load_kernels()
    assert lib is not None, "the native kernels must build on the test machine"
    return NativeOps(lib)


SPECS = [
    RouterSpec(128, 8, renormalize=True),  # Qwen3-30B-A3B
    RouterSpec(8, 2),  # Mixtral: softmax then top-2, not renormalised
    RouterSpec(60, 4, renormalize=False, routed_scaling_factor=2.5),
    RouterSpec(32, 4, order="topk_softmax"),  # gpt-oss, GraniteMoE
    RouterSpec(16, 1, order="topk_softmax"),
    RouterSpec(64, 6, scoring="sigmoid", renormalize=True, correction_bias=True, routed_scaling_factor=2.5),
    RouterSpec(64, 6, scoring="sigmoid", renormalize=False),
    RouterSpec(5, 5, renormalize=True),  # every expert chosen
]


def _logits(rows: int, num_experts: int, ties: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if ties:  # a handful of values: most of a row's scores tie with others
        return torch.randint(-2, 3, (rows, num_experts), generator=g).float()
    return torch.randn(rows, num_experts, generator=g) * 3


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.scoring}-{s.order}-{s.num_experts}x{s.top_k}")
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("ties", [False, True])
def test_moe_route_gives_the_torch_routings_bits(ops: NativeOps, spec: RouterSpec, rows: int, ties: bool) -> None:
    logits = _logits(rows, spec.num_experts, ties, seed=rows * 31 + spec.top_k)
    bias = torch.randn(spec.num_experts) * 0.1 if spec.correction_bias else None
    want_w, want_ids = route_logits(logits, spec, bias)
    scores = RouterScores(spec)
    scores.select_impl(ops)
    got_w, got_ids = scores(logits, bias)
    assert got_w.dtype == torch.float32 and got_ids.dtype == torch.int64
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_w.view(torch.int32), want_w.view(torch.int32))  # bit for bit, signs of zero included
    if spec.renormalize and spec.routed_scaling_factor == 1.0:
        assert torch.allclose(got_w.sum(-1), torch.ones(rows))  # a real routing, not two equal wrong ones


def test_moe_route_reads_other_float_dtypes_as_torch_does(ops: NativeOps) -> None:
    spec = RouterSpec(32, 4, renormalize=True)
    logits = _logits(9, 32, False, seed=3).to(torch.bfloat16)
    want = route_logits(logits, spec)
    got = ops.moe_route(logits, 4, ROUTER_KINDS[("softmax", "softmax_topk")], True, None, 1.0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _ids(case: str, rows: int, top_k: int, num_experts: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rows + top_k)
    if case == "one":  # every pair on expert 3
        return torch.full((rows, top_k), 3, dtype=torch.int64)
    if case == "few":  # two experts of many, the rest empty
        return torch.randint(0, 2, (rows, top_k), generator=g) * (num_experts - 1)
    return torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(rows)]) if rows else \
        torch.empty(0, top_k, dtype=torch.int64)


@pytest.mark.parametrize("case", ["spread", "one", "few"])
@pytest.mark.parametrize(("rows", "top_k", "num_experts"), [(1, 8, 128), (13, 2, 8), (64, 4, 16), (0, 2, 8)])
def test_moe_group_equals_a_stable_argsort(ops: NativeOps, case: str, rows: int, top_k: int,
                                           num_experts: int) -> None:
    ids = _ids(case, rows, top_k, num_experts)
    grouping = PairGrouping(num_experts)
    want = grouping.forward_torch(ids)
    grouping.select_impl(ops)
    got = grouping(ids)
    for name, w, g in zip(want._fields, want, got):
        assert g.dtype == w.dtype and torch.equal(g, w), name
    assert int(got.counts.sum()) == rows * top_k


def test_bad_input_is_a_value_error(ops: NativeOps) -> None:
    kind = ROUTER_KINDS[("softmax", "softmax_topk")]
    with pytest.raises(ValueError, match="top_k"):
        ops.moe_route(torch.randn(2, 8), 9, kind, True, None, 1.0)
    with pytest.raises(ValueError, match="kind"):
        ops.moe_route(torch.randn(2, 8), 2, 7, True, None, 1.0)
    with pytest.raises(ValueError, match="correction bias"):
        ops.moe_route(torch.randn(2, 8), 2, kind, True, torch.zeros(8), 1.0)
    with pytest.raises(ValueError, match="correction_bias"):
        ops.moe_route(torch.randn(2, 8), 2, ROUTER_KINDS[("sigmoid", "softmax_topk")], True, torch.zeros(7), 1.0)
    with pytest.raises(ValueError, match="logits"):
        ops.moe_route(torch.randn(8), 2, kind, True, None, 1.0)
    with pytest.raises(ValueError, match="outside"):
        ops.moe_group(torch.tensor([[0, 8]]), 8)
    with pytest.raises(ValueError, match="outside"):
        ops.moe_group(torch.tensor([[-1, 2]]), 8)
    with pytest.raises(ValueError, match="int64"):
        ops.moe_group(torch.tensor([[0, 1]], dtype=torch.int32), 8)


def _slot_sums(ops: NativeOps) -> tuple[SlotSum, SlotSum]:
    torch_sum, native_sum = SlotSum(), SlotSum()
    native_sum.select_impl(ops)
    return torch_sum, native_sum


@pytest.mark.parametrize(("rows", "top_k", "hidden"), [(1, 8, 2048), (7, 2, 33), (64, 8, 96), (5, 1, 16), (0, 4, 8)])
def test_moe_slot_sum_gives_the_torch_loops_bits(ops: NativeOps, rows: int, top_k: int, hidden: int) -> None:
    """The slots' weighted sum: the bits of the torch loop (each product rounded, then added, slot by slot)."""
    g = torch.Generator().manual_seed(rows * 7 + top_k)
    y = torch.randn(rows, top_k, hidden, generator=g) * 10
    weights = torch.rand(rows, top_k, generator=g)
    torch_sum, native_sum = _slot_sums(ops)
    want = torch_sum(y, weights)
    got = native_sum(y, weights)
    assert got.shape == (rows, hidden) and got.dtype == torch.float32
    assert torch.equal(got, want)
    # and against float64: the sum it claims to be
    if rows:
        exact = (y.double() * weights.double().unsqueeze(-1)).sum(1)
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("gated", [False, True])
def test_moe_slot_sum_adds_the_shared_expert(ops: NativeOps, gated: bool) -> None:
    """``+ shared`` (Qwen3.5-MoE's shared expert), ``+ sigmoid(gate) * shared`` (with its gate): the torch terms
    to float rounding (the slots' part bit for bit: no gate, plain adds)."""
    g = torch.Generator().manual_seed(11)
    y, weights = torch.randn(9, 4, 40, generator=g), torch.rand(9, 4, generator=g)
    shared, gate = torch.randn(9, 40, generator=g), (torch.randn(9, 1, generator=g) * 4 if gated else None)
    torch_sum, native_sum = _slot_sums(ops)
    want, got = torch_sum(y, weights, shared, gate), native_sum(y, weights, shared, gate)
    if gated:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        exact = (y.double() * weights.double().unsqueeze(-1)).sum(1) + torch.sigmoid(gate.double()) * shared.double()
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(got, want)


def test_moe_slot_sum_of_a_row_is_the_same_alone_and_among_others(ops: NativeOps) -> None:
    g = torch.Generator().manual_seed(5)
    y, weights = torch.randn(64, 8, 300, generator=g), torch.rand(64, 8, generator=g)
    shared, gate = torch.randn(64, 300, generator=g), torch.randn(64, 1, generator=g)
    _, native_sum = _slot_sums(ops)
    batch = native_sum(y, weights, shared, gate)
    for i in (0, 17, 63):
        alone = native_sum(y[i : i + 1], weights[i : i + 1], shared[i : i + 1], gate[i : i + 1])
        assert torch.equal(alone[0], batch[i])


@pytest.mark.parametrize("case", ["2-D y", "weights' shape", "gate without shared", "shared rows", "bf16 y"])
def test_moe_slot_sum_refuses_bad_input(ops: NativeOps, case: str) -> None:
    y, w = torch.randn(3, 2, 8), torch.rand(3, 2)
    shared, gate = None, None
    if case == "2-D y":
        y = y.view(3, 16)
    elif case == "weights' shape":
        w = torch.rand(3, 3)
    elif case == "gate without shared":
        gate = torch.randn(3, 1)
    elif case == "shared rows":
        shared = torch.randn(2, 8)
    else:
        y = y.to(torch.bfloat16)
    with pytest.raises(ValueError, match="moe_slot_sum"):
        ops.moe_slot_sum(y, w, shared, gate)
