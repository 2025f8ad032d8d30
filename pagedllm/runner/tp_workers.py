"""Tensor-parallel ranks: rank 0's handle on the worker processes, and what a worker process runs.

A worker builds the same ``ModelRunner`` as rank 0, over its own shard
(``distributed/shard_plan.py``), then runs every step rank 0 sends
(``ModelRunner.serve_steps``) until rank 0 says stop, or dies. Rank 0
checks before each step that every worker it started is alive; a worker
that dies or hangs mid-step fails the step's collective (at once, or after
``distributed_timeout_s``), and the engine stops with ``DistributedError``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.multiprocessing as mp

from pagedllm.config import EngineConfig
from pagedllm.distributed.group import DistributedError, TensorParallelGroup
from pagedllm.distributed.launch import (
    Rendezvous,
    join_group,
    leave_group,
    parse_cpu_bind,
    pin_rank,
    rank_threads,
    torchrun_rank,
)
from pagedllm.loader import iter_weights, load_model_config
from pagedllm.loader.model_config import ModelArchConfig
from pagedllm.resolved_config import resolve_config
from pagedllm.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# seconds a worker is given to leave after rank 0 says stop, then it is terminated, then killed
STOP_GRACE_S = 10.0


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The device of ``rank``: the CPU, or GPU ``rank`` (one per rank) on CUDA."""
    return torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")


def run_worker(config: EngineConfig, rank: int, where: Rendezvous, cores: list[int] | None) -> None:
    """Rank ``rank``'s whole life: pin, join the group, load its shard, serve rank 0's steps, leave."""
    pin_rank(cores, rank_threads(config.num_threads, cores, where.size))
    model_config = load_model_config(config.model)
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp = join_group(model_config, rank, where, config.distributed_timeout_s, device,
                    resolve_config(config).all_reduce_backend, config.max_num_batched_tokens)
    try:
        runner = ModelRunner(config, model_config, iter_weights(config.model, model_config), tp)
        runner.serve_steps()
    finally:
        leave_group()


def end_worker_process(code: int) -> NoReturn:
    """End a worker rank's process now, with exit status ``code``, skipping the interpreter's finalization.

    A worker's last broadcast (rank 0's stop) can still be released by one of
    gloo's threads after the process groups are left; that release takes the
    GIL to drop a tensor, and an interpreter that is finalizing ends such a
    thread with a forced unwind: ``std::terminate``, SIGABRT. The worker has
    nothing left to finish (its shared memory is already unlinked), so it
    flushes its output and logs and exits at once.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing to flush
            pass
    os._exit(code)


def serve_torchrun_rank(config: EngineConfig) -> None:
    """A torchrun rank other than 0: serve rank 0's steps until it stops (it runs the engine)."""
    where = Rendezvous.from_torchrun()
    if where.size != config.tensor_parallel_size:
        raise ValueError(f"torchrun started {where.size} ranks for tensor_parallel_size={config.tensor_parallel_size}")
    rank = torchrun_rank()
    binds = parse_cpu_bind(config.cpu_bind, where.size)
    run_worker(config, rank, where, binds[rank] if binds else None)


def is_torchrun_worker(config: EngineConfig) -> bool:
    """Whether this process is a torchrun rank other than 0 of a tensor-parallel engine."""
    return config.tensor_parallel_size > 1 and resolve_config(config).distributed_executor_backend == "torchrun" and torchrun_rank() != 0


def _worker_entry(config: EngineConfig, rank: int, where: Rendezvous, cores: list[int] | None) -> None:
    """A spawned worker's entry: ``run_worker``, exiting 1 with the reason when it fails."""
    logging.basicConfig(level=logging.WARNING, format=f"[tp rank {rank}] %(levelname)s %(name)s: %(message)s")
    try:
        run_worker(config, rank, where, cores)
    except BaseException as e:  # rank 0 died or said nothing for too long, or loading failed: leave
        logger.error("tensor-parallel worker rank %d stops: %s", rank, e)
        end_worker_process(1)
    end_worker_process(0)


@dataclass
class TensorParallelWorkers:
    """The worker processes rank 0 started (none under torchrun, which started them)."""

    processes: list[mp.Process]

    def check(self) -> None:
        """DistributedError naming the first worker that has exited."""
        for rank, p in enumerate(self.processes, start=1):
            if p.exitcode is not None:
                raise DistributedError(f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.exitcode} "
                                       "(its error is above in the log)")

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Wait for the workers to leave (after rank 0 said stop), then terminate, then kill what is left."""
        for p in self.processes:
            p.join(grace_s)
        for p in self.processes:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()


def start_tensor_parallel(
    config: EngineConfig, model_config: ModelArchConfig
) -> tuple[TensorParallelGroup, TensorParallelWorkers]:
    """Rank 0's start: start (or, under torchrun, meet) the other ranks and join the group with them."""
    size = config.tensor_parallel_size
    executor = resolve_config(config).distributed_executor_backend
    binds = parse_cpu_bind(config.cpu_bind, size)
    if executor == "torchrun":
        where = Rendezvous.from_torchrun()
        if where.size != size or torchrun_rank() != 0:
            raise ValueError(f"torchrun started {where.size} ranks (this is rank {torchrun_rank()}) for "
                             f"tensor_parallel_size={size}; ranks other than 0 run run_worker, not the engine")
        processes: list[mp.Process] = []
    else:
        where = Rendezvous.on_loopback(size)
        ctx = mp.get_context("spawn")
        processes = [
            ctx.Process(target=_worker_entry, args=(config, rank, where, binds[rank] if binds else None),
                        name=f"pagedllm-tp{rank}", daemon=True)
            for rank in range(1, size)
        ]
        for p in processes:
            p.start()
    workers = TensorParallelWorkers(processes)
    try:
        cores = binds[0] if binds else None
        pin_rank(cores, rank_threads(config.num_threads, cores, size))
        tp = _join_watching(workers, model_config, where, config)
    except BaseException:
        workers.stop(grace_s=0.0)
        raise
    return tp, workers


def _join_watching(
    workers: TensorParallelWorkers, model_config: ModelArchConfig, where: Rendezvous, config: EngineConfig
) -> TensorParallelGroup:
    """Rank 0 joins the group while watching its workers: one that exits while starting (a script with
    no ``if __name__ == "__main__":`` guard, a shard that does not load) fails the start at once rather
    than after the rendezvous times out."""
    joined: list[TensorParallelGroup | BaseException] = []

    def join() -> None:
        try:
            joined.append(join_group(model_config, 0, where, config.distributed_timeout_s, rank_device(config, 0),
                                     resolve_config(config).all_reduce_backend, config.max_num_batched_tokens))
        except BaseException as e:  # handed to the waiting thread
            joined.append(e)

    thread = threading.Thread(target=join, name="pagedllm-tp-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
        workers.check()
    if isinstance(joined[0], BaseException):
        raise joined[0]
    return joined[0]
