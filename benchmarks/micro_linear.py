"""Linear layers on SmolLM2's shapes: F.linear (MKL) vs oneDNN packed vs our packed panels vs int8 / int4 blocks.

The decoder's four weights per layer (qkv 960 x 576, o 576 x 576, gate_up
3072 x 576, down 576 x 1536) for 30 layers: 106M weights, 424 MB in float32,
more than the last-level cache, so weights stream from memory as in a real
step. Each is called with M rows (the same activations every call).

    .venv/bin/python benchmarks/micro_linear.py [--rows 1 8 40 64]
    .venv/bin/python benchmarks/micro_linear.py --bf16    # the dtype="bfloat16" layers instead

With ``--bf16`` the same 30 layers hold bf16 weights (212 MB) and take
float32 rows, as ``dtype="bfloat16"`` runs them on the CPU: our k-pair
panel kernel against oneDNN's bf16 matmul with its rounding copies, and
the float32 panel kernel for reference.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.linear import Linear
from pagedllm.layers.quantization.onednn_linear import (
    OneDnnLinearMethod,
    onednn_bf16_supported,
    onednn_linear,
    pack_weight,
)
from pagedllm.layers.quantization.packed_linear import (
    PackedBF16LinearMethod,
    pack_weight_panels,
    packed_linear,
)
from pagedllm.layers.quantization.quantized_linear import QuantizedLinearMethod

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # (out, in) per layer


def _ms(fn, n: int = 10) -> float:  # noqa: ANN001
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 40, 64, 256, 1024])
    p.add_argument("--no-mkl", action="store_true", help="skip F.linear (slow at large row counts)")
    p.add_argument("--bf16", action="store_true", help="time the bf16-weight layers of dtype='bfloat16'")
    args = p.parse_args()
    torch.manual_seed(0)
    layers = [nn.Linear(k, n, bias=False) for n, k in SHAPES]
    if args.bf16:
        _bf16(layers, args.rows)
        return
    onednn = [pack_weight(layer.weight) for layer in layers]
    panels = [pack_weight_panels(layer.weight) for layer in layers]
    int8 = [Linear.from_linear(layer, QuantizedLinearMethod(8, None)) for layer in layers]  # per channel
    int4 = [Linear.from_linear(layer, QuantizedLinearMethod(4, 128)) for layer in layers]  # groups of 128 (96)
    flops_per_row = sum(2 * n * k for n, k in SHAPES)
    print(f"{'rows':>5} {'F.linear':>9} {'oneDNN':>9} {'packed':>9} {'int8':>9} {'int4':>9}  (ms)   GFLOP/s: "
          "F.linear / oneDNN / packed / int8 / int4   packed / oneDNN")
    with torch.inference_mode():
        for rows in args.rows:
            xs = {k: torch.randn(rows, k) for k in (576, 1536)}
            a = float("nan") if args.no_mkl else _ms(lambda xs=xs: [F.linear(xs[la.in_features], la.weight) for la in layers])
            b = _ms(lambda xs=xs: [onednn_linear(xs[la.in_features], w, None) for la, w in zip(layers, onednn)])
            c = _ms(lambda xs=xs: [packed_linear(xs[la.in_features], w, None, la.out_features)
                             for la, w in zip(layers, panels)])
            d = _ms(lambda xs=xs: [q(xs[q.in_features]) for q in int8])
            e = _ms(lambda xs=xs: [q(xs[q.in_features]) for q in int4])
            g = [rows * flops_per_row / (t * 1e6) for t in (a, b, c, d, e)]
            print(f"{rows:>5} {a:>9.2f} {b:>9.2f} {c:>9.2f} {d:>9.2f} {e:>9.2f}         "
                  f"{g[0]:.0f} / {g[1]:.0f} / {g[2]:.0f} / {g[3]:.0f} / {g[4]:.0f}   {b / c:.2f}x")


def _bf16(layers: list[nn.Linear], rows_list: list[int]) -> None:
    panels32 = [pack_weight_panels(layer.weight) for layer in layers]
    ours = [Linear.from_linear(la, PackedBF16LinearMethod()) for la in layers]
    # oneDNN's bf16 needs AVX-512 or AVX-NE-CONVERT; elsewhere it is left out (n/a)
    have_onednn = onednn_bf16_supported()
    onednn = [Linear.from_linear(la, OneDnnLinearMethod(torch.bfloat16)) for la in layers] if have_onednn else []
    flops_per_row = sum(2 * n * k for n, k in SHAPES)
    print(f"{'rows':>5} {'bf16 ours':>10} {'bf16 oneDNN':>12} {'f32 packed':>11}  (ms)   GFLOP/s: ours / oneDNN / "
          "float32   ours / oneDNN")
    with torch.inference_mode():
        for rows in rows_list:
            xs = {k: torch.randn(rows, k) for k in (576, 1536)}
            a = _ms(lambda xs=xs: [m(xs[m.in_features]) for m in ours])
            b = _ms(lambda xs=xs: [m(xs[m.in_features]) for m in onednn]) if have_onednn else float("nan")
            c = _ms(lambda xs=xs: [packed_linear(xs[la.in_features], w, None, la.out_features)
                             for la, w in zip(layers, panels32)])
            g = [rows * flops_per_row / (t * 1e6) for t in (a, b, c)]
            print(f"{rows:>5} {a:>10.2f} {b:>12.2f} {c:>11.2f}         {g[0]:.0f} / {g[1]:.0f} / {g[2]:.0f}   {b / a:.2f}x")


if __name__ == "__main__":
    main()
