"""The tensor-parallel group of one rank: its shard plan and the collectives the model and runner call.

Three process groups (gloo on the CPU, NCCL on CUDA for the collectives):

- ``group`` carries the forward pass's all-reduces and the logits gather.
  Every rank waits at most ``timeout`` on each, so a rank that hangs stops
  the others with an error instead of a deadlock.
- ``dispatch`` (gloo) carries each step's record from rank 0 to the
  workers. Rank 0 waits at most ``timeout`` for a worker to take it; a
  worker waits for the next step as long as the engine is idle (its own
  side of the group has no practical timeout). A rank that dies closes its
  connections, so the others' waits fail at once.

- small all-reduces between ranks of one machine go through shared memory
  instead (``shm``, ``distributed/shm_all_reduce.py``), with the same bound;
- ``startup`` carries the exchanges while the ranks load (how many KV
  blocks every rank holds); it waits as long as the slowest rank loads.

Any failure of a collective raises ``DistributedError``: the ranks are out
of step from then on, and the engine stops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pagedllm.distributed.shard_plan import ShardPlan
from pagedllm.distributed.shm_all_reduce import ShmAllReduce


class DistributedError(RuntimeError):
    """A tensor-parallel rank died, hung past the timeout, or its collective failed; the engine cannot go on."""


@dataclass(frozen=True)
class TensorParallelGroup:
    """One rank's view of the tensor-parallel group (``plan.size`` ranks, this one ``plan.rank``)."""

    plan: ShardPlan
    group: Any = None  # torch.distributed ProcessGroup of the collectives; None when size == 1
    dispatch: Any = None  # the ProcessGroup rank 0 sends step records on
    startup: Any = None  # the ProcessGroup of start-up exchanges, with a long timeout (ranks load at their pace)
    shm: ShmAllReduce | None = None  # all-reduce through shared memory (ranks on one machine), else None

    @property
    def rank(self) -> int:
        return self.plan.rank

    @property
    def size(self) -> int:
        return self.plan.size

    @property
    def is_driver(self) -> bool:
        """Rank 0: the one that schedules, samples and returns outputs."""
        return self.plan.rank == 0

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        if self.size > 1:
            try:
                if self.shm is not None and self.shm.fits(x):
                    self.shm.all_reduce_(x)
                else:
                    dist.all_reduce(x, group=self.group)
            except RuntimeError as e:
                raise DistributedError(f"tensor-parallel all-reduce failed on rank {self.rank}: {e}") from e
        return x

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor | None:
        """Every rank's logits ``[n, its vocab rows]`` side by side on rank 0: ``[n, vocab]``; None on the others."""
        if self.size == 1:
            return local
        width = max(self.plan.vocab_sizes)
        padded = local if local.shape[1] == width else torch.nn.functional.pad(local, (0, width - local.shape[1]))
        parts = [torch.empty_like(padded) for _ in range(self.size)] if self.is_driver else None
        try:
            dist.gather(padded.contiguous(), parts, dst=0, group=self.group)
        except RuntimeError as e:
            raise DistributedError(f"tensor-parallel logits gather failed on rank {self.rank}: {e}") from e
        if parts is None:
            return None
        return torch.cat([p[:, :n] for p, n in zip(parts, self.plan.vocab_sizes)], dim=1)

    def min_int(self, value: int) -> int:
        """The smallest ``value`` any rank has (e.g. the KV blocks every rank's memory holds)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.startup)
        except RuntimeError as e:
            raise DistributedError(f"tensor-parallel start-up failed on rank {self.rank}: {e}") from e
        return int(t.item())

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (the same length on each), by rank: for start-up figures such as bytes held."""
        mine = torch.tensor(values, dtype=torch.int64)
        if self.size == 1:
            return [values]
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        try:
            dist.all_gather(parts, mine, group=self.startup)
        except RuntimeError as e:
            raise DistributedError(f"tensor-parallel start-up failed on rank {self.rank}: {e}") from e
        return [p.tolist() for p in parts]

    def broadcast_record(self, record: Any = None) -> Any:
        """Rank 0 sends ``record`` (plain picklable data) to every worker; a worker gets it (blocks until then)."""
        box = [record]
        try:
            dist.broadcast_object_list(box, src=0, group=self.dispatch)
        except RuntimeError as e:
            raise DistributedError(f"sending a step to the tensor-parallel workers failed on rank {self.rank}: {e}") from e
        return box[0]
