"""The Mamba-2 mixer (``layers/mamba2.py``) against transformers' ``GraniteMoeHybridMambaLayer``.

transformers' layer runs a whole sequence at once from a zero state (its
torch path on the CPU: the chunked scan); ours runs the same tokens split
over steps (a prompt in two chunks, then single-token decodes), its state
carried in scattered slots between them, several sequences in one step,
with the native kernels and with the torch path. Each output row must be
transformers' row: the state carried across steps is the whole history.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm.kernels import load_kernels
from pagedllm.layers.custom_op import select_impls
from pagedllm.layers.mamba2 import Mamba2Mixer, Mamba2Spec, StateStep
from pagedllm.layers.native_ops import NativeOps

HIDDEN, HEADS, HEAD_DIM, STATE, GROUPS, CONV = 64, 8, 16, 16, 2, 4
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, Mamba2Mixer]:
    """transformers' mixer with random weights, and ours holding the same weights."""
    from transformers import GraniteMoeHybridConfig
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
        GraniteMoeHybridMambaLayer,
    )

    config = GraniteMoeHybridConfig(hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["mamba"],
                                    mamba_n_heads=HEADS, mamba_d_head=HEAD_DIM, mamba_d_state=STATE,
                                    mamba_n_groups=GROUPS, mamba_d_conv=CONV, mamba_expand=2, mamba_chunk_size=16,
                                    rms_norm_eps=1e-6)
    torch.manual_seed(0)
    theirs = GraniteMoeHybridMambaLayer(config, 0).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        theirs.A_log.copy_(torch.rand(HEADS) * 2)
        theirs.dt_bias.copy_(torch.randn(HEADS) * 0.5 - 1)
        theirs.norm.weight.copy_(1 + torch.randn(HIDDEN * 2) * 0.1)
    spec = Mamba2Spec(HIDDEN, HEADS, HEAD_DIM, STATE, GROUPS, CONV, 2 * HIDDEN, chunk_size=16, norm_eps=1e-6)
    ours = Mamba2Mixer(spec)
    state = theirs.state_dict()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(state[name])
    return theirs, ours


def _step(lens: list[int], slots: list[int], fresh: list[bool], num_prefills: int) -> SimpleNamespace:
    """The metadata fields a state layer reads."""
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    return SimpleNamespace(query_start_loc=qsl, seq_lens=lens, num_prefills=num_prefills,
                           state_slots=torch.tensor(slots), has_initial_state=torch.tensor([not f for f in fresh]))


def _states(spec: Mamba2Spec, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    conv_shape, ssm_shape = spec.state_shapes()
    # garbage in the slots: a fresh sequence must not read it
    return torch.randn(num_slots, *conv_shape), torch.randn(num_slots, *ssm_shape)


@pytest.mark.parametrize("native", [False, True])
def test_a_prompt_in_chunks_then_decodes_equals_the_whole_sequence(pair, native: bool) -> None:  # noqa: ANN001
    theirs, ours = pair
    select_impls(ours, NativeOps(load_kernels()) if native else None)
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(1, 25, HIDDEN, generator=gen), torch.randn(1, 12, HIDDEN, generator=gen)
    with torch.no_grad():
        want_a, want_b = theirs(a)[0], theirs(b)[0]
        state = _states(ours.spec, 5)
        # step 1: a's first 10 tokens and b's first 12 (both fresh), slots 3 and 0
        out = ours(torch.cat([a[0, :10], b[0]]), state, _step([10, 12], [3, 0], [True, True], 2))
        torch.testing.assert_close(out, torch.cat([want_a[:10], want_b]), **TOL)
        # step 2: a's next 12 tokens continue from slot 3 (a chunked prompt)
        out = ours(a[0, 10:22], state, _step([12], [3], [False], 1))
        torch.testing.assert_close(out, want_a[10:22], **TOL)
        # steps 3-5: a fresh one-token prompt in slot 4 (prefills come first), then a's decodes
        for t in range(22, 25):
            out = ours(torch.cat([b[0, :1], a[0, t:t + 1]]), state, _step([1, 1], [4, 3], [True, False], 1))
            torch.testing.assert_close(out[:1], want_b[:1], **TOL)
            torch.testing.assert_close(out[1:], want_a[t:t + 1], **TOL)
    select_impls(ours, None)


def test_native_and_torch_paths_leave_the_same_state(pair) -> None:  # noqa: ANN001
    _, ours = pair
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(30, HIDDEN, generator=gen)
    meta = _step([20, 9, 1], [1, 4, 2], [True, True, False], 2)
    results = []
    for ops in (None, NativeOps(load_kernels())):
        select_impls(ours, ops)
        torch.manual_seed(3)
        state = _states(ours.spec, 6)
        with torch.no_grad():
            results.append((ours(x, state, meta), state))
    select_impls(ours, None)
    (out_t, (conv_t, ssm_t)), (out_n, (conv_n, ssm_n)) = results
    torch.testing.assert_close(out_n, out_t, **TOL)
    torch.testing.assert_close(conv_n, conv_t, **TOL)
    torch.testing.assert_close(ssm_n, ssm_t, **TOL)


def test_a_step_without_state_slots_is_refused() -> None:
    meta = SimpleNamespace(query_start_loc=[0, 1], seq_lens=[1], num_prefills=0)
    with pytest.raises(ValueError, match="state_slots"):
        StateStep.from_metadata(meta)


def test_bad_shapes_are_value_errors() -> None:
    with pytest.raises(ValueError, match="do not split into 3 groups"):
        Mamba2Spec(HIDDEN, HEADS, HEAD_DIM, STATE, 3, CONV, 2 * HIDDEN)
    with pytest.raises(ValueError, match="intermediate size"):
        Mamba2Spec(HIDDEN, HEADS, HEAD_DIM, STATE, GROUPS, CONV, 100)
