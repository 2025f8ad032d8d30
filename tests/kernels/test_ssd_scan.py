"""The Mamba-2 scan ops (``ssd_decode``, ``ssd_prefill``) against a float64 reference of the recurrence.

The reference runs the state-space recurrence one token at a time in
float64, straight from its definition (state = exp(dt A) state + dt x B^T,
y = state C + D x); it is itself checked against transformers' own torch
scan. The kernels run in float32: the recurrent form (one token per
sequence, in place in scattered slots) and the chunked form (whole prompts
in chunks, from a slot's state or from zero), each with groups of heads
sharing B and C, rows read as column slices of wider rows, and the time
step's clamp. Sizes leave vector tails (state_size 20, head_dim 12) so every
code path of a variant runs (tests/kernels/test_kernel_variants.py runs this
file under each variant).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import load_kernels

NUM_HEADS, HEAD_DIM, STATE_SIZE = 4, 12, 20
TOL = dict(rtol=2e-4, atol=2e-4)


@pytest.fixture(scope="module")
def ops():  # noqa: ANN201 (torch's op namespace)
    lib = load_kernels()
    assert lib is not None, "the native kernels must build on the test machine"
    return lib


def reference_scan(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, A: torch.Tensor,  # noqa: N803
                   D: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, dt_min: float = 0.0,  # noqa: N803
                   dt_max: float = math.inf) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 outputs [T, H, P] and final state [H, P, N] of x [T, H, P], dt [T, H], B / C [T, G, N], from state."""
    x, dt, B, C, A, D = (t.double() for t in (x, dt, B, C, A, D))  # noqa: N806
    heads_per_group = x.shape[1] // B.shape[1]
    B, C = B.repeat_interleave(heads_per_group, 1), C.repeat_interleave(heads_per_group, 1)  # noqa: N806
    step = F.softplus(dt + dt_bias.double()).clamp(dt_min, dt_max)
    s = state.double().clone()
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        decay = torch.exp(step[t] * A)  # [H]
        s = s * decay[:, None, None] + (step[t][:, None] * x[t])[:, :, None] * B[t][:, None, :]
        out[t] = torch.einsum("hpn,hn->hp", s, C[t]) + D[:, None] * x[t]
    return out, s


def make_layer(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A (negative), D and dt_bias of NUM_HEADS heads, of Mamba-2's usual ranges."""
    A = -torch.exp(torch.rand(NUM_HEADS, generator=gen) * 2)  # noqa: N806
    D = torch.randn(NUM_HEADS, generator=gen)  # noqa: N806
    dt_bias = torch.randn(NUM_HEADS, generator=gen) * 0.5 - 1.0
    return A, D, dt_bias


def make_tokens(gen: torch.Generator, num_tokens: int, num_groups: int) -> tuple[torch.Tensor, ...]:
    """x, dt, B, C as column slices of one wide row per token (the layer's layout: [x | B | C | dt])."""
    inner, bc = NUM_HEADS * HEAD_DIM, num_groups * STATE_SIZE
    wide = torch.randn(num_tokens, inner + 2 * bc + NUM_HEADS + 3, generator=gen)
    x, B, C = wide[:, :inner], wide[:, inner:inner + bc], wide[:, inner + bc:inner + 2 * bc]  # noqa: N806
    dt = wide[:, inner + 2 * bc:inner + 2 * bc + NUM_HEADS]
    return x, dt, B, C


def shaped(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,  # noqa: N803
           num_groups: int) -> tuple[torch.Tensor, ...]:
    """The reference's shapes of the kernels' rows."""
    t = x.shape[0]
    return (x.reshape(t, NUM_HEADS, HEAD_DIM), dt, B.reshape(t, num_groups, STATE_SIZE),
            C.reshape(t, num_groups, STATE_SIZE))


@pytest.mark.parametrize("num_groups", [1, 2, NUM_HEADS])
def test_decode_steps_scattered_slots_in_place(ops, num_groups: int) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(num_groups)
    A, D, dt_bias = make_layer(gen)  # noqa: N806
    state = torch.randn(7, NUM_HEADS, HEAD_DIM, STATE_SIZE, generator=gen)
    before = state.clone()
    slots = torch.tensor([5, 0, 3])
    x, dt, B, C = make_tokens(gen, 3, num_groups)  # noqa: N806
    out = ops.ssd_decode(x, dt, B, C, A, D, dt_bias, state, slots)
    xs, dts, Bs, Cs = shaped(x, dt, B, C, num_groups)  # noqa: N806
    for i, slot in enumerate(slots.tolist()):
        want, want_state = reference_scan(xs[i:i + 1], dts[i:i + 1], Bs[i:i + 1], Cs[i:i + 1], A, D, dt_bias,
                                          before[slot])
        torch.testing.assert_close(out[i].double(), want.reshape(-1), **TOL)
        torch.testing.assert_close(state[slot].double(), want_state, **TOL)
    untouched = [s for s in range(7) if s not in slots.tolist()]
    assert torch.equal(state[untouched], before[untouched])  # other slots: not a bit changed


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64, 256])
@pytest.mark.parametrize("num_groups", [1, 2])
def test_prefill_of_several_prompts_equals_the_recurrence(ops, chunk_size: int, num_groups: int) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(chunk_size * 10 + num_groups)
    A, D, dt_bias = make_layer(gen)  # noqa: N806
    lens, starts = [1, 17, 70, 0, 33], [True, False, True, True, False]
    state = torch.randn(9, NUM_HEADS, HEAD_DIM, STATE_SIZE, generator=gen)
    before = state.clone()
    slots = torch.tensor([8, 2, 0, 4, 6])
    bounds = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    x, dt, B, C = make_tokens(gen, sum(lens), num_groups)  # noqa: N806
    out = ops.ssd_prefill(x, dt, B, C, A, D, dt_bias, state, slots, bounds, torch.tensor(starts), chunk_size)
    xs, dts, Bs, Cs = shaped(x, dt, B, C, num_groups)  # noqa: N806
    for i, slot in enumerate(slots.tolist()):
        lo, hi = bounds[i].item(), bounds[i + 1].item()
        start = before[slot] if starts[i] else torch.zeros_like(before[slot])
        want, want_state = reference_scan(xs[lo:hi], dts[lo:hi], Bs[lo:hi], Cs[lo:hi], A, D, dt_bias, start)
        torch.testing.assert_close(out[lo:hi].double(), want.reshape(hi - lo, NUM_HEADS * HEAD_DIM), **TOL)
        torch.testing.assert_close(state[slot].double(), want_state, **TOL)
    untouched = [1, 3, 5, 7]
    assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize("num_groups", [1, 4])
def test_chunked_form_equals_the_recurrent_form(ops, num_groups: int) -> None:  # noqa: ANN001
    """A prompt in chunks of 16 gives the outputs and final state of its tokens decoded one by one."""
    gen = torch.Generator().manual_seed(40 + num_groups)
    A, D, dt_bias = make_layer(gen)  # noqa: N806
    x, dt, B, C = make_tokens(gen, 50, num_groups)  # noqa: N806
    chunked = torch.randn(3, NUM_HEADS, HEAD_DIM, STATE_SIZE, generator=gen)
    recurrent = chunked.clone()
    slot = torch.tensor([1])
    out = ops.ssd_prefill(x, dt, B, C, A, D, dt_bias, chunked, slot, torch.tensor([0, 50]),
                          torch.tensor([True]), 16)
    steps = [ops.ssd_decode(x[t:t + 1], dt[t:t + 1], B[t:t + 1], C[t:t + 1], A, D, dt_bias, recurrent, slot)
             for t in range(50)]
    torch.testing.assert_close(out, torch.cat(steps), **TOL)
    torch.testing.assert_close(chunked, recurrent, **TOL)


def test_a_prompt_split_in_two_calls_continues_from_its_slot(ops) -> None:  # noqa: ANN001
    """Chunked prefill of a prompt's second part from the state its first part left equals the whole prompt."""
    gen = torch.Generator().manual_seed(3)
    A, D, dt_bias = make_layer(gen)  # noqa: N806
    x, dt, B, C = make_tokens(gen, 40, 1)  # noqa: N806
    whole, split = torch.zeros(1, NUM_HEADS, HEAD_DIM, STATE_SIZE), torch.zeros(1, NUM_HEADS, HEAD_DIM, STATE_SIZE)
    slot = torch.tensor([0])
    want = ops.ssd_prefill(x, dt, B, C, A, D, dt_bias, whole, slot, torch.tensor([0, 40]), torch.tensor([False]), 64)
    first = ops.ssd_prefill(x[:23], dt[:23], B[:23], C[:23], A, D, dt_bias, split, slot, torch.tensor([0, 23]),
                            torch.tensor([False]), 64)
    second = ops.ssd_prefill(x[23:], dt[23:], B[23:], C[23:], A, D, dt_bias, split, slot, torch.tensor([0, 17]),
                             torch.tensor([True]), 64)
    torch.testing.assert_close(torch.cat([first, second]), want, **TOL)
    torch.testing.assert_close(split, whole, **TOL)


def test_time_step_limits_clamp(ops) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(5)
    A, D, dt_bias = make_layer(gen)  # noqa: N806
    x, dt, B, C = make_tokens(gen, 20, 2)  # noqa: N806
    dt = dt * 4  # time steps on both sides of the limits
    state = torch.zeros(1, NUM_HEADS, HEAD_DIM, STATE_SIZE)
    out = ops.ssd_prefill(x, dt, B, C, A, D, dt_bias, state, torch.tensor([0]), torch.tensor([0, 20]),
                          torch.tensor([False]), 8, 0.05, 0.8)
    want, want_state = reference_scan(*shaped(x, dt, B, C, 2), A, D, dt_bias, torch.zeros_like(state[0]), 0.05, 0.8)
    torch.testing.assert_close(out.double(), want.reshape(20, -1), **TOL)
    torch.testing.assert_close(state[0].double(), want_state, **TOL)
    unclamped = ops.ssd_prefill(x, dt, B, C, A, D, dt_bias, torch.zeros_like(state), torch.tensor([0]),
                                torch.tensor([0, 20]), torch.tensor([False]), 8)
    assert not torch.allclose(unclamped, out)  # the limits did bite


def test_reference_equals_transformers_torch_scan() -> None:
    """The reference (written from the recurrence) agrees with transformers' own chunked torch scan."""
    granite = pytest.importorskip("transformers.models.granitemoehybrid.modeling_granitemoehybrid")
    gen = torch.Generator().manual_seed(11)
    A, D, dt_bias = make_layer(gen)  # noqa: N806
    x, dt, B, C = shaped(*make_tokens(gen, 37, 2), 2)  # noqa: N806
    start = torch.randn(NUM_HEADS, HEAD_DIM, STATE_SIZE, generator=gen)
    want, want_state = reference_scan(x, dt, B, C, A, D, dt_bias, start)
    got, got_state = granite.mamba2_chunk_scan(
        x[None].double(), dt[None].double(), A.double(), B[None].double(), C[None].double(), chunk_size=16,
        D=D.double(), dt_bias=dt_bias.double(), initial_states=start[None].double(), dt_softplus=True,
        return_final_states=True)
    # transformers' scan computes in float32 (``.float()``) even for float64 inputs
    torch.testing.assert_close(got[0].double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state[0].double(), want_state, rtol=1e-5, atol=1e-5)


def _decode_args(num_groups: int = 1) -> dict:
    gen = torch.Generator().manual_seed(0)
    A, D, dt_bias = make_layer(gen)  # noqa: N806
    x, dt, B, C = make_tokens(gen, 2, num_groups)  # noqa: N806
    return dict(x=x, dt=dt, B=B, C=C, A=A, D=D, dt_bias=dt_bias,
                state=torch.zeros(3, NUM_HEADS, HEAD_DIM, STATE_SIZE), slots=torch.tensor([0, 2]))


@pytest.mark.parametrize(("change", "message"), [
    (dict(slots=torch.tensor([1, 1])), "given to two sequences"),
    (dict(slots=torch.tensor([0, 3])), "outside the state's 3 slots"),
    (dict(slots=torch.tensor([0])), "slots must be"),
    (dict(x=torch.zeros(2, NUM_HEADS * HEAD_DIM, dtype=torch.float64)), "x must be a float32"),
    (dict(x=torch.zeros(NUM_HEADS * HEAD_DIM, 2).t()), "rows of contiguous values"),
    (dict(B=torch.zeros(2, 3 * STATE_SIZE), C=torch.zeros(2, 3 * STATE_SIZE)), "do not split into 3 groups"),
    (dict(B=torch.zeros(2, 7)), "not a multiple of state_size"),
    (dict(A=torch.zeros(NUM_HEADS + 1)), "A must be"),
    (dict(state=torch.zeros(3, NUM_HEADS, HEAD_DIM, STATE_SIZE, dtype=torch.float16)), "state must be"),
    (dict(dt=torch.zeros(2, NUM_HEADS + 1)), "dt must be"),
])
def test_bad_decode_inputs_are_value_errors(ops, change: dict, message: str) -> None:  # noqa: ANN001
    args = _decode_args() | change
    with pytest.raises(ValueError, match=message):
        ops.ssd_decode(**args)


@pytest.mark.parametrize(("change", "message"), [
    (dict(bounds=torch.tensor([0, 3, 2])), "must not decrease"),
    (dict(bounds=torch.tensor([0, 1, 3])), "from 0 to the 2 tokens"),
    (dict(has_initial_state=torch.tensor([1, 0])), "has_initial_state must be"),
    (dict(chunk_size=0), "chunk_size must be"),
    (dict(chunk_size=257), "chunk_size must be"),
    (dict(dt_min=0.5, dt_max=0.1), "time step limits"),
])
def test_bad_prefill_inputs_are_value_errors(ops, change: dict, message: str) -> None:  # noqa: ANN001
    args = _decode_args() | dict(bounds=torch.tensor([0, 1, 2]), has_initial_state=torch.tensor([False, True]),
                                 chunk_size=16) | change
    with pytest.raises(ValueError, match=message):
        ops.ssd_prefill(**args)


def test_fake_implementations_give_the_output_shape(ops) -> None:  # noqa: ANN001
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        args = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in _decode_args().items()}
        out = ops.ssd_decode(**args)
        assert out.shape == (2, NUM_HEADS * HEAD_DIM)
        bounds, starts = mode.from_tensor(torch.tensor([0, 1, 2])), mode.from_tensor(torch.tensor([True, False]))
        out = ops.ssd_prefill(**args, bounds=bounds, has_initial_state=starts, chunk_size=8)
        assert out.shape == (2, NUM_HEADS * HEAD_DIM)


@pytest.mark.parametrize("num_groups", [1, 2])
@pytest.mark.parametrize("limits", [(0.0, math.inf), (0.05, 0.8)])
def test_torch_decode_form_equals_the_recurrence(num_groups: int, limits: tuple[float, float]) -> None:
    """``SsdScan.decode`` without the native kernels (the torch form a captured step traces where they are not
    loaded): scattered slots, each row one step of the float64 recurrence from its slot, other slots untouched."""
    from pagedllm.layers.mamba2 import Mamba2Spec, SsdScan

    gen = torch.Generator().manual_seed(17 + num_groups)
    A, D, dt_bias = make_layer(gen)  # noqa: N806
    x, dt, B, C = make_tokens(gen, 3, num_groups)  # noqa: N806
    dt = dt * 4  # time steps on both sides of the limits
    spec = Mamba2Spec(hidden_size=8, num_heads=NUM_HEADS, head_dim=HEAD_DIM, state_size=STATE_SIZE,
                      num_groups=num_groups, conv_kernel=4, intermediate_size=NUM_HEADS * HEAD_DIM,
                      dt_min=limits[0], dt_max=limits[1])
    scan = SsdScan(spec)
    scan.select_impl(None)
    assert scan.native is None
    state = torch.randn(6, NUM_HEADS, HEAD_DIM, STATE_SIZE, generator=gen)
    before = state.clone()
    slots = torch.tensor([4, 1, 2])
    out = scan.decode(x, dt, B, C, A, D, dt_bias, state, slots)
    xs, dts, Bs, Cs = shaped(x, dt, B, C, num_groups)  # noqa: N806
    for i, slot in enumerate(slots.tolist()):
        want, want_state = reference_scan(xs[i:i + 1], dts[i:i + 1], Bs[i:i + 1], Cs[i:i + 1], A, D, dt_bias,
                                          before[slot], *limits)
        torch.testing.assert_close(out[i].double(), want.reshape(-1), **TOL)
        torch.testing.assert_close(state[slot].double(), want_state, **TOL)
    assert torch.equal(state[[0, 3, 5]], before[[0, 3, 5]])
