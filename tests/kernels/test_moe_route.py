"""The native router and pair grouping (``torch.ops.pagedllm.moe_route`` / ``moe_group``) against the torch ones.

``moe_route`` must give ``route_logits``' bits (``layers/router.py``) for every router kind a family uses:
softmax then top-k (renormalised or not, Qwen3-MoE / Mixtral), top-k then softmax (GraniteMoE, gpt-oss),
sigmoid with and without a correction bias (DeepSeek-V3-style), with a routed scaling factor; over logits
with many exact ties (integers), where the order among equal scores is the one thing a top-k of its own
would get wrong. ``moe_group`` must give ``PairGrouping``'s torch tensors (a stable argsort): tokens spread
over every expert, all on one, most experts empty, no rows. Bad input is a ValueError, not a crash.
``tests/kernels/test_kernel_variants.py`` runs this file on every kernel variant the CPU runs.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import load_kernels
from pagedllm.layers.moe_pairs import PairGrouping
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
