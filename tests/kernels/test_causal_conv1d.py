"""``torch.ops.pagedllm.causal_conv1d`` (and its torch twin) against a float64 reference of the recurrence.

The reference slides each sequence's window token by token in float64,
starting from its slot or from zeros, the definition in
``layers/causal_conv1d.py``, and is written independently of both
implementations. Slots are scattered (not 0..n-1, not in order), widths 1..4,
dims below, at and past the kernel's 8-wide vectors and 64-channel blocks.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import load_kernels
from pagedllm.layers.causal_conv1d import causal_conv1d_torch


@pytest.fixture(scope="module")
def ops():  # noqa: ANN201
    lib = load_kernels()
    assert lib is not None, "the native kernels must build on the test machine"
    return lib


def _reference(x, weight, bias, states, loc, slots, initial, activation):  # noqa: ANN001, ANN202
    """float64: (outputs [num_tokens, dim], the slots' states afterwards {slot: [width - 1, dim]})."""
    dim, width = weight.shape
    w = weight.double()
    out = torch.zeros(x.shape[0], dim, dtype=torch.float64)
    after = {}
    for i, slot in enumerate(slots):
        hist = [states[slot, j].double() if initial[i] else torch.zeros(dim, dtype=torch.float64)
                for j in range(width - 1)]
        for t in range(loc[i], loc[i + 1]):
            taps = [*hist, x[t].double()]
            acc = bias.double().clone() if bias is not None else torch.zeros(dim, dtype=torch.float64)
            for k in range(width):
                acc += w[:, k] * taps[k]
            out[t] = acc * torch.sigmoid(acc) if activation == "silu" else acc
            hist = taps[1:]
        after[slot] = torch.stack(hist) if hist else torch.zeros(0, dim, dtype=torch.float64)
    return out, after


def _case(dim: int, width: int, lens: list[int], seed: int):  # noqa: ANN202
    gen = torch.Generator().manual_seed(seed)
    num_slots = 2 * len(lens) + 3
    x = torch.randn(sum(lens), dim, generator=gen)
    weight = torch.randn(dim, width, generator=gen)
    bias = torch.randn(dim, generator=gen)
    states = torch.randn(num_slots, width - 1, dim, generator=gen)
    slots = [num_slots - 1 - 2 * i for i in range(len(lens))]  # scattered, descending
    initial = [i % 2 == 1 for i in range(len(lens))]  # some start from zero, some from their slot
    loc = [0]
    for n in lens:
        loc.append(loc[-1] + n)
    return x, weight, bias, states, loc, slots, initial


def _run(fn, x, weight, bias, states, loc, slots, initial, activation):  # noqa: ANN001, ANN202
    return fn(x, weight, bias, states, torch.tensor(loc), torch.tensor(slots), torch.tensor(initial), activation)


@pytest.mark.parametrize("dim", [5, 8, 64, 77, 130])
@pytest.mark.parametrize("width", [1, 2, 3, 4])
@pytest.mark.parametrize("activation", ["none", "silu"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_native_conv_matches_the_float64_recurrence(
    ops, dim: int, width: int, activation: str, with_bias: bool  # noqa: ANN001
) -> None:
    lens = [7, 1, 0, 3, 1]  # prompts, decodes and a sequence with no new token
    x, weight, bias, states, loc, slots, initial = _case(dim, width, lens, dim * 10 + width)
    bias = bias if with_bias else None
    want, after = _reference(x, weight, bias, states, loc, slots, initial, activation)
    untouched = [s for s in range(states.shape[0]) if s not in slots]
    before = states.clone()
    got = _run(ops.causal_conv1d, x, weight, bias, states, loc, slots, initial, activation)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    for slot, state in after.items():
        torch.testing.assert_close(states[slot].double(), state, rtol=0, atol=0)  # copies of inputs: exact
    assert torch.equal(states[untouched], before[untouched])


@pytest.mark.parametrize("width", [1, 4])
def test_torch_twin_matches_the_float64_recurrence(width: int) -> None:
    x, weight, bias, states, loc, slots, initial = _case(70, width, [5, 1, 2], 3)
    want, after = _reference(x, weight, bias, states, loc, slots, initial, "silu")
    got = causal_conv1d_torch(x, weight, bias, states, loc, torch.tensor(slots), torch.tensor(initial), "silu")
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    for slot, state in after.items():
        torch.testing.assert_close(states[slot].double(), state, rtol=0, atol=0)


def test_chunks_continue_the_state_exactly(ops) -> None:  # noqa: ANN001
    """A prompt in chunks of 1, 3 and the rest gives the whole prompt's outputs and final state."""
    x, weight, bias, states, _, _, _ = _case(96, 4, [20], 11)
    whole_states = states.clone()
    whole = _run(ops.causal_conv1d, x, weight, bias, whole_states, [0, 20], [2], [False], "silu")
    parts = []
    for start, stop in [(0, 1), (1, 4), (4, 20)]:
        parts.append(_run(ops.causal_conv1d, x[start:stop].contiguous(), weight, bias, states, [0, stop - start],
                          [2], [start > 0], "silu"))
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-6, atol=1e-6)
    assert torch.equal(states[2], whole_states[2])


def test_big_steps_split_over_threads_match(ops) -> None:  # noqa: ANN001
    x, weight, bias, states, loc, slots, initial = _case(512, 4, [300, 200, 1, 1], 5)
    want, _ = _reference(x, weight, bias, states, loc, slots, initial, "none")
    got = _run(ops.causal_conv1d, x, weight, bias, states, loc, slots, initial, "none")
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_bad_inputs_are_value_errors(ops) -> None:  # noqa: ANN001
    x, weight, bias, states, loc, slots, initial = _case(16, 3, [2, 1], 1)
    ok = (x, weight, bias, states, torch.tensor(loc), torch.tensor(slots), torch.tensor(initial), "silu")
    bad = {
        "slot outside": (x, weight, bias, states, torch.tensor(loc), torch.tensor([0, 99]), torch.tensor(initial)),
        "slot twice": (x, weight, bias, states, torch.tensor(loc), torch.tensor([1, 1]), torch.tensor(initial)),
        "loc short": (x, weight, bias, states, torch.tensor([0, 2, 2]), torch.tensor(slots), torch.tensor(initial)),
        "loc falls": (x, weight, bias, states, torch.tensor([0, 3, 2]), torch.tensor(slots), torch.tensor(initial)),
        "state width": (x, weight, bias, states[:, :1].contiguous(), torch.tensor(loc), torch.tensor(slots),
                        torch.tensor(initial)),
        "float64 x": (x.double(), weight, bias, states, torch.tensor(loc), torch.tensor(slots), torch.tensor(initial)),
        "bias size": (x, weight, bias[:3], states, torch.tensor(loc), torch.tensor(slots), torch.tensor(initial)),
        "width 9": (x, torch.randn(16, 9), bias, torch.randn(9, 8, 16), torch.tensor(loc), torch.tensor(slots),
                    torch.tensor(initial)),
        "initial int": (x, weight, bias, states, torch.tensor(loc), torch.tensor(slots), torch.tensor([0, 1])),
    }
    for name, args in bad.items():
        with pytest.raises(ValueError):
            ops.causal_conv1d(*args, "silu")
        assert name
    with pytest.raises(ValueError, match="activation"):
        ops.causal_conv1d(*ok[:-1], "relu")
    ops.causal_conv1d(*ok)  # the good call runs


def test_fake_implementation_gives_the_output_shape(ops) -> None:  # noqa: ANN001
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pagedllm.kernels.meta import register_fakes

    register_fakes()
    x, weight, bias, states, loc, slots, initial = _case(16, 3, [2, 1], 1)
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(t) for t in (x, weight, bias, states, torch.tensor(loc), torch.tensor(slots),
                                              torch.tensor(initial))]
        out = ops.causal_conv1d(*args, "none")
    assert out.shape == x.shape and out.dtype == x.dtype


@pytest.mark.parametrize(("dim", "width"), [(7, 2), (64, 3), (136, 4)])
def test_decode_form_matches_the_recurrence_and_the_general_op_bit_for_bit(ops, dim: int, width: int) -> None:  # noqa: ANN001
    """``causal_conv1d_decode`` (one token per sequence, x rows strided, slots scattered): the float64
    recurrence's outputs and states, and exactly what ``causal_conv1d`` computes for the same decode rows."""
    from pagedllm.layers.causal_conv1d import causal_conv1d_decode

    x, weight, bias, states, loc, slots, _ = _case(dim, width, [1, 1, 1, 1], 3)
    wide = torch.randn(4, dim + 5)  # x as a column slice of wider rows
    wide[:, 2 : 2 + dim] = x
    strided = wide[:, 2 : 2 + dim]
    for activation in ("none", "silu"):
        want, after = _reference(x, weight, bias, states, loc, slots, [True] * 4, activation)
        mine, general = states.clone(), states.clone()
        slot_t = torch.tensor(slots)
        got = causal_conv1d_decode(strided, weight, bias, mine, slot_t, activation)
        eager = ops.causal_conv1d(x, weight, bias, general, torch.tensor(loc), slot_t, torch.ones(4, dtype=torch.bool),
                                  activation)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got, eager) and torch.equal(mine, general)
        for slot, state in after.items():
            torch.testing.assert_close(mine[slot].double(), state, rtol=1e-6, atol=1e-6)
        # the torch form (a machine without the kernels) reads the step as tensors too
        twin = states.clone()
        torch.testing.assert_close(causal_conv1d_decode(strided, weight, bias, twin, slot_t, activation, native=False),
                                   got, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(twin, mine, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="given twice"):
        causal_conv1d_decode(x, weight, bias, states.clone(), torch.tensor([1, 3, 1, 5]), "none")


def _decode_case() -> dict:
    gen = torch.Generator().manual_seed(3)
    return dict(x=torch.randn(3, 8, generator=gen), weight=torch.randn(8, 4, generator=gen),
                bias=torch.randn(8, generator=gen), conv_state=torch.randn(5, 3, 8, generator=gen),
                state_slots=torch.tensor([4, 0, 2]), silu=True)


@pytest.mark.parametrize(("change", "message"), [
    (dict(state_slots=torch.tensor([4, -1, 2])), "outside the 5 slots"),
    (dict(state_slots=torch.tensor([4, 5, 2])), "outside the 5 slots"),
    (dict(state_slots=torch.tensor([4, 0, 4])), "given twice"),
    (dict(state_slots=torch.tensor([4, 0])), "state_slots"),
    (dict(state_slots=torch.tensor([4.0, 0.0, 2.0])), "state_slots"),
    (dict(x=torch.zeros(3, 8, dtype=torch.float64)), "x must be float32 rows"),
    (dict(x=torch.zeros(8, 3).t()), "x must be float32 rows"),
    (dict(weight=torch.zeros(8, 9)), "weight must be"),
    (dict(conv_state=torch.zeros(5, 2, 8)), "conv_state must be"),
    (dict(conv_state=torch.zeros(5, 3, 8, dtype=torch.float16)), "conv_state"),
    (dict(conv_state=torch.zeros(5, 8, 3).transpose(1, 2)), "conv_state"),
    (dict(bias=torch.zeros(7)), "bias"),
])
def test_bad_decode_inputs_are_value_errors(ops, change: dict, message: str) -> None:  # noqa: ANN001
    """``causal_conv1d_decode``'s checks: slots out of the state (negative too), repeated or of the wrong
    length or type, and every tensor of the wrong type, shape or layout; the state is untouched."""
    args = _decode_case() | change
    before = args["conv_state"].clone()
    with pytest.raises(ValueError, match=message):
        ops.causal_conv1d_decode(**args)
    assert torch.equal(args["conv_state"], before)
