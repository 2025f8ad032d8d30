"""The GGUF linear kernels on a real file's layer shapes and blocks: time per call and weight bytes read per second.

Takes the first ``--layers`` decoder layers' seven weights (q, k, v, o, gate, up,
down) and the output matrix (``output.weight``, or the tied ``token_embd.weight``)
of a GGUF file as the file stores them (a Llama-3.2-1B or 3.1-8B Q4_K_M file:
Q4_K and Q6_K), interleaves them as the loader does, and calls
``torch.ops.pagedllm.gguf_linear`` on each in a step's order with ``--rows``
rows of random activations. The layers chosen (~140 MB on the 1B file, ~250 MB
on the 8B one) are several times the last-level cache, so each call reads its
weights from memory as a real decode step does. Each call is timed on its own
(the best of ``--repeats`` passes, after one untimed pass; with one thread the
calling thread's CPU time, which leaves out the time other processes take the
core, with two the wall clock), and the calls are summed per (weight, type,
shape): per-call time, and weight bytes per second.

    PYTHONPATH=. .venv/bin/python benchmarks/micro_gguf_decode.py /work/peer-data/llama1b-q4_k_m.gguf \
        --rows 1 16 64 --threads 1 2

A/B two builds by running this with ``PYTHONPATH`` pointing at each checkout in
turn (the kernels are built per checkout), alternating them in one session:
the machine's other load moves absolute numbers, the alternation keeps the
comparison fair. The weights lie in transparent huge pages, as the engine's
loader puts them (``--small-pages``: torch's 4 KiB pages, as before that).
``--stream`` also prints the read rate of a plain
``torch.sum`` over a buffer of the same size (a read-only floor of sorts; the
repository's bandwidth probe is a C loop, see the benchmarks docs).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np
import torch
from gguf import GGUFReader

from pagedllm.kernels import load_kernels
from pagedllm.layers.quantization.gguf_linear import GGUF_INTERLEAVED
from pagedllm.runner.huge_pages import empty_weight

LAYER_WEIGHTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _load(path: str, num_layers: int, with_output: bool, huge_pages: bool) -> list[tuple[str, str, int, int, torch.Tensor, int]]:
    """(weight name, type name, out, in, interleaved blocks, kernel type) for the chosen weights, in step order;
    ``huge_pages``: each weight in transparent huge pages, as the engine's loader places it (runner/huge_pages.py)."""
    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    names = [f"blk.{i}.{w}.weight" for i in range(num_layers) for w in LAYER_WEIGHTS]
    if with_output:
        names.append("output.weight" if "output.weight" in tensors else "token_embd.weight")
    out = []
    for name in names:
        t = tensors[name]
        in_features, out_features = int(t.shape[0]), int(t.shape[1])
        data = torch.from_numpy(np.ascontiguousarray(t.data))
        blocks = empty_weight(tuple(data.shape), data.stride(), data.dtype) if huge_pages else torch.empty_like(data)
        blocks.copy_(data)
        ggml_type = int(t.tensor_type)
        kernel_type = ggml_type
        if ggml_type in GGUF_INTERLEAVED and out_features % 16 == 0:
            torch.ops.pagedllm.gguf_interleave_(blocks, ggml_type, in_features)
            kernel_type = GGUF_INTERLEAVED[ggml_type]
        short = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        out.append((short, t.tensor_type.name, out_features, in_features, blocks, kernel_type))
    return out


def _time_pass(weights: list, xs: dict[int, torch.Tensor], times: list[float], clock) -> None:  # noqa: ANN001
    """One call per weight in order, each call's time (by ``clock``) kept at its best so far in ``times``."""
    for n, (_, _, _, in_features, blocks, kernel_type) in enumerate(weights):
        x = xs[in_features]
        start = clock()
        torch.ops.pagedllm.gguf_linear(x, blocks, kernel_type, in_features, None)
        times[n] = min(times[n], clock() - start)


def _report(weights: list, times: list[float], rows: int, threads: int) -> None:
    per_kind: dict[tuple[str, str, int, int, int], list[float]] = defaultdict(list)
    for (name, type_name, out_f, in_f, blocks, _), t in zip(weights, times, strict=True):
        per_kind[(name, type_name, out_f, in_f, blocks.numel())].append(t)
    total_bytes = sum(w[4].numel() for w in weights)
    total_time = sum(times)
    for (name, type_name, out_f, in_f, nbytes), ts in per_kind.items():
        mean = sum(ts) / len(ts)
        print(f"  rows {rows:3d} threads {threads}  {name:12s} {type_name:6s} {out_f:6d} x {in_f:5d}: "
              f"{mean * 1e6:8.1f} us/call  {nbytes / mean / 1e9:6.2f} GB/s")
    print(f"  rows {rows:3d} threads {threads}  all {len(weights)} calls: {total_time * 1e3:.2f} ms, "
          f"{total_bytes / total_time / 1e9:.2f} GB/s of weights")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gguf", help="a GGUF file (Llama-shaped: blk.N.attn_q.weight ...)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers to take (default 4)")
    p.add_argument("--rows", type=int, nargs="+", default=[1])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-output", action="store_true", help="leave the output matrix out")
    p.add_argument("--stream", action="store_true", help="also time a read-only torch.sum over as many bytes")
    p.add_argument("--small-pages", action="store_true",
                   help="weights in torch's 4 KiB pages rather than the engine's huge pages")
    args = p.parse_args()
    if load_kernels() is None:
        raise SystemExit("the GGUF kernels need the native build")
    weights = _load(args.gguf, args.layers, not args.no_output, not args.small_pages)
    total_bytes = sum(w[4].numel() for w in weights)
    print(f"{args.gguf}: {len(weights)} weights, {total_bytes / 1e6:.1f} MB")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            xs = {i: torch.randn(rows, i) for i in {w[3] for w in weights}}
            times = [float("inf")] * len(weights)
            # one thread runs the call on this thread: its CPU time leaves out what other processes take
            clock = time.thread_time if threads == 1 else time.perf_counter
            _time_pass(weights, xs, [float("inf")] * len(weights), clock)
            for _ in range(args.repeats):
                _time_pass(weights, xs, times, clock)
            _report(weights, times, rows, threads)
        if args.stream:
            buf = torch.ones(total_bytes // 8, dtype=torch.int64)
            best = min(_timed(lambda: buf.sum()) for _ in range(args.repeats))  # noqa: B023
            print(f"  threads {threads}  torch.sum over {total_bytes / 1e6:.0f} MB: {total_bytes / best / 1e9:.2f} GB/s")


def _timed(fn) -> float:  # noqa: ANN001
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
