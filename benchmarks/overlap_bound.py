"""How much overlapping decode attention with the GEMMs could give, at most (bf16, SmolLM2's shapes).

One decode step's kernels, 40 sequences of 216 tokens, 30 layers: the four
bf16 GEMMs of every layer and the paged attention over a bf16 cache, as the
recorded decode step runs them. Printed: both phases one after the other on all
threads (what the engine does), each on one thread alone, and each on one
thread at the same time (Python threads; torch ops release the GIL), which is
what a two-batch overlap would run. No dependencies are modelled, so the
concurrent time is a lower bound for any overlap scheme.

    .venv/bin/python benchmarks/overlap_bound.py
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import torch

from pagedllm.kernels import load_kernels
from pagedllm.layers.quantization.packed_linear import pack_weight_panels_bf16

ROWS, LAYERS, CONTEXT, BLOCK_SIZE = 40, 30, 216, 16
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate_up, down


def main() -> None:
    ops = load_kernels()  # torch.ops.pagedllm
    if ops is None:
        raise SystemExit("the native kernels do not build here")
    weights = [[pack_weight_panels_bf16(torch.randn(n, k) * 0.02) for n, k in SHAPES] for _ in range(LAYERS)]
    xs = {k: torch.randn(ROWS, k) for k in (576, 1536)}  # [rows, in]
    num_blocks = 2912 * 16 // BLOCK_SIZE
    # [2, layers, num_blocks, block_size, num_kv_heads, head_dim]; each sequence's blocks shuffled
    kv = torch.empty(2, LAYERS, num_blocks, BLOCK_SIZE, 3, 64, dtype=torch.bfloat16).normal_()
    ids = list(range(9600 // BLOCK_SIZE))
    random.Random(0).shuffle(ids)
    per_seq = (CONTEXT + BLOCK_SIZE - 1) // BLOCK_SIZE
    tables = torch.tensor([[ids.pop() for _ in range(per_seq)] for _ in range(ROWS)])
    lens = torch.full((ROWS,), CONTEXT, dtype=torch.int64)
    q = torch.randn(ROWS, 9, 64)  # [rows, num_heads, head_dim]
    out = torch.empty_like(q)

    # the ops run on torch's thread count, which set_num_threads sets for the calling thread
    def gemms(num_threads: int) -> None:
        torch.set_num_threads(num_threads)
        for layer in weights:
            for (n, k), w in zip(SHAPES, layer):
                ops.packed_linear_bf16(xs[k], w, None, n)  # [rows, n]

    def attention(num_threads: int) -> None:
        torch.set_num_threads(num_threads)
        for i in range(LAYERS):
            ops.paged_decode(q, kv[0, i], kv[1, i], tables, lens, 0.125, out)

    def ms(fn: Callable[[int], None], num_threads: int, repeats: int = 5) -> float:
        fn(num_threads)
        start = time.perf_counter()
        for _ in range(repeats):
            fn(num_threads)
        return (time.perf_counter() - start) / repeats * 1e3

    gemm2, attn2, gemm1, attn1 = ms(gemms, 2), ms(attention, 2), ms(gemms, 1), ms(attention, 1)
    runs = []
    for _ in range(5):
        attn_ms = [0.0]

        def timed_attention(result: list[float] = attn_ms) -> None:
            t0 = time.perf_counter()
            attention(1)
            result[0] = (time.perf_counter() - t0) * 1e3

        thread = threading.Thread(target=timed_attention)
        start = time.perf_counter()
        thread.start()
        gemms(1)
        gemm_ms = (time.perf_counter() - start) * 1e3
        thread.join()
        runs.append((gemm_ms, attn_ms[0]))
    gemm_c, attn_c = min(runs)
    print(f"both threads, one phase after the other: GEMMs {gemm2:.1f} ms + attention {attn2:.1f} ms "
          f"= {gemm2 + attn2:.1f} ms per step")
    print(f"one thread, alone: GEMMs {gemm1:.1f} ms, attention {attn1:.1f} ms")
    print(f"one thread each, at the same time: GEMMs {gemm_c:.1f} ms, attention {attn_c:.1f} ms")
    # the attention thread, once done, would take half of the GEMM work left
    best = attn_c + max(gemm_c - attn_c, 0.0) / 2
    print(f"best overlap (the attention thread then shares the GEMMs left): ~{best:.1f} ms "
          f"against {gemm2 + attn2:.1f} ms ({100 * (1 - best / (gemm2 + attn2)):.0f}% less)")


if __name__ == "__main__":
    main()
