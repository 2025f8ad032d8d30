"""Rank 0's tensor-parallel ranks over an engine's life: started with it, checked before every step, stopped once.

``tp_workers.py`` says what the ranks are (the worker processes rank 0
spawns, or the torchrun ranks it meets) and what a worker runs; this module
is the lifecycle the engine drives::

    start        the other ranks start (or are met) and join the group with rank 0
    check        before each step: a worker that exited fails the engine (DistributedError)
    fail         a rank failed mid-step: the others are killed, not asked; every later step raises
    shutdown     the ranks are asked to leave, then the group is left

The stop runs once, whichever comes first: ``shutdown()``, a failure, or
the executor (with its engine) being collected or the process exiting
(a ``weakref.finalize``). In one process there is no executor: the engine
runs its runner alone.
"""

from __future__ import annotations

import logging
import weakref

from pagedllm.config import EngineConfig
from pagedllm.distributed.group import DistributedError, TensorParallelGroup
from pagedllm.distributed.launch import leave_group
from pagedllm.loader.model_config import ModelArchConfig
from pagedllm.runner.tp_workers import TensorParallelWorkers, start_tensor_parallel

logger = logging.getLogger(__name__)


def _release_ranks(workers: TensorParallelWorkers, tp: TensorParallelGroup, healthy: list[bool]) -> None:
    """Stop the other ranks and leave the group. Healthy ranks are asked to leave (under torchrun,
    ranks on other machines end cleanly too); after a failure they are killed."""
    if healthy[0]:
        try:
            tp.broadcast_record(None)  # the workers' serve_steps return
            workers.stop()
        except DistributedError:
            pass
    workers.stop(grace_s=0.0)
    leave_group()


class TensorParallelExecutor:
    """The other tensor-parallel ranks of rank 0's engine, and whether they can still run a step.

    Args:
        config: the engine's configuration (``tensor_parallel_size > 1``).
        model_config: the model's architecture, which the group's shards follow.
    """

    def __init__(self, config: EngineConfig, model_config: ModelArchConfig) -> None:
        self.group, self.workers = start_tensor_parallel(config, model_config)
        # set once a rank failed or the engine shut down: the ranks are out of step, no step may run again
        self.dead: DistributedError | None = None
        self._healthy = [True]  # False once a rank failed: the others are killed, not asked
        # an engine dropped without shutdown() still stops its ranks and leaves the group; the callback
        # holds the workers and the group, not the executor, so it does not keep it alive
        self._release = weakref.finalize(self, _release_ranks, self.workers, self.group, self._healthy)

    def stop(self, graceful: bool) -> None:
        """Stop the other ranks: ask them to leave (``graceful``) or kill them; then leave the group. Once."""
        self._healthy[0] = graceful
        self._release()  # runs once

    def shutdown(self) -> None:
        """Ask the ranks to leave; every later ``check`` raises. No-op once dead."""
        if self.dead is None:
            self.dead = DistributedError("the engine was shut down")
            self.stop(graceful=True)

    def check(self) -> None:
        """DistributedError if a rank has failed (or the engine was shut down)."""
        if self.dead is not None:
            raise self.dead
        try:
            self.workers.check()
        except DistributedError as e:
            self.fail(e)

    def fail(self, error: DistributedError) -> None:
        """A rank failed: stop every rank, remember why, raise ``error``."""
        logger.error("tensor parallelism failed, the engine stops: %s", error)
        self.dead = error
        self.stop(graceful=False)
        raise error
