"""Joining a tensor-parallel group: the rendezvous, each rank's cores, and how the ranks were started.

Two ways to start the ranks, resolved once from ``EngineConfig.distributed_executor_backend``:

- ``mp``: the engine's process is rank 0 and starts ranks 1..N-1 itself
  (``torch.multiprocessing``, spawn) on this machine, on a free loopback port.
- ``torchrun``: ``torchrun`` started every rank (on one machine or several)
  and set ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``; rank 0
  runs the engine, the others serve its steps.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedllm.distributed.cpu_bind import parse_cpu_bind
from pagedllm.distributed.group import DistributedError, TensorParallelGroup
from pagedllm.distributed.shard_plan import ShardPlan
from pagedllm.distributed.shm_all_reduce import MAX_ROWS, ShmAllReduce
from pagedllm.loader.model_config import ModelArchConfig
from pagedllm.resolved_config import ResolvedAllReduce

__all__ = ["Rendezvous", "join_group", "launched_by_torchrun", "leave_group", "parse_cpu_bind", "pin_rank",
           "rank_threads", "torchrun_rank"]

# a worker waits this long for its next step: an idle engine is not a failure
IDLE_WAIT = datetime.timedelta(days=30)
# the longest start-up wait: every rank started, its shard loaded and its KV blocks counted
START_WAIT = datetime.timedelta(minutes=30)
# seconds the GIL is let go after leaving: gloo's threads drop their last collectives' tensors, which takes the GIL
GLOO_RELEASE_S = 0.05


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: ``size`` ranks at ``addr:port``.

    ``env`` (torchrun): through the store torchrun's agent already serves
    there (``env://``); else this process's rank 0 serves one (``tcp://``).
    """

    addr: str
    port: int
    size: int
    env: bool = False

    @property
    def init_method(self) -> str:
        return "env://" if self.env else f"tcp://{self.addr}:{self.port}"

    @classmethod
    def on_loopback(cls, size: int) -> Rendezvous:
        """A free port on 127.0.0.1, for ranks this process starts."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return cls("127.0.0.1", s.getsockname()[1], size)

    @classmethod
    def from_torchrun(cls) -> Rendezvous:
        """The rendezvous torchrun's environment names (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``)."""
        try:
            return cls(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]), env=True)
        except (KeyError, ValueError) as e:
            raise ValueError(f"distributed_executor_backend='torchrun' but torchrun's environment is incomplete: {e}") from e


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a ``torchrun`` launch."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def torchrun_rank() -> int:
    """This process's rank in a torchrun launch."""
    return int(os.environ["RANK"])


def rank_threads(num_threads: int | None, cores: list[int] | None, size: int) -> int:
    """Intra-op threads of one rank: ``num_threads`` if given, else its bound cores, else this machine's cores / size."""
    if num_threads is not None:
        return num_threads
    if cores is not None:
        return len(cores)
    return max(1, len(os.sched_getaffinity(0)) // size)


def pin_rank(cores: list[int] | None, threads: int) -> None:
    """Bind this process to ``cores`` (if given) and size torch's thread pool, before any parallel work."""
    if cores is not None:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)


def join_group(
    model_config: ModelArchConfig, rank: int, where: Rendezvous, timeout_s: float, device: torch.device,
    all_reduce: ResolvedAllReduce, max_rows: int = MAX_ROWS,
) -> TensorParallelGroup:
    """Meet the other ranks and build this rank's groups: start-up, the steps' collectives, step dispatch.

    A step's collectives wait at most ``timeout_s``; on the dispatch group
    rank 0 does too, while a worker waits for its next step as long as the
    engine idles. Start-up waits up to ``START_WAIT`` for the slowest rank.
    ``all_reduce``: ``ResolvedConfig.all_reduce_backend``, "shm" (shared
    memory for tensors of up to ``max_rows`` rows) or "gloo" (the process
    group: gloo, NCCL on a GPU). Each rank resolved it for itself; meeting,
    the ranks check that they agree and, for "shm", that they share one host
    (ValueError on every rank otherwise).
    """
    plan = ShardPlan.make(model_config, rank, where.size)
    if dist.is_initialized():
        raise ValueError("this process is already in a tensor-parallel group (one tensor-parallel engine per "
                         "process): shut the other engine down first")
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        # the start-up group waits for every rank to start and load its shard (minutes for a large model)
        dist.init_process_group(backend, init_method=where.init_method, rank=rank, world_size=where.size,
                                timeout=START_WAIT)
        collectives = dist.new_group(backend=backend, timeout=timeout)
        dispatch = dist.new_group(backend="gloo", timeout=timeout if rank == 0 else IDLE_WAIT)
    except (RuntimeError, ValueError) as e:
        raise DistributedError(f"rank {rank} could not join the tensor-parallel group at {where.addr}:{where.port}: {e}") from e
    shm = None
    if device.type == "cpu":
        capacity = min(max_rows, MAX_ROWS) * model_config.hidden_size
        try:
            shm = ShmAllReduce.create(dist.group.WORLD, rank, where.size, capacity, timeout_s, all_reduce == "shm")
        except ValueError:
            leave_group()
            raise
        if shm is None and all_reduce == "shm":
            leave_group()
            raise ValueError("all_reduce_backend resolved to 'shm', but the ranks met on more than one host or "
                             "without the native kernels on every rank")
    return TensorParallelGroup(plan, collectives, dispatch, dist.group.WORLD, shm)


def leave_group() -> None:
    """Tear this process's process groups down (no-op when none is up).

    A gloo thread that ran the last collective drops its tensors after the
    caller's wait returned, and dropping a tensor made in Python takes the
    GIL. Should the interpreter start finalizing first, that thread is ended
    by a forced unwind through C++: ``std::terminate``, SIGABRT at exit. So
    this lets the GIL go a moment, while the interpreter is alive, for those
    threads (already waiting on it) to finish.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
        time.sleep(GLOO_RELEASE_S)
