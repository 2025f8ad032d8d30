"""``pagedllm bench collectives``: what one tensor-parallel step's communication costs.

Two (or ``--ranks``) processes on this machine join a gloo group, as
tensor-parallel ranks do, and time ``all_reduce`` of ``[rows, hidden]``
float32 tensors: the partial sums a row-parallel layer (o_proj, down_proj)
hands over. A Llama-family step makes ``2 * num_layers + 1`` of them (one
after each row-parallel layer, one after the vocabulary-split embedding)
plus one logits gather, so ``--layers`` turns the figure into a per-step
overhead. Each rank runs one thread; the ranks share the machine's cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--hidden", type=int, default=576, help="hidden size (SmolLM2-135M: 576)")
    p.add_argument("--layers", type=int, default=30, help="decoder layers, for the per-step figure")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 2048], help="tokens in the step")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--json", action="store_true", help="end with one JSON line of results")


def _rank(rank: int, size: int, port: int, shape: tuple[list[int], int, int], out: mp.Queue) -> None:
    all_rows, hidden, iters = shape
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=120))
    results = {}
    for rows in all_rows:
        x = torch.randn(rows, hidden)  # [rows, hidden]: one row-parallel layer's partial sums
        for _ in range(10):
            dist.all_reduce(x)
        times = []
        for _ in range(iters):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - start)
        results[rows] = statistics.median(times) * 1e6
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict:
    """Time the all-reduces; print a table and return the figures (microseconds by rows)."""
    if args.ranks < 2 or args.hidden < 1 or args.iters < 1:
        raise ValueError("--ranks must be >= 2, --hidden and --iters >= 1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, (list(args.rows), args.hidden, args.iters), out)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    results = out.get(timeout=600)
    for p in procs:
        p.join()
    per_step = 2 * args.layers + 1
    print(f"gloo all_reduce, {args.ranks} ranks, float32 [rows, {args.hidden}], median of {args.iters}:")
    print(f"{'rows':>6} {'us / all-reduce':>16} {'MB/s':>9} {f'ms / step ({per_step} all-reduces)':>30}")
    for rows, us in results.items():
        mb_s = rows * args.hidden * 4 / us
        print(f"{rows:>6} {us:>16.1f} {mb_s:>9.1f} {us * per_step / 1000:>30.2f}")
    summary = {"ranks": args.ranks, "hidden": args.hidden, "layers": args.layers,
               "us_per_all_reduce": {str(k): round(v, 1) for k, v in results.items()}}
    if args.json:
        print(json.dumps(summary))
    return summary
