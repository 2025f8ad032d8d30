"""The all-reduce of ranks on one machine through shared memory (``kernels/shm_allreduce.cpp``).

gloo over loopback takes about 0.5 ms per all-reduce of a decode step's few
KB, most of it latency, and a step makes two per layer (BENCHMARKS.md).
Ranks on one machine can instead copy their partial sums into a file in
/dev/shm that all of them have mapped and add them up there: a few
microseconds. The native op spins on flags in that memory (a pause
instruction, then yielding), bounded by the step timeout, and notices a
peer whose process has exited.

Tensors larger than the slots (long prefill steps) and ranks on different
machines use the process group's all-reduce (gloo), which stays the
fallback and the tests' oracle.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedllm.kernels import load_kernels

# rows of the largest tensor summed in shared memory: a decode step's, or a short prefill's
MAX_ROWS = 256
_FLAGS_BYTES = 64  # the flags sit in the file's first cache line(s), the slots after them


@dataclass(frozen=True)
class ShmAllReduce:
    """One rank's handle on the shared slots.

    ``slots`` ``[2, ranks, capacity]`` float32 and ``flags`` ``[ranks]``
    int64 are views of one shared file; ``pids`` ``[ranks]`` the ranks'
    processes (a dead one fails the wait early).
    """

    slots: torch.Tensor
    flags: torch.Tensor
    pids: torch.Tensor
    rank: int
    timeout_s: float

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is summed here (float32, contiguous, within the slots) rather than by gloo."""
        return x.dtype == torch.float32 and x.is_contiguous() and x.numel() <= self.slots.shape[2] and x.device.type == "cpu"

    def all_reduce_(self, x: torch.Tensor) -> None:
        """Sum ``x`` over the ranks, in place (every rank must call with the same shape, in the same order)."""
        torch.ops.pagedllm.shm_all_reduce(x, self.slots, self.flags, self.pids, self.rank, self.timeout_s)

    @classmethod
    def create(
        cls, startup: object, rank: int, size: int, capacity: int, timeout_s: float, wanted: bool = True,
    ) -> ShmAllReduce | None:
        """Map the shared slots on every rank (a collective on ``startup``); None, on every rank, when the ranks
        are on different machines, the native kernels are missing on any of them, or no rank ``wanted`` them.

        Every rank calls it, whatever it resolved, so that ranks which resolved differently (ValueError on
        every rank) never leave one waiting in a collective the others skip.
        """
        usable = load_kernels() is not None and os.path.isdir("/dev/shm")
        facts: list[object] = [None] * size
        dist.all_gather_object(facts, (socket.gethostname(), usable, os.getpid(), wanted), group=startup)
        if len({want for *_, want in facts}) != 1:
            raise ValueError(f"the ranks resolved all_reduce_backend differently (shm wanted by rank(s) "
                             f"{[r for r, (*_, want) in enumerate(facts) if want]} only)")
        if not wanted or len({host for host, *_ in facts}) != 1 or not all(ok for _, ok, *_ in facts):
            return None
        nbytes = _FLAGS_BYTES + 2 * size * capacity * 4
        box = [f"/dev/shm/pagedllm-tp-{uuid.uuid4().hex}" if rank == 0 else None]
        if rank == 0:
            with open(box[0], "wb") as f:
                f.truncate(nbytes)  # zero-filled: every flag starts at 0
        dist.broadcast_object_list(box, src=0, group=startup)
        try:
            memory = torch.from_file(box[0], shared=True, size=nbytes, dtype=torch.uint8)
        finally:
            dist.barrier(group=startup)
            if rank == 0:
                os.unlink(box[0])  # mapped everywhere: nothing is left in /dev/shm, even after a crash
        flags = memory[: size * 8].view(torch.int64)  # [ranks]
        slots = memory[_FLAGS_BYTES:].view(torch.float32).view(2, size, capacity)  # [2, ranks, capacity]
        pids = torch.tensor([pid for _, _, pid, _ in facts], dtype=torch.int64)  # [ranks]
        return cls(slots, flags, pids, rank, timeout_s)
