"""Weight-only int8 / int4 matmuls on SmolLM2-135M's layer shapes: ours against torch's own CPU kernels.

    .venv/bin/python benchmarks/micro_weight_only.py [--threads 2] [--rows 1 16 256]

For each shape (out x in: 576x576 o_proj, 1536x576 gate or up, 576x1536
down_proj, 49152x576 the LM head) and row count, the time of one call of:

- ``quantized_linear`` int8 (one group per channel, the default) and int4
  (groups of 128, or 64 where 128 does not divide ``in``: the group torch's
  int4 kernel takes too), ``layers/quantization/quantized_linear.py``, in the groups'
  own order (float32 activations) and interleaved (``x16``: activations
  rounded to int8, integer dot products; the engine's default);
- torch's ``aten._weight_int8pack_mm`` (int8, a scale per channel) and
  ``aten._weight_int4pack_mm_for_cpu`` (int4 with a scale and zero per
  group, weights from ``_convert_weight_to_int4pack_for_cpu``), on the same
  float32 activations the engine computes in, and on bfloat16 activations
  (their fast path; the engine would have to round its activations to bf16,
  and that rounding and the conversions are not timed here);
- float32 references: our packed panels (``linear_backend="packed"``) and
  ``F.linear`` (MKL).

Enough copies of each weight are cycled through that their float32 bytes
exceed 256 MB, so each call reads its weights from memory as a decode step
would, not from cache. Each figure is the best of three timed passes (at
least three calls and 0.3 s each; one pass for kernels slower than 0.1 s a
call).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.kernels import load_kernels
from pagedllm.layers.quantization.packed_linear import pack_weight_panels, packed_linear
from pagedllm.layers.quantization.quantized_linear import pack_groups, quantize_groups

SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]  # (out, in)
FLOAT32_BYTES = 256 << 20


def _us(fns: list[Callable[[], object]]) -> float:
    """Microseconds per call, best of three passes over the copies (each pass >= 3 calls and 0.3 s; one pass
    for a kernel slower than 0.1 s a call)."""
    best = float("inf")
    start = time.perf_counter()
    fns[0]()
    slow = time.perf_counter() - start > 0.1
    for _ in range(1 if slow else 3):
        start, calls = time.perf_counter(), 0
        while calls < 3 or time.perf_counter() - start < 0.3:
            fns[calls % len(fns)]()
            calls += 1
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def _torch_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's int4 layout of ``w``: packed weights and [in / group, out, 2] scales and zeros (w = (q - 8) s + z)."""
    q, scales, mins = quantize_groups(w, 4, group)  # the same rounding as ours: q in [0, 15], w = q s + min
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    zeros = mins + 8 * scales
    return packed, torch.stack([scales, zeros], dim=2).transpose(0, 1).contiguous()


def _shape(n: int, k: int, rows_list: list[int], lib: object) -> None:
    copies = max(1, FLOAT32_BYTES // (4 * n * k))
    group4 = 128 if k % 128 == 0 else 64
    weights = [torch.randn(n, k) for _ in range(copies)]
    kernels: dict[str, list] = {"ours8": [], "ours4": [], "ours8x16": [], "ours4x16": [], "torch8": [], "torch4": [],
                                "torch8_bf16": [], "torch4_bf16": [], "panels": []}
    for w in weights:
        q, s, _ = quantize_groups(w, 8, k)
        kernels["ours8"].append(pack_groups(q, s, None, 8))
        kernels["torch8"].append((q, s.reshape(n)))
        kernels["torch8_bf16"].append((q, s.reshape(n).bfloat16()))
        kernels["ours4"].append(pack_groups(*quantize_groups(w, 4, group4), 4))
        for bits, group in ((8, k), (4, group4)):
            interleaved = kernels[f"ours{bits}"][-1].clone()
            lib.quantized_interleave_(interleaved, bits, group, k)
            kernels[f"ours{bits}x16"].append(interleaved)
        packed, scales_zeros = _torch_int4(w, group4)
        kernels["torch4"].append((packed, scales_zeros))
        kernels["torch4_bf16"].append((packed, scales_zeros.bfloat16()))
        kernels["panels"].append(pack_weight_panels(w))
    for rows in rows_list:
        times = _times(torch.randn(rows, k), n, k, group4, kernels, weights, lib)
        cells = "  ".join(f"{name} {t:9.1f}" for name, t in times.items())
        print(f"{n:>5}x{k:<5} rows {rows:>3}  {cells}  (us)", flush=True)


def _times(x: torch.Tensor, n: int, k: int, group4: int, kernels: dict[str, list], weights: list[torch.Tensor],
           lib: object) -> dict[str, float]:
    """Microseconds per call of every kernel on activations ``x`` ``[rows, k]``."""
    int8pack, int4pack = torch.ops.aten._weight_int8pack_mm, torch.ops.aten._weight_int4pack_mm_for_cpu
    xb = x.bfloat16()
    return {
        "ours int8": _us([lambda b=b: lib.quantized_linear(x, b, 8, k, k, None) for b in kernels["ours8"]]),
        f"ours int4 g{group4}": _us([lambda b=b: lib.quantized_linear(x, b, 4, group4, k, None)
                                    for b in kernels["ours4"]]),
        "ours int8 x16": _us([lambda b=b: lib.quantized_linear(x, b, 8, k, k, None, True) for b in kernels["ours8x16"]]),
        f"ours int4 g{group4} x16": _us([lambda b=b: lib.quantized_linear(x, b, 4, group4, k, None, True)
                                        for b in kernels["ours4x16"]]),
        "torch int8pack": _us([lambda t=t: int8pack(x, *t) for t in kernels["torch8"]]),
        f"torch int4pack g{group4}": _us([lambda t=t: int4pack(x, t[0], group4, t[1]) for t in kernels["torch4"]]),
        "torch int8pack bf16": _us([lambda t=t: int8pack(xb, *t) for t in kernels["torch8_bf16"]]),
        f"torch int4pack bf16 g{group4}": _us([lambda t=t: int4pack(xb, t[0], group4, t[1])
                                              for t in kernels["torch4_bf16"]]),
        "f32 packed": _us([lambda p=p: packed_linear(x, p, None, n) for p in kernels["panels"]]),
        "f32 F.linear": _us([lambda w=w: F.linear(x, w) for w in weights]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    p.add_argument("--shapes", type=int, nargs="+", default=None, help="indices into SHAPES (default: all)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lib = load_kernels()
    if lib is None:
        raise SystemExit("the native kernels do not build here")
    with torch.inference_mode():
        for i, (n, k) in enumerate(SHAPES):
            if args.shapes is None or i in args.shapes:
                _shape(n, k, args.rows, lib)


if __name__ == "__main__":
    main()
