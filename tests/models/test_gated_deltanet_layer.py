"""The Gated DeltaNet layer against transformers' own modules (Qwen3-Next's and Qwen3.5's ``linear_attn``).

transformers runs the layer over a whole prompt with no cache (its torch
chunked rule, its conv); ours runs the same prompt whole, in prompt chunks
that continue their sequence's conv and recurrent states, and then one token
at a time through the decode kernel, from scattered state slots, natively
and in torch ops: every way must give transformers' outputs. Qwen3-Next's
interleaved ``in_proj_qkvz`` / ``in_proj_ba`` load through
``split_qwen3_next_projections``; Qwen3.5's separate projections directly.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm.kernels import load_kernels
from pagedllm.layers.gated_deltanet import (
    GatedDeltaNet,
    GatedDeltaNetSpec,
    split_qwen3_next_projections,
)
from pagedllm.layers.native_ops import NativeOps
from pagedllm.layers.weights import load_hf_weights

transformers = pytest.importorskip("transformers")

HIDDEN, NK, NV, DK, DV, KERNEL, PROMPT = 64, 2, 4, 16, 16, 4, 23
NUM_SLOTS = 5


def _hf_layer(family: str) -> torch.nn.Module:
    common = dict(hidden_size=HIDDEN, linear_num_key_heads=NK, linear_num_value_heads=NV, linear_key_head_dim=DK,
                  linear_value_head_dim=DV, linear_conv_kernel_dim=KERNEL, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, intermediate_size=64, vocab_size=64)
    torch.manual_seed(0)
    if family == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import (
            Qwen3NextConfig,
            Qwen3NextGatedDeltaNet,
        )

        layer = Qwen3NextGatedDeltaNet(Qwen3NextConfig(**common, num_experts=0), layer_idx=0)
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import (
            Qwen3_5GatedDeltaNet,
            Qwen3_5TextConfig,
        )

        layer = Qwen3_5GatedDeltaNet(Qwen3_5TextConfig(**common), layer_idx=0)
    with torch.no_grad():  # weights away from their init values: every parameter matters
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        layer.norm.weight.add_(1.0)
    return layer.eval()


def _ours(hf: torch.nn.Module, family: str, native: bool) -> GatedDeltaNet:
    spec = GatedDeltaNetSpec(HIDDEN, NK, NV, DK, DV, KERNEL, hf.layer_norm_epsilon, chunk_size=8)
    layer = GatedDeltaNet(spec, prefix="linear_attn")
    weights = ((f"linear_attn.{name}", t.detach()) for name, t in hf.state_dict().items())
    if family == "qwen3_next":
        weights = split_qwen3_next_projections(weights, spec)
    holder = torch.nn.Module()
    holder.linear_attn = layer
    load_hf_weights(holder, weights, GatedDeltaNet.fused_map(spec), False)
    layer.select_impl(NativeOps() if native else None)
    return layer


def _meta(lens: list[int], slots: list[int], initial: list[bool], num_prefills: int) -> SimpleNamespace:
    loc = [0]
    for n in lens:
        loc.append(loc[-1] + n)
    return SimpleNamespace(query_start_loc=loc, num_prefills=num_prefills, state_slots=torch.tensor(slots),
                           has_initial_state=torch.tensor(initial))


def _states(layer: GatedDeltaNet) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.zeros(NUM_SLOTS, *shape) for shape in layer.state_shapes())


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("native", [True, False])
def test_whole_chunked_and_decoded_prompts_give_transformers_outputs(family: str, native: bool) -> None:
    if native and load_kernels() is None:
        pytest.skip("native kernels unavailable")
    hf = _hf_layer(family)
    x = torch.randn(1, PROMPT, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x)[0]  # [PROMPT, HIDDEN]
    layer = _ours(hf, family, native)
    states = _states(layer)
    with torch.no_grad():
        whole = layer(x[0], states, _meta([PROMPT], [3], [False], 1))
        torch.testing.assert_close(whole, want, atol=2e-5, rtol=1e-4)
        # another sequence in slot 1: 10 prompt tokens, 6 more continuing them, then one token per step,
        # batched after a 7-token prompt in slot 0 and beside a fresh one-token prompt in slot 4, which the
        # runner counts among the decodes (num_prefills: sequences of more than one new token) and whose
        # slot holds an earlier sequence's states
        parts = [layer(x[0, :10], states, _meta([10], [1], [False], 1)),
                 layer(x[0, 10:16], states, _meta([6], [1], [True], 1))]
        for t in range(16, PROMPT):
            for state in states:
                state[4].normal_()
            step = torch.cat([x[0, :7], x[0, t : t + 1], x[0, :1]])
            out = layer(step, states, _meta([7, 1, 1], [0, 1, 4], [False, True, False], 1))
            torch.testing.assert_close(out[:7], want[:7], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(out[8:], want[:1], atol=2e-5, rtol=1e-4)
            parts.append(out[7:8])
    torch.testing.assert_close(torch.cat(parts), want, atol=2e-5, rtol=1e-4)


def test_qwen3_next_projections_split_by_key_head() -> None:
    """Row r of Qwen3-Next's interleaved projection lands where Qwen3.5's separate ones hold it."""
    spec = GatedDeltaNetSpec(HIDDEN, NK, NV, DK, DV, KERNEL, 1e-6)
    group = NV // NK
    per_head = 2 * DK + 2 * group * DV
    qkvz = torch.arange(NK * per_head, dtype=torch.float32)[:, None].expand(-1, 3)
    ba = torch.arange(2 * NV, dtype=torch.float32)[:, None].expand(-1, 3)
    out = dict(split_qwen3_next_projections([("m.in_proj_qkvz.weight", qkvz), ("m.in_proj_ba.weight", ba)], spec))
    qkv, z = out["m.in_proj_qkv.weight"][:, 0], out["m.in_proj_z.weight"][:, 0]
    # key head 1's q rows come right after key head 0's; v of value head 2 is key head 1's first value head
    assert qkv[DK].item() == per_head
    assert qkv[NK * DK].item() == DK  # the first k row: key head 0's, after its q rows
    assert qkv[2 * NK * DK + 2 * DV].item() == per_head + 2 * DK
    assert z[0].item() == 2 * DK + group * DV
    assert out["m.in_proj_b.weight"][:, 0].tolist() == [0, 1, 4, 5]
    assert out["m.in_proj_a.weight"][:, 0].tolist() == [2, 3, 6, 7]
