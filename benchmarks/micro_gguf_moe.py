"""The grouped-expert GGUF op against a per-expert loop of the dense op, on a Qwen3-30B-A3B layer's experts.

One mixture-of-experts layer's three expert projections, stacked as the GGUF
file stores them (128 experts; gate and up ``[128 x 768, 2048]`` in Q4_K,
down ``[128 x 2048, 768]`` in Q6_K, as a Q4_K_M file has them; other sizes
with --experts / --hidden / --intermediate), random valid blocks (the same
instructions as real ones), interleaved as the loader does unless
--file-order. Each step routes ``tokens`` tokens to ``top_k`` random experts
each and times, for each projection (down taking gate's output width):

    grouped  torch.ops.pagedllm.gguf_moe_linear on all pairs at once
    loop     x.index_select(pairs' tokens), then gguf_linear per expert with tokens (what a Python MoE
             layer runs without the grouped op)

their outputs checked equal bit for bit on one routing first. The two are
then timed in alternation, ``--rounds`` times each, every call on a fresh
random routing (so its experts' blocks come from memory, as in a real step:
the ~390 MB of blocks are more than the last-level cache), and the median of
each printed with their ratio (the machine may be shared: alternating keeps
a load change from favouring one side).

    .venv/bin/python benchmarks/micro_gguf_moe.py [--tokens 1 16 64] [--rounds 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedllm.kernels import load_kernels
from pagedllm.layers.quantization.gguf_linear import GGUF_INTERLEAVED
from pagedllm.layers.quantization.gguf_moe import route_pairs

Q = GGMLQuantizationType
_HALF_AT = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}  # the fp16 scale fields of a super-block


def stacked_blocks(ggml_type: GGMLQuantizationType, rows: int, in_features: int, seed: int) -> torch.Tensor:
    """Random valid blocks ``[rows, row bytes]``: random quants and packed scales, fp16 scales of a sane size."""
    rng = np.random.default_rng(seed)
    block_weights, block_bytes = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, size=(rows, in_features // block_weights, block_bytes), dtype=np.uint8)
    for offset in _HALF_AT[ggml_type]:
        raw[:, :, offset : offset + 2] = np.array([0.002], np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


def per_expert_loop(x: torch.Tensor, weight: torch.Tensor, type_: int, num_experts: int, token_ids: torch.Tensor,
                    offsets: list[int]) -> torch.Tensor:
    """The dense op on each expert's pairs: ``[num_pairs, N]``."""
    n, in_features = weight.shape[0] // num_experts, x.shape[1]
    gathered = x.index_select(0, token_ids)  # [num_pairs, in]
    out = torch.empty(token_ids.shape[0], n)
    for e in range(num_experts):
        lo, hi = offsets[e], offsets[e + 1]
        if hi > lo:
            out[lo:hi] = torch.ops.pagedllm.gguf_linear(gathered[lo:hi], weight[e * n : (e + 1) * n], type_,
                                                        in_features, None)
    return out


def _timed(fn, *args) -> float:  # noqa: ANN001
    """Milliseconds of one call."""
    start = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - start) * 1e3


def _routing(tokens: int, num_experts: int, top_k: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """route_pairs of ``tokens`` tokens each to ``top_k`` distinct random experts."""
    topk_ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    return route_pairs(topk_ids, num_experts)


def run(args: argparse.Namespace) -> None:
    load_kernels()
    if args.threads:
        torch.set_num_threads(args.threads)
    e, h, inter = args.experts, args.hidden, args.intermediate
    layers = {"gate": (Q.Q4_K, e * inter, h), "up": (Q.Q4_K, e * inter, h), "down": (Q.Q6_K, e * h, inter)}
    weights = {}
    for i, (name, (ggml_type, rows, in_features)) in enumerate(layers.items()):
        blocks, type_ = stacked_blocks(ggml_type, rows, in_features, seed=i), int(ggml_type)
        if not args.file_order:
            torch.ops.pagedllm.gguf_interleave_(blocks, type_, in_features)
            type_ = GGUF_INTERLEAVED[type_]
        weights[name] = (blocks, type_, in_features)
    layout = "file order" if args.file_order else "x16"
    print(f"{e} experts, top-{args.top_k}, hidden {h}, intermediate {inter}, {layout}, "
          f"{torch.get_num_threads()} threads; median ms of {args.rounds} alternating rounds")
    gen = torch.Generator().manual_seed(0)
    for tokens in args.tokens:
        for name, (blocks, type_, in_features) in weights.items():
            x = torch.randn(tokens, in_features, generator=gen)
            _, token_ids, offsets = _routing(tokens, e, args.top_k, gen)
            grouped = torch.ops.pagedllm.gguf_moe_linear(x, blocks, type_, e, token_ids, offsets)
            if not torch.equal(grouped, per_expert_loop(x, blocks, type_, e, token_ids, offsets.tolist())):
                raise SystemExit(f"{name}, {tokens} tokens: the grouped op and the loop differ")
            grouped_ms, loop_ms = [], []
            for _ in range(args.rounds):  # each call a fresh routing: its experts' blocks not in cache yet
                _, token_ids, offsets = _routing(tokens, e, args.top_k, gen)
                grouped_ms.append(_timed(torch.ops.pagedllm.gguf_moe_linear, x, blocks, type_, e, token_ids, offsets))
                _, token_ids, offsets = _routing(tokens, e, args.top_k, gen)
                loop_ms.append(_timed(per_expert_loop, x, blocks, type_, e, token_ids, offsets.tolist()))
            g, lp = statistics.median(grouped_ms), statistics.median(loop_ms)
            print(f"tokens {tokens:3d}  {name:4s} [{blocks.shape[0]} x {in_features}]  grouped {g:8.2f} ms  "
                  f"loop {lp:8.2f} ms  loop / grouped {lp / g:5.2f}x")

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--file-order", action="store_true", help="keep the file's block order (float activations)")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
