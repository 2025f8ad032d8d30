"""``pagedllm bench collectives``: what one tensor-parallel step's communication costs.

Two (or ``--ranks``) processes on this machine join a gloo group, as
tensor-parallel ranks do, and time the all-reduce of ``[rows, hidden]``
float32 tensors (the partial sums a row-parallel layer, o_proj or
down_proj, hands over) two ways: gloo's ``all_reduce`` over loopback, and
the shared-memory all-reduce (``distributed/shm_all_reduce.py``). Each
shared-memory result is checked against gloo's on the same inputs. A Llama-family step makes ``2 * num_layers + 1`` of them (one
after each row-parallel layer, one after the vocabulary-split embedding)
plus one logits gather, so ``--layers`` turns the figure into a per-step
overhead. Each rank runs one thread; the ranks share the machine's cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedllm.distributed.shm_all_reduce import MAX_ROWS, ShmAllReduce


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--hidden", type=int, default=576, help="hidden size (SmolLM2-135M: 576)")
    p.add_argument("--layers", type=int, default=30, help="decoder layers, for the per-step figure")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 2048], help="tokens in the step")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--json", action="store_true", help="end with one JSON line of results")


def _time(fn: object, iters: int) -> float:
    """Microseconds per call of ``fn()``: ``iters`` calls back to back after one barrier, in 5 rounds, the
    best round. Back to back, each call waits for the other ranks' same call, as a model's layers do; a
    barrier before each call would time how unevenly the ranks leave the barrier instead."""
    for _ in range(10):
        fn()
    rounds = []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        rounds.append((time.perf_counter() - start) / iters)
    return min(rounds) * 1e6


def _rank(rank: int, size: int, port: int, shape: tuple[list[int], int, int], out: mp.Queue) -> None:
    all_rows, hidden, iters = shape
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=120))
    shm = ShmAllReduce.create(dist.group.WORLD, rank, size, max(all_rows) * hidden, 60.0)
    results = {}
    for rows in all_rows:
        torch.manual_seed(rank * 1000 + rows)
        x = torch.randn(rows, hidden)  # [rows, hidden]: one row-parallel layer's partial sums
        gloo_us = _time(lambda x=x: dist.all_reduce(x.clone()), iters)
        shm_us, error = None, None
        if shm is not None:
            shm_us = _time(lambda x=x: shm.all_reduce_(x.clone()), iters)
            a, b = x.clone(), x.clone()
            dist.all_reduce(a)
            shm.all_reduce_(b)
            error = float((a - b).abs().max())
        results[rows] = (gloo_us, shm_us, error)
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
    print(f"all-reduce, {args.ranks} ranks, float32 [rows, {args.hidden}], {args.iters} back to back, best of 5 "
          f"(copy of the input included); shared memory summed up to {MAX_ROWS} rows in the engine")
    print(f"{'rows':>6} {'gloo us':>9} {'shm us':>9} {'gloo/shm':>9} {'max |gloo - shm|':>17} "
          f"{'gloo ms/step':>13} {'shm ms/step':>12}   ({per_step} all-reduces a step)")
    for rows, (gloo, shm, err) in results.items():
        shm_s = f"{shm:9.1f}" if shm is not None else f"{'-':>9}"
        ratio = f"{gloo / shm:9.1f}" if shm else f"{'-':>9}"
        per = f"{shm * per_step / 1000:12.2f}" if shm is not None else f"{'-':>12}"
        print(f"{rows:>6} {gloo:>9.1f} {shm_s} {ratio} {err if err is not None else '-':>17} "
              f"{gloo * per_step / 1000:>13.2f} {per}")
    summary = {"ranks": args.ranks, "hidden": args.hidden, "layers": args.layers,
               "us_per_all_reduce": {str(k): {"gloo": round(g, 1), "shm": None if m is None else round(m, 1)}
                                     for k, (g, m, _) in results.items()}}
    if args.json:
        print(json.dumps(summary))
    return summary
