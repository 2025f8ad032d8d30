"""Speculative decoding on a hybrid model: a checkpoint and recompute (what pagedllm does) or a state per draft position.

A verify step runs a sequence's last token and its ``k`` drafts; a Gated DeltaNet layer's state cannot drop
the rejected ones' tokens (docs/hybrid-models.md, "Speculative decoding: state checkpoints"). Two ways back:

- **A, checkpoint + recompute** (pagedllm today): before the verify step one copy of the sequence's states
  (conv and recurrent, every state layer) into a checkpoint slot; the verify step runs its ``k + 1`` tokens
  as a chunk (``gated_delta_prefill``). All ``k`` drafts accepted: nothing more. ``a < k`` accepted: a
  second copy restores the checkpoint, and the next step runs ``a + 2`` tokens (the old last token, the
  ``a`` accepted drafts, the sampled one) as a chunk from there, with no drafts: it yields one token.
- **B, a state per position**: the verify step writes the states after each of its ``k + 1`` tokens into
  ``k + 1`` slots (here: the real ops, ``causal_conv1d`` over the chunk plus a window copy per position, and
  per token a copy of the previous position's recurrent state then ``gated_delta_decode`` on it in place);
  the accepted position's slot becomes the sequence's state (an id swap: no copy, nothing recomputed). The
  next step is a verify step again.

Timed on random weights at real shapes, one sequence, float32 (the CPU engine's exact dtype), through the
project's layer (``GatedDeltaNet`` with its native kernels) and ``GatedMLP``: per state layer the mixer of
``n`` tokens each way, the state copy, the MLP. ``2b``: Qwen3.5-2B (``real_size_hybrid_gguf.SHAPES``: 18
Gated DeltaNet + 6 gated-attention layers); the model-level figures count an attention layer as its
projections plus the MLP (the attention over a short context is left out: both methods pay it alike) and the
LM head (timed on a tenth of the vocabulary, times 10). ``35b-a3b``: Qwen3.5-35B-A3B's / Qwen3-Next's state
layer (16 key / 32 value heads of 128: a 2 MiB recurrent state), its mixer only (the MoE and the other
layers are not timed: the table of state costs stands alone).

Per acceptance pattern (every verify step accepts ``a`` of ``k``: all, half (``k // 2``), none) it prints the
model time per generated token each way, and plain decoding's, and the states' bytes per sequence (A holds
2 states per state layer, B ``k + 1``). ``A'`` (not built) is A whose recompute step also carries the next
``k`` drafts: the step after a rejection is a verify step again, of ``a + 2 + k`` tokens.

    PYTHONPATH=. .venv/bin/python benchmarks/hybrid_spec_rollback.py [--shapes 2b 35b-a3b] [--reps 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from benchmarks.real_size_hybrid_gguf import SHAPES as GGUF_SHAPES
from pagedllm.kernels import load_kernels
from pagedllm.layers.causal_conv1d import causal_conv1d
from pagedllm.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetSpec
from pagedllm.layers.linear import Linear
from pagedllm.layers.mlp import GatedMLP
from pagedllm.layers.native_ops import NativeOps

KS = (1, 2, 4, 8)
SEQ_SLOT, CHECKPOINT_SLOT = 0, 1  # the sequence's slot, A's checkpoint; B's positions from 2 on


@dataclass(frozen=True)
class Shape:
    """What the benchmark builds of a model: its state layer, and (model-level figures) the rest."""

    spec: GatedDeltaNetSpec
    num_state_layers: int
    num_attention_layers: int
    mlp_intermediate: int | None  # None: not timed (MoE)
    q_out: int = 0  # the attention layers' projections: q and its gate, k + v, o's input
    kv_out: int = 0
    o_in: int = 0
    vocab_size: int = 0


def shapes() -> dict[str, Shape]:
    """Qwen3.5-2B from the GGUF writer's config numbers; Qwen3.5-35B-A3B's (and Qwen3-Next's) state layer."""
    s = GGUF_SHAPES["2b"]
    spec = GatedDeltaNetSpec(s.hidden_size, s.linear_num_key_heads, s.linear_num_value_heads, s.linear_key_head_dim,
                             s.linear_value_head_dim, s.conv_kernel, 1e-6)
    linear = sum(s.is_linear(i) for i in range(s.num_layers))
    two_b = Shape(spec, linear, s.num_layers - linear, s.intermediate_size, 2 * s.num_heads * s.head_dim,
                  2 * s.num_kv_heads * s.head_dim, s.num_heads * s.head_dim, s.vocab_size)
    moe = Shape(GatedDeltaNetSpec(2048, 16, 32, 128, 128, 4, 1e-6), 30, 10, None)
    return {"2b": two_b, "35b-a3b": moe}


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median CPU seconds of ``fn`` over ``reps`` runs, after one warm-up.

    CPU time (``process_time``), not wall time: the machine is shared, and a wall clock counts the time
    other processes hold the core; one thread by default, so CPU time is the work's own time (memory
    bandwidth taken by others still shows)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def _meta(n: int, slot: int) -> SimpleNamespace:
    """One sequence continuing its state in ``slot`` with ``n`` tokens (a chunk when n > 1, as the runner counts)."""
    return SimpleNamespace(query_start_loc=[0, n], num_prefills=int(n > 1), state_slots=torch.tensor([slot]),
                           has_initial_state=torch.tensor([True]))


def build_layer(spec: GatedDeltaNetSpec, num_slots: int) -> tuple[GatedDeltaNet, tuple[torch.Tensor, torch.Tensor]]:
    """The layer on random weights (transformers' init where the recurrence cares), native, and its slots."""
    layer = GatedDeltaNet(spec, prefix="linear_attn")
    with torch.no_grad():
        for lin in (layer.in_proj, layer.out_proj):
            lin.weight.normal_(0.0, 0.02)
        layer.conv1d.weight.uniform_(-0.5, 0.5)
        layer.A_log.copy_(torch.empty(spec.num_v_heads).uniform_(0.5, 16.0).log())
        layer.dt_bias.fill_(1.0)
    layer.select_impl(NativeOps())
    states = tuple(torch.randn(num_slots, *shape) * 0.1 for shape in layer.state_shapes())
    return layer, states


def _split(layer: GatedDeltaNet, proj: torch.Tensor, mixed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v, z, g, beta of the tokens, as the layer's ``_inputs`` makes them from its projection and conv."""
    s, n = layer.spec, proj.shape[0]
    q = mixed[:, : s.key_dim].view(n, s.num_k_heads, s.head_k_dim)
    k = mixed[:, s.key_dim : 2 * s.key_dim].view(n, s.num_k_heads, s.head_k_dim)
    v = mixed[:, 2 * s.key_dim :].view(n, s.num_v_heads, s.head_v_dim)
    z = proj[:, s.conv_dim : s.conv_dim + s.value_dim].view(n, s.num_v_heads, s.head_v_dim)
    b, a = proj[:, s.conv_dim + s.value_dim :].float().split(s.num_v_heads, dim=1)
    g = (-layer.A_log.float().exp() * F.softplus(a + layer.dt_bias.float())).contiguous()
    return q, k, v, z, g, b.sigmoid().contiguous()


def states_chunk(layer: GatedDeltaNet, proj: torch.Tensor, states: tuple[torch.Tensor, torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Method A's state work in a verify step (what ``forward_native`` does between its projections): the
    conv and the rule over the chunk from the sequence's slot, which ends at the last token's states."""
    s, n = layer.spec, proj.shape[0]
    weight = layer.conv1d.weight.view(s.conv_dim, s.conv_kernel_size)
    slot, initial = torch.tensor([SEQ_SLOT]), torch.tensor([True])
    mixed = causal_conv1d(proj[:, : s.conv_dim], weight, None, states[0], [0, n], slot, initial, "silu")
    q, k, v, z, g, beta = _split(layer, proj, mixed)
    core = torch.empty_like(v)
    if n > 1:
        layer.native.gated_delta_prefill(q, k, v, g, beta, states[1], torch.tensor([0, n]), slot, initial, core,
                                         s.head_k_dim**-0.5, s.chunk_size)
    else:
        layer.native.gated_delta_decode(q, k, v, g, beta, states[1], slot, core, s.head_k_dim**-0.5)
    return core, z


def states_per_position(layer: GatedDeltaNet, proj: torch.Tensor, states: tuple[torch.Tensor, torch.Tensor],
                        positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Method B's state work: the states after token ``j`` of the chunk in slot ``positions[j]``; the
    sequence's own slot (``SEQ_SLOT``) is left as it was. Returns the rule's output and z, as A's."""
    s, n = layer.spec, proj.shape[0]
    conv, rec = states
    conv_in = proj[:, : s.conv_dim]
    last = positions[n - 1]
    conv[last].copy_(conv[SEQ_SLOT])  # the conv runs the chunk from the sequence's window, ends in the last slot
    window = torch.cat([conv[SEQ_SLOT], conv_in])  # [kernel - 1 + n, conv_dim]: each position's window is a slice
    weight = layer.conv1d.weight.view(s.conv_dim, s.conv_kernel_size)
    mixed = causal_conv1d(conv_in, weight, None, conv, [0, n], torch.tensor([last]), torch.tensor([True]), "silu")
    width = s.conv_kernel_size - 1
    for j in range(n - 1):
        conv[positions[j]].copy_(window[j + 1 : j + 1 + width])
    q, k, v, z, g, beta = _split(layer, proj, mixed)
    core = torch.empty_like(v)
    prev = SEQ_SLOT
    for j in range(n):  # per token: the previous position's state copied on, then the decode kernel in place
        rec[positions[j]].copy_(rec[prev])
        rows = slice(j, j + 1)
        layer.native.gated_delta_decode(q[rows], k[rows], v[rows], g[rows], beta[rows], rec,
                                        torch.tensor([positions[j]]), core[rows], s.head_k_dim**-0.5)
        prev = positions[j]
    return core, z


def check_methods_agree(layer: GatedDeltaNet, states: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> None:
    """B's outputs and per-position states are A's (the layer's own forward, token by token): the timed B is right."""
    n = x.shape[0]
    positions = list(range(2, 2 + n))
    saved = tuple(t[SEQ_SLOT].clone() for t in states)
    core, z = states_per_position(layer, layer.in_proj(x), states, positions)
    got = layer._output(core, z)
    for j in range(n):
        want = layer(x[j : j + 1], states, _meta(1, SEQ_SLOT))  # the sequence's slot, one token at a time
        for t, pos in zip(states, (positions[j], positions[j])):
            if not torch.allclose(t[pos], t[SEQ_SLOT], atol=1e-5, rtol=1e-4):
                raise RuntimeError(f"method B's state after position {j} is not the layer's")
        if not torch.allclose(got[j], want[0], atol=1e-4, rtol=1e-3):
            raise RuntimeError(f"method B's output at position {j} is not the layer's")
    for t, old in zip(states, saved):
        t[SEQ_SLOT].copy_(old)


def measure_state_layer(shape: Shape, reps: int) -> dict[str, dict[int, float] | float]:
    """Seconds, one sequence, one state layer: the whole layer (A's way) for each token count needed, the
    state work of A and of B (projections apart: the same matmuls either way), and a state copy."""
    spec = shape.spec
    layer, states = build_layer(spec, 2 + max(KS) + 1)
    # plain decoding, verify steps, A's recompute steps, and A' (below): the recompute carrying k new drafts
    counts = sorted({1} | {k + 1 for k in KS} | {a + 2 + extra for k in KS for a in (0, k // 2) for extra in (0, k)})
    xs = torch.randn(max(counts), spec.hidden_size)
    out: dict[str, dict[int, float] | float] = {"layer": {}, "A": {}, "B": {}}
    with torch.no_grad():
        check_methods_agree(layer, states, xs[: max(KS) + 1])
        for n in counts:
            # the state keeps evolving run after run: a decaying recurrence on small random inputs, harmless
            out["layer"][n] = timed(lambda n=n: layer(xs[:n], states, _meta(n, SEQ_SLOT)), reps)
        for k in KS:
            proj = layer.in_proj(xs[: k + 1])
            positions = list(range(2, 2 + k + 1))
            out["A"][k + 1] = timed(lambda p=proj: states_chunk(layer, p, states), 5 * reps)
            out["B"][k + 1] = timed(lambda p=proj, pos=positions: states_per_position(layer, p, states, pos),
                                   5 * reps)

        def copy() -> None:
            for t in states:
                t[CHECKPOINT_SLOT].copy_(t[SEQ_SLOT])

        out["copy"] = timed(copy, reps * 4)
    return out


def measure_rest(shape: Shape, counts: list[int], reps: int) -> dict[str, dict[int, float]]:
    """Seconds of the MLP, an attention layer's projections and the LM head for ``n`` tokens (Qwen3.5-2B)."""
    h = shape.spec.hidden_size
    mlp = GatedMLP(h, shape.mlp_intermediate, "silu")
    projections = [Linear(h, shape.q_out, False), Linear(h, shape.kv_out, False), Linear(shape.o_in, h, False)]
    tenth = Linear(h, shape.vocab_size // 10, False)
    with torch.no_grad():
        for module in (mlp, tenth, *projections):
            for p in module.parameters():
                p.normal_(0.0, 0.02)
    out: dict[str, dict[int, float]] = {"mlp": {}, "attn_proj": {}, "lm_head": {}}
    with torch.no_grad():
        for n in counts:
            x, o = torch.randn(n, h), torch.randn(n, shape.o_in)
            out["mlp"][n] = timed(lambda x=x: mlp(x), reps)
            out["attn_proj"][n] = timed(lambda x=x, o=o: [projections[0](x), projections[1](x), projections[2](o)],
                                        reps)
            out["lm_head"][n] = 10 * timed(lambda x=x: tenth(x), reps)  # n rows: a verify step samples each
    return out


def report(name: str, shape: Shape, st: dict, rest: dict | None) -> None:
    """Print the state layer's table, then (with ``rest``) the model-level cost per generated token."""
    spec = shape.spec
    conv_b, rec_b = (4 * torch.Size(s).numel() for s in GatedDeltaNet(spec).state_shapes())
    per_layer = conv_b + rec_b
    print(f"\n== {name}: state layer (Gated DeltaNet {spec.num_k_heads}/{spec.num_v_heads} heads of "
          f"{spec.head_k_dim}, hidden {spec.hidden_size}); states {per_layer / 2**20:.2f} MiB a layer, "
          f"{shape.num_state_layers} layers: {shape.num_state_layers * per_layer / 2**20:.1f} MiB a sequence")
    print(f"state copy (conv + recurrent, one layer, one sequence): {st['copy'] * 1e6:.0f} us")
    print("   k | layer, A's way (ms) | its state work: A, chunk (ms) | B, k+1 positions (ms) | B - A (ms) | in copies")
    for k in KS:
        n = k + 1
        a, b = st["A"][n], st["B"][n]
        print(f"  {k:2d} | {st['layer'][n] * 1e3:19.2f} | {a * 1e3:29.3f} | {b * 1e3:21.3f} | {(b - a) * 1e3:10.3f} | "
              f"{(b - a) / st['copy']:9.1f}")
    print("   k | states a sequence: A (2 per layer) | B (k+1 per layer) (MiB)")
    for k in KS:
        print(f"  {k:2d} | {2 * shape.num_state_layers * per_layer / 2**20:34.1f} | "
              f"{(k + 1) * shape.num_state_layers * per_layer / 2**20:17.1f}")
    if rest is None:
        return

    def model(n: int, method: str, rows: int) -> float:
        """One forward of ``n`` tokens of the sequence: every layer, the LM head on the ``rows`` sampled."""
        mixer = st["layer"][n] + (st["B"][n] - st["A"][n] if method == "B" else 0.0)
        return (shape.num_state_layers * (mixer + rest["mlp"][n])
                + shape.num_attention_layers * (rest["attn_proj"][n] + rest["mlp"][n]) + rest["lm_head"][rows])

    print("   n | state layer (ms) | MLP (ms) | attention projections (ms) | LM head, n rows (ms)")
    for n in sorted(rest["mlp"]):
        print(f"  {n:2d} | {st['layer'][n] * 1e3:16.2f} | {rest['mlp'][n] * 1e3:8.2f} | {rest['attn_proj'][n] * 1e3:26.2f} | "
              f"{rest['lm_head'][n] * 1e3:20.1f}")
    copies = shape.num_state_layers * st["copy"]
    plain = model(1, "A", 1)
    print(f"model per generated token (ms), plain decoding {plain * 1e3:.1f}; A: rejected steps are followed by "
          "a recompute step without drafts")
    print("   k | accepted | A: copies + verify [+ restore + recompute] | B: verify per position | A / B | A' | A' / B")
    for k in KS:
        for label, acc in (("all", k), ("half", k // 2), ("none", 0)):
            if label == "half" and k == 1:
                continue  # k // 2 = 0: the "none" row
            verify_a = copies + model(k + 1, "A", k + 1)
            if acc == k:
                a_tok = verify_a / (k + 1)
            else:  # verify (a + 1 tokens), restore, recompute of a + 2 tokens yielding one more
                a_tok = (verify_a + copies + model(acc + 2, "A", 1)) / (acc + 2)
            b_tok = model(k + 1, "B", k + 1) / (acc + 1)
            # A': after a rejection the recompute step carries the next k drafts (a + 2 + k tokens, a checkpoint
            # before them as now): every step a verify step, the a + 1 recomputed tokens its extra work
            a2_tok = a_tok if acc == k else (2 * copies + model(acc + 2 + k, "A", k + 1)) / (acc + 1)
            print(f"  {k:2d} | {label:>4} {acc:2d} | {a_tok * 1e3:42.1f} | {b_tok * 1e3:22.1f} | {a_tok / b_tok:5.2f} | "
                  f"{a2_tok * 1e3:6.1f} | {a2_tok / b_tok:6.2f}")


def main() -> None:
    """Parse the arguments, measure each shape and print its tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["2b", "35b-a3b"], choices=sorted(shapes()))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.reps < 1 or args.threads < 1:
        raise ValueError("--reps and --threads must be >= 1")
    if load_kernels() is None:
        raise SystemExit("the native kernels are not built here: method B's ops are theirs")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s), float32, one sequence, median CPU time of "
          f"{args.reps} runs (state work: {5 * args.reps})")
    for name in args.shapes:
        shape = shapes()[name]
        st = measure_state_layer(shape, args.reps)
        rest = None
        if shape.mlp_intermediate is not None:
            rest = measure_rest(shape, sorted(st["layer"]), args.reps)
        report(name, shape, st, rest)


if __name__ == "__main__":
    main()
