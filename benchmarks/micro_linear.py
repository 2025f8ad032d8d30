"""Linear layers on SmolLM2's shapes: F.linear (MKL) vs oneDNN packed vs int8 kernel.

A stack of 60 [1728 x 576] weights (60M, more than the last-level cache, so
weights stream from memory as in a real step), called with M rows each.

    .venv/bin/python benchmarks/micro_linear.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

import pagedllm.models.int8_linear as int8_linear
from pagedllm.models.onednn_linear import onednn_linear, pack_weight


def _ms(fn, n: int = 10) -> float:  # noqa: ANN001
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(576, 1728, bias=False) for _ in range(60)]
    packed = [pack_weight(layer.weight) for layer in layers]
    int8_linear.SMALL_BATCH_ROWS = 1 << 30  # time the kernel itself at every M
    quantized = [int8_linear.Int8Linear(layer) for layer in layers]
    flops_per_row = 2 * 60 * 576 * 1728
    print(f"{'rows':>5} {'F.linear ms':>12} {'oneDNN ms':>10} {'int8 ms':>8}   GFLOP/s (F.linear / oneDNN / int8)")
    with torch.inference_mode():
        for rows in (1, 2, 4, 8, 16, 32, 64, 256):
            x = torch.randn(rows, 576)
            a = _ms(lambda x=x: [F.linear(x, layer.weight) for layer in layers])
            b = _ms(lambda x=x: [onednn_linear(x, p, None) for p in packed])
            c = _ms(lambda x=x: [q(x) for q in quantized])
            g = [rows * flops_per_row / (t * 1e6) for t in (a, b, c)]
            print(f"{rows:>5} {a:>12.2f} {b:>10.2f} {c:>8.2f}   {g[0]:.0f} / {g[1]:.0f} / {g[2]:.0f}")


if __name__ == "__main__":
    main()
