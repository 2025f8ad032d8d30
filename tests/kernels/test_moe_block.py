"""The mixture-of-experts block (``layers/fused_moe.py``) and its grouped product (``layers/experts_linear.py``).

- Our router against transformers' own Qwen3-MoE and GraniteMoE routers, bit
  for bit, ties included (``torch.topk``'s order).
- Each router kind against a per-token reference written here from the
  routers' definitions (transformers' Qwen3-MoE / OLMoE, GraniteMoE /
  gpt-oss, DeepSeek-V3's corrected sigmoid): softmax then top-k with and
  without renormalisation, top-k then softmax, sigmoid with a correction
  bias and a scaling factor, a router bias, a shared expert with its gate.
- ``experts_linear`` over every weight format the experts are held in
  (float32 and bf16 panels, the plain float weight, int8 / int4 groups in
  either order, GGUF blocks on float and on 8-bit activations, interleaved
  x16 tiles) equals, bit for bit, the dense layer of each expert alone on
  that expert's rows: tokens spread over all experts, all on one, none on
  some; and every row is the same bits alone and in a batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from test_gguf_quantized import random_blocks

from pagedllm.kernels import load_kernels
from pagedllm.layers.custom_op import select_impls
from pagedllm.layers.experts_linear import experts_linear
from pagedllm.layers.fused_moe import (
    MoEBlock,
    MoESpec,
    moe_fused_projections,
    stacked_experts_layer,
)
from pagedllm.layers.linear import Linear, LinearMethod, UnquantizedLinearMethod
from pagedllm.layers.native_ops import NativeOps
from pagedllm.layers.quantization.gguf_linear import GGUFLinearMethod
from pagedllm.layers.quantization.packed_linear import PackedBF16LinearMethod, PackedLinearMethod
from pagedllm.layers.quantization.quant_config import QuantConfig, process_weights_after_loading
from pagedllm.layers.quantization.quantized_linear import QuantizedLinearMethod
from pagedllm.layers.router import Router, RouterSpec

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="the kernels need the native build")

HIDDEN, INTER, EXPERTS = 64, 32, 6
Q = GGMLQuantizationType


def _block(spec: MoESpec, seed: int, quant_config: QuantConfig | None = None) -> tuple[MoEBlock, dict]:
    """A block of ``spec`` with random float weights loaded as a checkpoint loads them (per-expert tensors through
    the fused map), and those tensors by Hugging Face name."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        block = MoEBlock(spec, HIDDEN, None, quant_config, "mlp")
    block = block.to_empty(device="cpu")
    tensors = {"gate.weight": torch.randn(EXPERTS, HIDDEN, generator=gen)}
    if spec.router.bias:
        tensors["gate.bias"] = torch.randn(EXPERTS, generator=gen)
    if spec.router.correction_bias:
        tensors["gate.e_score_correction_bias"] = torch.rand(EXPERTS, generator=gen) * 0.5
    for e in range(EXPERTS):
        for part, shape in (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN)), ("down_proj", (HIDDEN, INTER))):
            tensors[f"experts.{e}.{part}.weight"] = torch.randn(*shape, generator=gen) / shape[1] ** 0.5
    shared = spec.shared_expert_intermediate_size
    if shared:
        for part, shape in (("gate_proj", (shared, HIDDEN)), ("up_proj", (shared, HIDDEN)), ("down_proj", (HIDDEN, shared))):
            tensors[f"shared_expert.{part}.weight"] = torch.randn(*shape, generator=gen) / shape[1] ** 0.5
    if spec.shared_expert_gate:
        tensors["shared_expert_gate.weight"] = torch.randn(1, HIDDEN, generator=gen)
    fused = moe_fused_projections(EXPERTS, INTER, HIDDEN, shared)
    modules = dict(block.named_modules())
    for name, tensor in tensors.items():
        part = max((p for p in fused if name.startswith(f"{p}.")), key=len, default=None)
        target, offset, rows = (name.replace(part, fused[part][0]), *fused[part][1:3]) if part else (name, 0, None)
        owner, _, param = target.rpartition(".")
        module = modules[owner]
        method = getattr(module, "quant_method", None)
        if method is None:
            getattr(module, param).data.copy_(tensor)
        else:
            method.weight_loader(module, param, tensor, offset, rows)
    process_weights_after_loading(block)
    return block, tensors


def _reference(spec: MoESpec, t: dict, x: torch.Tensor) -> torch.Tensor:
    """Each token on its own, in float64, from the routers' definitions."""
    r = spec.router
    out = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float64)
    for i, row in enumerate(x.double()):
        logits = t["gate.weight"].double() @ row + (t["gate.bias"].double() if r.bias else 0)
        if r.scoring == "sigmoid":
            scores = torch.sigmoid(logits)
            choice = scores + (t["gate.e_score_correction_bias"].double() if r.correction_bias else 0)
            chosen = sorted(range(EXPERTS), key=lambda e: -float(choice[e]))[: r.top_k]
            weights = [float(scores[e]) for e in chosen]
        elif r.order == "topk_softmax":
            chosen = sorted(range(EXPERTS), key=lambda e: -float(logits[e]))[: r.top_k]
            top = torch.tensor([float(logits[e]) for e in chosen], dtype=torch.float64)
            weights = (top.exp() / top.exp().sum()).tolist()
        else:
            probs = logits.exp() / logits.exp().sum()
            chosen = sorted(range(EXPERTS), key=lambda e: -float(probs[e]))[: r.top_k]
            weights = [float(probs[e]) for e in chosen]
        if r.renormalize:
            weights = [w / sum(weights) for w in weights]
        for e, w in zip(chosen, weights):
            g = t[f"experts.{e}.gate_proj.weight"].double() @ row
            u = t[f"experts.{e}.up_proj.weight"].double() @ row
            out[i] += w * r.routed_scaling_factor * (t[f"experts.{e}.down_proj.weight"].double() @ (F.silu(g) * u))
        if spec.shared_expert_intermediate_size:
            g = t["shared_expert.gate_proj.weight"].double() @ row
            u = t["shared_expert.up_proj.weight"].double() @ row
            shared = t["shared_expert.down_proj.weight"].double() @ (F.silu(g) * u)
            if spec.shared_expert_gate:
                shared = torch.sigmoid(t["shared_expert_gate.weight"].double() @ row) * shared
            out[i] += shared
    return out


ROUTERS = {
    "softmax-topk": MoESpec(RouterSpec(EXPERTS, 2), INTER),
    "softmax-topk-renormalised": MoESpec(RouterSpec(EXPERTS, 3, renormalize=True), INTER),
    "topk-softmax-router-bias": MoESpec(RouterSpec(EXPERTS, 2, order="topk_softmax", bias=True), INTER),
    "sigmoid-corrected-scaled": MoESpec(RouterSpec(EXPERTS, 2, scoring="sigmoid", correction_bias=True,
                                                   renormalize=True, routed_scaling_factor=2.5), INTER),
    "shared-expert-gated": MoESpec(RouterSpec(EXPERTS, 2, renormalize=True), INTER,
                                   shared_expert_intermediate_size=48, shared_expert_gate=True),
}


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("kind", list(ROUTERS))
def test_block_equals_a_per_token_reference(kind: str, native: bool) -> None:
    """The block (torch or native activation, float32 weights) against the per-token float64 reference."""
    spec = ROUTERS[kind]
    block, tensors = _block(spec, seed=len(kind))
    select_impls(block, NativeOps(load_kernels()) if native else None)
    x = torch.randn(19, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = block(x)
    torch.testing.assert_close(got.double(), _reference(spec, tensors, x), rtol=1e-5, atol=1e-5)


def test_router_specs_refuse_what_no_router_computes() -> None:
    for bad in (dict(top_k=0), dict(top_k=EXPERTS + 1), dict(scoring="relu"), dict(order="both"),
                dict(scoring="sigmoid", order="topk_softmax"), dict(correction_bias=True),
                dict(routed_scaling_factor=0.0)):
        with pytest.raises(ValueError):
            RouterSpec(**{"num_experts": EXPERTS, "top_k": 2, **bad})
    with pytest.raises(ValueError, match="shared expert"):
        MoESpec(RouterSpec(EXPERTS, 2), INTER, shared_expert_gate=True)


# (token -> its experts) patterns: spread over all experts, all on one expert, none on some
PATTERNS = {
    "all-experts": lambda t: [t % EXPERTS, (t + 1) % EXPERTS],
    "one-expert": lambda t: [3, 3],
    "some-none": lambda t: [[0, 5], [5, 2], [2, 0]][t % 3],
}


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_the_routed_sum_of_any_spread_equals_the_reference(pattern: str) -> None:
    """Pairs spread over all experts, all on one expert, none on some: the block's weighted sum over the chosen
    experts equals the per-token reference for the same choices and weights."""
    spec = MoESpec(RouterSpec(EXPERTS, 2), INTER)
    block, t = _block(spec, seed=3)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([PATTERNS[pattern](i) for i in range(9)])
    weights = torch.rand(9, 2, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = block.routed(x, weights, ids)
    want = torch.zeros(9, HIDDEN, dtype=torch.float64)
    for i in range(9):
        for slot in range(2):
            e = int(ids[i, slot])
            h = F.silu(t[f"experts.{e}.gate_proj.weight"].double() @ x[i].double()) * (
                t[f"experts.{e}.up_proj.weight"].double() @ x[i].double())
            want[i] += float(weights[i, slot]) * (t[f"experts.{e}.down_proj.weight"].double() @ h)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


# --- experts_linear over every weight format ---------------------------------------------------------------------

def _held(method: LinearMethod, weight: torch.Tensor, in_features: int) -> Linear:
    """A ``Linear`` of ``method`` loaded with ``weight`` (float ``[out, in]`` or GGUF bytes ``[out, row bytes]``)."""
    with torch.device("meta"):
        layer = Linear(in_features, weight.shape[0], bias=False)
    layer.quant_method = method
    method.create_weights(layer)
    layer = layer.to_empty(device="cpu")
    method.weight_loader(layer, "weight", weight, 0, None)
    method.process_weights_after_loading(layer)
    return layer


def _experts(config: QuantConfig, weights: list[torch.Tensor], in_features: int) -> Linear:
    """The experts' stacked ``down`` layer the block builds for ``config``, loaded expert by expert."""
    rows = weights[0].shape[0]
    with torch.device("meta"):
        layer = stacked_experts_layer(in_features, rows, len(weights), False, config, "mlp.experts.down")
    layer = layer.to_empty(device="cpu")
    for e, w in enumerate(weights):
        layer.quant_method.weight_loader(layer, "weight", w, e * rows, rows)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _gguf_config(ggml_type: int, num_experts: int, rows: int, interleave: bool) -> QuantConfig:
    names = {f"mlp.experts.{e}.down_proj.weight": int(ggml_type) for e in range(num_experts)}
    return QuantConfig(gguf_types=names, fused=moe_fused_projections(num_experts, 256, rows), interleave=interleave)


# (name, config of the stacked layer, the dense method of one expert alone, GGUF type or None for float weights)
FORMATS = [
    ("float32-panels", lambda n, r: QuantConfig(float_method=PackedLinearMethod()), PackedLinearMethod, None),
    ("bf16-panels", lambda n, r: QuantConfig(float_method=PackedBF16LinearMethod()), PackedBF16LinearMethod, None),
    ("torch-float32", lambda n, r: QuantConfig(), UnquantizedLinearMethod, None),
    ("int8-x16", lambda n, r: QuantConfig(weight_only_bits=8, group_size=64, interleave=True),
     lambda: QuantizedLinearMethod(8, 64, True), None),
    ("int4", lambda n, r: QuantConfig(weight_only_bits=4, group_size=128), lambda: QuantizedLinearMethod(4, 128), None),
    ("gguf-q4_0-x16", lambda n, r: _gguf_config(Q.Q4_0, n, r, True), lambda: GGUFLinearMethod(Q.Q4_0, True), Q.Q4_0),
    ("gguf-q8_0-float", lambda n, r: _gguf_config(Q.Q8_0, n, r, False), lambda: GGUFLinearMethod(Q.Q8_0), Q.Q8_0),
    ("gguf-q4_k-x16", lambda n, r: _gguf_config(Q.Q4_K, n, r, True), lambda: GGUFLinearMethod(Q.Q4_K, True), Q.Q4_K),
    ("gguf-f16", lambda n, r: _gguf_config(Q.F16, n, r, False), lambda: GGUFLinearMethod(Q.F16), Q.F16),
]


@pytest.mark.parametrize("rows", [32, 24])  # 24: experts starting inside a tile of 16 (kept in file order)
@pytest.mark.parametrize(("name", "config", "dense", "ggml_type"), FORMATS, ids=[f[0] for f in FORMATS])
@torch.no_grad()
def test_experts_linear_is_each_experts_dense_layer_bit_for_bit(name: str, config, dense, ggml_type,  # noqa: ANN001
                                                                rows: int) -> None:
    """Each expert's pairs are the dense kernel's rows for that expert alone, for every spread of tokens; with
    the native kernels every pair's row is also the bits it has alone (batch invariance)."""
    num_experts, in_features = 5, 256
    if ggml_type is None:
        gen = torch.Generator().manual_seed(rows)
        weights = [torch.randn(rows, in_features, generator=gen) for _ in range(num_experts)]
    else:
        weights = [torch.from_numpy(random_blocks(ggml_type, rows, in_features, seed=e)) for e in range(num_experts)]
    stacked = _experts(config(num_experts, rows), weights, in_features)
    alone = [_held(dense(), w, in_features) for w in weights]
    x = torch.randn(11, in_features, generator=torch.Generator().manual_seed(5))
    for pattern in ([t % num_experts for t in range(11)] * 2, [2] * 22, [t % 2 * 3 for t in range(22)]):
        ids = torch.tensor(pattern)  # pair p reads token p % 11
        order = torch.argsort(ids, stable=True)
        token_ids = (order % 11).to(torch.int32)
        offsets = torch.zeros(num_experts + 1, dtype=torch.int32)
        offsets[1:] = torch.cumsum(torch.bincount(ids, minlength=num_experts), 0)
        got = experts_linear(stacked, x, token_ids, offsets, num_experts)
        for e in range(num_experts):  # each expert's pairs: the dense layer of that expert on their rows
            start, end = int(offsets[e]), int(offsets[e + 1])
            assert torch.equal(got[start:end], alone[e](x[token_ids[start:end].long()])), (name, e)
        if name == "torch-float32":
            continue  # F.linear (MKL) sums a row by the batch's shape: no batch invariance, as for dense layers
        for p, pair in enumerate(order.tolist()):  # and each row the bits it has alone
            assert torch.equal(got[p : p + 1], alone[pattern[pair]](x[pair % 11 : pair % 11 + 1])), (name, p)
    # one token alone: its pair's row is the dense layer's for that token alone
    for t in (0, 6):
        single = torch.tensor([t % num_experts], dtype=torch.int32)
        offsets = torch.zeros(num_experts + 1, dtype=torch.int32)
        offsets[t % num_experts + 1 :] = 1
        got = experts_linear(stacked, x[t : t + 1], torch.zeros(1, dtype=torch.int32), offsets, num_experts)
        assert torch.equal(got, alone[int(single)](x[t : t + 1]))


def test_a_row_of_the_block_is_the_same_bits_alone_and_in_any_batch() -> None:
    """The whole block (native activation, float32 panels and int8 x16 groups): each row alone equals its row in
    batches of 2..13 rows, whatever the other rows route to."""
    spec = MoESpec(RouterSpec(EXPERTS, 2, renormalize=True), INTER)
    for config in (QuantConfig(float_method=PackedLinearMethod()),
                   QuantConfig(weight_only_bits=8, group_size=32, interleave=True)):
        block, _ = _block(spec, seed=11, quant_config=config)
        select_impls(block, NativeOps(load_kernels()))
        x = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(4)) * 2
        with torch.no_grad():
            alone = torch.cat([block(x[r : r + 1]) for r in range(13)])
            for m in range(2, 14):
                assert torch.equal(block(x[:m]), alone[:m]), m


def test_stacked_experts_refuse_what_they_cannot_multiply() -> None:
    layer = _held(UnquantizedLinearMethod(), torch.randn(12, 8), 8)
    x, ids = torch.randn(2, 8), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="not 5 experts"):
        experts_linear(layer, x, ids, torch.tensor([0, 2, 2, 2, 2, 2], dtype=torch.int32), 5)
    with pytest.raises(ValueError, match="4 entries"):
        experts_linear(layer, x, ids, torch.tensor([0, 2], dtype=torch.int32), 3)
    with pytest.raises(ValueError, match="run from 0"):
        experts_linear(layer, x, ids, torch.tensor([0, 1, 1, 1], dtype=torch.int32), 3)
    assert np.all(np.isfinite(x.numpy()))


@pytest.mark.parametrize("family", ["qwen3_moe", "granitemoe"])
def test_routers_choose_and_weigh_as_transformers_even_on_ties(family: str) -> None:
    """Our router against transformers' own (``Qwen3MoeTopKRouter``: softmax, top-k, renormalised;
    ``GraniteMoeTopKRouter``: top-k of the logits, softmax): the same experts in the same slot order and the same
    float32 weights, bit for bit, with experts whose gate rows are equal (exact ties) among them."""
    from transformers import GraniteMoeConfig, Qwen3MoeConfig
    from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(EXPERTS, HIDDEN, generator=gen)
    weight[4] = weight[1]  # experts 1 and 4 always tie, and 2 and 5
    weight[5] = weight[2]
    if family == "qwen3_moe":
        hf = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=3,
                                               norm_topk_prob=True))
        spec = RouterSpec(EXPERTS, 3, renormalize=True)
    else:
        hf = GraniteMoeTopKRouter(GraniteMoeConfig(hidden_size=HIDDEN, num_local_experts=EXPERTS,
                                                   num_experts_per_tok=3))
        spec = RouterSpec(EXPERTS, 3, order="topk_softmax")
    with torch.no_grad():
        hf.weight.copy_(weight)
    with torch.device("meta"):
        router = Router(spec, HIDDEN)
    router = router.to_empty(device="cpu")
    with torch.no_grad():
        router.weight.copy_(weight)
    x = torch.randn(40, HIDDEN, generator=gen)
    with torch.no_grad():
        _, want_weights, want_ids = hf(x)
        got_weights, got_ids = router.route(x)
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_weights, want_weights)
    assert any(len(set(row.tolist()) & {1, 4}) == 2 or len(set(row.tolist()) & {2, 5}) == 2 for row in got_ids)
