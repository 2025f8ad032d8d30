"""Tensor parallelism for a mixture of experts: a slice of every expert per rank, or whole experts per rank?

One Qwen3-30B-A3B sparse layer's shape (hidden 2048, 128 experts of 768, top 8) on 2 ranks, float32
weights, one thread per rank (as ``tensor_parallel_size=2, num_threads=1``). Either way each rank holds
half the layer (1.2 GB here) and the block ends in one all-reduce of ``[tokens, hidden]`` (the tokens are
on every rank: no all-to-all on one machine); what differs is the work a rank does in a step:

- **slice** (what pagedllm does): every rank runs every chosen expert on half its rows (384), so the ranks
  do the same work whatever the routing;
- **whole**: rank ``r`` holds experts ``[64 r, 64 r + 64)`` in full; a step costs the rank that drew more
  of the step's (token, expert) pairs.

For each token count the script draws routings (softmax of random logits, top 8: a uniform router, the
best case for whole experts; trained routers are skewed) and times the grouped product of the block's own
code (``experts_linear`` on each rank's pairs, gate/up, SiLU-and-multiply, down), the median over draws of
the slower rank's time.

    .venv/bin/python benchmarks/moe_tp_split.py [--tokens 1 4 16 64] [--draws 15]
    .venv/bin/python benchmarks/moe_tp_split.py --hidden 256 --experts 32 --inter 512 --top-k 4   (a small MoE)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.layers.activation import gated_activation
from pagedllm.layers.experts_linear import experts_linear
from pagedllm.layers.fused_moe import stacked_experts_layer
from pagedllm.layers.linear import Linear

RANKS = 2


def _layers(hidden: int, num_experts: int, inter: int) -> tuple[Linear, Linear]:
    gate_up = stacked_experts_layer(hidden, 2 * inter, num_experts, False, None, "gate_up")
    down = stacked_experts_layer(inter, hidden, num_experts, False, None, "down")
    with torch.no_grad():
        for layer in (gate_up, down):
            layer.weight.normal_(0, 0.02)
    return gate_up, down


def _grouped(layers: tuple[Linear, Linear], x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor,
             num_experts: int) -> float:
    """Seconds for one rank's pairs (token ``tokens[p]`` to local expert ``experts[p]``) through its experts."""
    act = gated_activation("silu")
    start = time.perf_counter()
    order = torch.argsort(experts, stable=True)
    token_ids = tokens[order].to(torch.int32)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(torch.bincount(experts, minlength=num_experts), 0)
    h = act(experts_linear(layers[0], x, token_ids, offsets, num_experts))
    experts_linear(layers[1], h, torch.arange(h.shape[0], dtype=torch.int32), offsets, num_experts)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--draws", type=int, default=15)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--inter", type=int, default=768, help="each expert's intermediate size")
    p.add_argument("--top-k", type=int, default=8)
    args = p.parse_args()
    if args.experts % RANKS or args.inter % RANKS or not 1 <= args.top_k <= args.experts:
        raise ValueError(f"experts and inter must split over {RANKS} ranks, top-k within the experts")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    hidden, num_experts, top_k = args.hidden, args.experts, args.top_k
    per_rank = num_experts // RANKS
    sliced = _layers(hidden, num_experts, args.inter // RANKS)  # rank 0's slice of every expert (rank 1's alike)
    whole = _layers(hidden, per_rank, args.inter)  # one rank's whole experts (the other rank's alike)
    print(f"{'tokens':>6} {'slice ms':>9} {'whole ms':>9} {'whole/slice':>11} {'pairs max/mean (whole)':>23}")
    for num_tokens in args.tokens:
        x = torch.randn(num_tokens, hidden)
        t_slice, t_whole, skew = [], [], []
        for _ in range(args.draws):
            ids = torch.topk(torch.softmax(torch.randn(num_tokens, num_experts), -1), top_k, -1).indices
            flat = ids.reshape(-1)
            tokens = torch.arange(num_tokens).repeat_interleave(top_k)
            t_slice.append(_grouped(sliced, x, tokens, flat, num_experts))
            ranks = []
            for r in range(RANKS):
                mine = (flat // per_rank) == r
                ranks.append(_grouped(whole, x, tokens[mine], flat[mine] - r * per_rank, per_rank))
            t_whole.append(max(ranks))
            counts = torch.bincount(flat // per_rank, minlength=RANKS).float()
            skew.append(float(counts.max() / counts.mean()))
        s, w = statistics.median(t_slice) * 1e3, statistics.median(t_whole) * 1e3
        print(f"{num_tokens:>6} {s:>9.2f} {w:>9.2f} {w / s:>11.2f} {statistics.mean(skew):>23.2f}")


if __name__ == "__main__":
    main()
