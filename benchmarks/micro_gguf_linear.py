"""The x16 GGUF matmul on 8-bit activations, on SmolLM2's layer shapes: time per layer and integer rate.

The decoder's four weights per layer (qkv 960 x 576, o 576 x 576, gate_up
3072 x 576, down 576 x 1536; other sizes with --hidden / --intermediate) for 30 layers (--layers), quantized by the ``gguf``
package (random weights) and interleaved as the loader does, each called
with M rows. The 30 layers' blocks (~60 MB in Q4_1) are more than the
last-level cache, so weights stream from memory as in a real step. The rate
counts 2 operations per weight per row. Pin it to one core to time the
kernel alone:

    taskset -c 0 .venv/bin/python benchmarks/micro_gguf_linear.py [--rows 1 8 32 64] [--type Q4_1 ...] [--threads 1]

Several ``--type``s are timed in turn, each line with its rate in GMAC/s (one
multiply-accumulate per weight per row): ``--type Q4_0 IQ4_NL IQ4_XS MXFP4``
puts the table-lookup types beside Q4_0. gguf has no quantizer for IQ4_NL and
IQ4_XS: their blocks are random valid ones (random nibbles and scales, fp16 d),
which run the same instructions as any others.

``--float32`` also times torch's own float32 linear (``F.linear``: MKL or
oneDNN, what vLLM's CPU build runs for float32 weights) on the same shapes
and prints the ratio: with ``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
ONEDNN_MAX_CPU_ISA=AVX2 PAGEDLLM_KERNEL_ISA=avx2`` both sides are held to AVX2.
``benchmarks/isa_peak.c`` gives the ceilings of both (instruction rates).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from pagedllm.kernels import load_kernels
from pagedllm.layers.quantization.gguf_linear import GGUF_INTERLEAVED

NUM_LAYERS = 30  # the default of --layers
# types whose blocks are random valid bytes: gguf has no quantizer (IQ4, the k-quants), or one too slow for these
# sizes (MXFP4)
RANDOM_BLOCKS = (GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS, GGMLQuantizationType.MXFP4,
                 GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)
# where a random block's fp16 scales go (the rest random bytes): d (and dmin) first, Q6_K's d last
SCALE_BYTES = {GGMLQuantizationType.Q4_K: slice(0, 4), GGMLQuantizationType.Q5_K: slice(0, 4),
               GGMLQuantizationType.Q6_K: slice(208, 210)}


def layer_shapes(hidden: int, intermediate: int) -> list[tuple[int, int]]:
    """(out, in) of a layer's four weights: qkv (SmolLM2's 3 KV heads of 9: 5/3 hidden), o, gate_up, down."""
    return [(hidden * 5 // 3, hidden), (hidden, hidden), (2 * intermediate, hidden), (hidden, intermediate)]


def _blocks(ggml_type: GGMLQuantizationType, out_features: int, in_features: int, seed: int) -> np.ndarray:
    """``[out, row bytes]`` uint8: random weights quantized by gguf, or random valid IQ4 blocks (no quantizer)."""
    rng = np.random.default_rng(seed)
    if ggml_type in RANDOM_BLOCKS:
        block_weights, block_bytes = GGML_QUANT_SIZES[ggml_type]
        raw = rng.integers(0, 256, size=(out_features, in_features // block_weights, block_bytes), dtype=np.uint8)
        if ggml_type == GGMLQuantizationType.MXFP4:
            raw[:, :, 0] = rng.integers(118, 123, size=raw.shape[:2], dtype=np.uint8)  # e: 2^-10 .. 2^-6
        else:  # d (and dmin): normal floats, not random bits (NaN, subnormals)
            where = SCALE_BYTES.get(ggml_type, slice(0, 2))
            raw[:, :, where] = np.full((where.stop - where.start) // 2, 0.001, np.float16).view(np.uint8)
        return raw.reshape(out_features, -1)
    w = rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.05
    return quantize(w, ggml_type)


def _layer(ggml_type: GGMLQuantizationType, out_features: int, in_features: int, seed: int) -> torch.Tensor:
    blocks = torch.from_numpy(np.ascontiguousarray(_blocks(ggml_type, out_features, in_features, seed)))
    block_weights, block_bytes = GGML_QUANT_SIZES[ggml_type]
    if blocks.shape[1] != in_features // block_weights * block_bytes:
        raise ValueError(f"unexpected {ggml_type.name} row of {blocks.shape[1]} bytes")
    torch.ops.pagedllm.gguf_interleave_(blocks, int(ggml_type), in_features)
    return blocks


def _best_time(fn, repeats: int) -> float:  # noqa: ANN001
    """The fastest of ``repeats`` timed calls of ``fn``, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--type", nargs="+", default=["Q4_1"],
                   choices=["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--hidden", type=int, default=576, help="hidden size (SmolLM2-135M's 576; IQ4_XS needs 256k)")
    p.add_argument("--intermediate", type=int, default=1536, help="MLP size (SmolLM2-135M's 1536)")
    p.add_argument("--layers", type=int, default=NUM_LAYERS, help="layers of the four weights (more than the last-level "
                   "cache, so that weights stream from memory)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--float32", action="store_true", help="also time torch's float32 F.linear on the same shapes")
    args = p.parse_args()
    if load_kernels() is None:
        raise SystemExit("the GGUF kernels need the native build")
    torch.set_num_threads(args.threads)
    shapes = layer_shapes(args.hidden, args.intermediate)
    # [out, in] float32 weights for torch's F.linear (~425 MB for the 30 layers: streamed from memory too)
    dense = [(torch.randn(o, i) * 0.05, i) for _ in range(args.layers) for o, i in shapes] if args.float32 else []
    for name in args.type:
        _time_type(GGMLQuantizationType[name], args, shapes, dense)


def _time_type(ggml_type: GGMLQuantizationType, args: argparse.Namespace, shapes: list[tuple[int, int]],
               dense: list[tuple[torch.Tensor, int]]) -> None:
    """One line per row count for the layers in ``ggml_type``, with torch's float32 beside them if ``dense``."""
    x16 = GGUF_INTERLEAVED[int(ggml_type)]
    layers = [(_layer(ggml_type, o, i, seed=n * 4 + j), i) for n in range(args.layers) for j, (o, i) in enumerate(shapes)]
    weights_per_layer = sum(o * i for o, i in shapes)
    for rows in args.rows:
        xs = {i: torch.randn(rows, i) for _, i in shapes}  # [rows, in_features]

        def run() -> None:
            for w, i in layers:  # noqa: B023 (run is called in this iteration only)
                torch.ops.pagedllm.gguf_linear(xs[i], w, x16, i, None)  # noqa: B023

        best = _best_time(run, args.repeats)
        macs = weights_per_layer * rows * args.layers / best / 1e9
        print(f"{ggml_type.name} x16, {rows:3d} rows, {args.threads} thread(s): {best * 1e3 / args.layers:.3f} ms per "
              f"layer, {2 * macs:.1f} G integer ops/s ({macs:.1f} GMAC/s)")
        if dense:
            dense_best = _best_time(lambda: [torch.nn.functional.linear(xs[i], w) for w, i in dense],  # noqa: B023
                                    args.repeats)
            print(f"float32 F.linear, {rows:3d} rows: {dense_best * 1e3 / args.layers:.3f} ms per layer, "
                  f"{2 * weights_per_layer * rows * args.layers / dense_best / 1e9:.1f} GFLOP/s; "
                  f"{ggml_type.name} x16 is {dense_best / best:.2f}x as fast")


if __name__ == "__main__":
    main()
