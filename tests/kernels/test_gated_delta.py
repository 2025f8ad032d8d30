"""The gated delta rule kernels against a float64 recurrence written from the rule's definition.

Gated DeltaNet (Qwen3-Next, Qwen3.5) keeps a [head_k_dim, head_v_dim] state per
value head. Per token: decay it by exp(g), write beta * (v - what k reads) at k,
read it with q (scaled by 1/sqrt(head_k_dim)); q and k L2-normalised first as the
models do. The reference below runs that one token at a time in float64. The
native prompt kernel (chunked, ``gated_delta_prefill``) and the decode kernel
(recurrent, ``gated_delta_decode``) must both give it, from scattered state
slots, with head sizes that take the vector loops and their tails, value heads
sharing key heads, strided q/k/v (column slices of one row, as the layer's
conv output gives them) and chunk sizes that split prompts unevenly.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import load_kernels

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="native kernels unavailable")

NUM_SLOTS = 7
# (head_k_dim, head_v_dim): whole vectors of every width, then tails of 8- and 16-wide loops
HEAD_DIMS = [(32, 16), (12, 20)]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 outputs [T, Hv, Dv] and final state [Hv, Dk, Dv] of one sequence, token by token."""
    group = v.shape[1] // q.shape[1]
    q, k = q.double().repeat_interleave(group, 1), k.double().repeat_interleave(group, 1)
    if l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    scale = q.shape[-1] ** -0.5
    s = state.double().clone()
    outs = []
    for t in range(q.shape[0]):
        s = s * g[t].double().exp()[:, None, None]
        read = torch.einsum("hkv,hk->hv", s, k[t])
        delta = beta[t].double()[:, None] * (v[t].double() - read)
        s = s + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", s, q[t]) * scale)
    return torch.stack(outs) if outs else v.new_zeros(0, *v.shape[1:]).double(), s


def _inputs(rows: int, num_k_heads: int, num_v_heads: int, dk: int, dv: int, seed: int,
            decay: float = 1.0) -> tuple[torch.Tensor, ...]:
    """q, k, v as strided column slices of one [rows, q | k | v] tensor (the layer's conv output), g < 0, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(rows, 2 * num_k_heads * dk + num_v_heads * dv, generator=gen)
    q = mixed[:, : num_k_heads * dk].view(rows, num_k_heads, dk)
    k = mixed[:, num_k_heads * dk: 2 * num_k_heads * dk].view(rows, num_k_heads, dk)
    v = mixed[:, 2 * num_k_heads * dk:].view(rows, num_v_heads, dv)
    # the models' g: -exp(A_log) * softplus(a + dt_bias)
    g = -decay * torch.nn.functional.softplus(torch.randn(rows, num_v_heads, generator=gen))
    beta = torch.rand(rows, num_v_heads, generator=gen)
    return q, k, v, g.contiguous(), beta


def _states(num_v_heads: int, dk: int, dv: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_SLOTS, num_v_heads, dk, dv, generator=gen) * 0.5


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
@pytest.mark.parametrize(("dk", "dv"), HEAD_DIMS)
@pytest.mark.parametrize("l2norm", [True, False])
def test_chunked_prompts_match_the_float64_recurrence(chunk: int, dk: int, dv: int, l2norm: bool) -> None:
    ops = torch.ops.pagedllm
    lens, slots, initial = [19, 1, 70, 0], [5, 0, 3, 6], [True, False, False, True]
    nk, nv = 2, 4
    q, k, v, g, beta = _inputs(sum(lens), nk, nv, dk, dv, seed=chunk + dk)
    if not l2norm:  # unnormalised keys: keep the rule contracting, as the models' normalised ones do
        q, k = q * dk ** -0.5, k * dk ** -0.5
    state = _states(nv, dk, dv, seed=1)
    before = state.clone()
    starts = torch.tensor([0, *lens]).cumsum(0)
    bounds = torch.stack([starts[:-1], starts[1:]], 1).flatten()
    out = torch.full((sum(lens), nv, dv), float("nan"))
    ops.gated_delta_prefill(q, k, v, g, beta, state, bounds, torch.tensor(slots), torch.tensor(initial), out,
                            dk ** -0.5, l2norm, chunk)
    for i, (slot, has) in enumerate(zip(slots, initial, strict=True)):
        a, b = int(starts[i]), int(starts[i + 1])
        start = before[slot] if has else torch.zeros_like(before[slot])
        want_out, want_state = _reference(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], start, l2norm)
        torch.testing.assert_close(out[a:b].double(), want_out, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(state[slot].double(), want_state, atol=2e-4, rtol=1e-4)
    untouched = [s for s in range(NUM_SLOTS) if s not in slots]
    assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize(("dk", "dv"), HEAD_DIMS)
def test_decode_steps_match_the_float64_recurrence(dk: int, dv: int) -> None:
    ops = torch.ops.pagedllm
    nk, nv, steps = 1, 3, 6
    slots = torch.tensor([4, 1, 6])  # three sequences, scattered, not in slot order
    state = _states(nv, dk, dv, seed=2)
    want_states = [state[s].double().clone() for s in slots.tolist()]
    for step in range(steps):
        q, k, v, g, beta = _inputs(len(slots), nk, nv, dk, dv, seed=100 + step)
        out = torch.empty(len(slots), nv, dv)
        ops.gated_delta_decode(q, k, v, g, beta, state, slots, out, dk ** -0.5, True)
        for r in range(len(slots)):
            want_out, want_states[r] = _reference(q[r:r + 1], k[r:r + 1], v[r:r + 1], g[r:r + 1], beta[r:r + 1],
                                                  want_states[r], True)
            torch.testing.assert_close(out[r].double(), want_out[0], atol=1e-4, rtol=1e-4)
    for r, s in enumerate(slots.tolist()):
        torch.testing.assert_close(state[s].double(), want_states[r], atol=1e-4, rtol=1e-4)


def test_a_prompt_chunked_then_decoded_equals_the_recurrent_form_token_by_token() -> None:
    """prompt + decode through the two kernels against the decode kernel alone (fp32 both ways)."""
    ops = torch.ops.pagedllm
    nk, nv, dk, dv, rows = 2, 2, 32, 32, 100
    q, k, v, g, beta = _inputs(rows, nk, nv, dk, dv, seed=7)
    chunked = torch.zeros(NUM_SLOTS, nv, dk, dv)
    out_chunked = torch.empty(rows, nv, dv)
    ops.gated_delta_prefill(q[:90], k[:90], v[:90], g[:90], beta[:90], chunked, torch.tensor([0, 90]),
                            torch.tensor([2]), torch.tensor([False]), out_chunked[:90], dk ** -0.5, True, 64)
    recurrent = torch.zeros(NUM_SLOTS, nv, dk, dv)
    out_recurrent = torch.empty(rows, nv, dv)
    for t in range(rows):
        if t >= 90:
            ops.gated_delta_decode(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], chunked,
                                   torch.tensor([2]), out_chunked[t:t + 1], dk ** -0.5, True)
        ops.gated_delta_decode(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], recurrent,
                               torch.tensor([5]), out_recurrent[t:t + 1], dk ** -0.5, True)
    torch.testing.assert_close(out_chunked, out_recurrent, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chunked[2], recurrent[5], atol=1e-4, rtol=1e-4)


def test_strong_decay_forgets_without_overflow() -> None:
    """g of -80 per token: exp of its running sum underflows; the chunked form never divides by it."""
    ops = torch.ops.pagedllm
    nk, nv, dk, dv, rows = 1, 1, 16, 16, 40
    q, k, v, g, beta = _inputs(rows, nk, nv, dk, dv, seed=3, decay=80.0)
    state = _states(nv, dk, dv, seed=3)
    start = state[1].clone()
    out = torch.empty(rows, nv, dv)
    ops.gated_delta_prefill(q, k, v, g, beta, state, torch.tensor([0, rows]), torch.tensor([1]),
                            torch.tensor([True]), out, dk ** -0.5, True, 16)
    want_out, want_state = _reference(q, k, v, g, beta, start, True)
    assert torch.isfinite(out).all() and torch.isfinite(state).all()
    torch.testing.assert_close(out.double(), want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state[1].double(), want_state, atol=1e-4, rtol=1e-4)


def test_a_step_program_runs_the_decode_node_as_the_op_does() -> None:
    ops = torch.ops.pagedllm
    nk, nv, dk, dv, rows = 1, 2, 16, 24, 3
    q, k, v, g, beta = _inputs(rows, nk, nv, dk, dv, seed=4)
    slots = torch.tensor([6, 2, 0])
    eager_state, program_state = _states(nv, dk, dv, seed=4), _states(nv, dk, dv, seed=4)
    eager_out, program_out = torch.empty(rows, nv, dv), torch.empty(rows, nv, dv)
    program = torch.classes.pagedllm.StepProgram(rows)
    program.add("gated_delta_decode", [q, k, v, g, beta, program_state, slots, program_out], [1], [dk ** -0.5])
    for n in (rows, 2):  # the whole batch, then its first rows only
        ops.gated_delta_decode(q[:n], k[:n], v[:n], g[:n], beta[:n], eager_state, slots[:n], eager_out[:n],
                               dk ** -0.5, True)
        program.run(n)
        assert torch.equal(program_out[:n], eager_out[:n])
        assert torch.equal(program_state, eager_state)
    slots[1] = 6  # a slot twice in the step: refused at run time, before anything is written
    with pytest.raises(ValueError, match="given twice"):
        program.run(rows)


def _bad_calls() -> list[tuple[str, dict, str]]:
    return [
        ("prefill", {"slots": torch.tensor([1, 1])}, "given twice"),
        ("prefill", {"slots": torch.tensor([1, NUM_SLOTS])}, "outside"),
        ("prefill", {"bounds": torch.tensor([0, 3, 3, 9])}, "outside"),
        ("prefill", {"bounds": torch.tensor([2, 1, 3, 4])}, "outside"),
        ("prefill", {"chunk_size": 0}, "chunk_size"),
        ("prefill", {"has_initial": torch.tensor([1, 0])}, "has_initial_state"),
        ("prefill", {"g": torch.zeros(4, 4, dtype=torch.float64)}, "g must be"),
        ("decode", {"slots": torch.tensor([0, 1, 2, 2])}, "given twice"),
        ("decode", {"slots": torch.tensor([0, 1, 2, -1])}, "outside"),
        ("decode", {"state": torch.zeros(NUM_SLOTS, 3, 8, 8)}, "num_k_heads dividing"),
        ("decode", {"v": torch.zeros(4, 4, 9)}, "v must be"),
        ("decode", {"state": torch.zeros(NUM_SLOTS, 4, 8, 8, dtype=torch.float16)}, "float32"),
    ]


@pytest.mark.parametrize(("kind", "change", "message"), _bad_calls())
def test_bad_inputs_are_value_errors(kind: str, change: dict, message: str) -> None:
    q, k, v, g, beta = _inputs(4, 2, 4, 8, 8, seed=5)
    args = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state": torch.zeros(NUM_SLOTS, 4, 8, 8),
            "bounds": torch.tensor([0, 3, 3, 4]), "slots": torch.tensor([1, 2]),
            "has_initial": torch.tensor([True, False]), "chunk_size": 64}
    if kind == "decode":
        args["slots"] = torch.tensor([0, 1, 2, 3])
    args.update(change)
    out = torch.empty(4, 4, 8)
    with pytest.raises(ValueError, match=message):
        if kind == "prefill":
            torch.ops.pagedllm.gated_delta_prefill(args["q"], args["k"], args["v"], args["g"], args["beta"],
                                                   args["state"], args["bounds"], args["slots"], args["has_initial"],
                                                   out, 0.3, True, args["chunk_size"])
        else:
            torch.ops.pagedllm.gated_delta_decode(args["q"], args["k"], args["v"], args["g"], args["beta"],
                                                  args["state"], args["slots"], out, 0.3, True)


def test_the_ops_run_on_meta_tensors() -> None:
    meta = torch.device("meta")
    q, v = torch.empty(3, 1, 8, device=meta), torch.empty(3, 2, 8, device=meta)
    gb, state = torch.empty(3, 2, device=meta), torch.empty(4, 2, 8, 8, device=meta)
    index = torch.empty(3, dtype=torch.int64, device=meta)
    torch.ops.pagedllm.gated_delta_decode(q, q, v, gb, gb, state, index, v.clone(), 0.3, True)
    torch.ops.pagedllm.gated_delta_prefill(q, q, v, gb, gb, state, torch.empty(2, dtype=torch.int64, device=meta),
                                           index[:1], torch.empty(1, dtype=torch.bool, device=meta), v.clone(),
                                           0.3, True, 16)
