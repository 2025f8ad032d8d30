"""Tensor parallelism across processes on ``torch.distributed``: shard plans, the rank group, worker processes.

::

    rank 0 (the engine's process)            ranks 1..N-1 (workers)
    scheduler, block manager, sampler        the same ModelRunner, one shard
      |  StepRecord (plain data) --dispatch group broadcast-->  |
      |  forward: all-reduce after o_proj / down_proj  <------> |  (default group)
      |  logits: each rank's vocab slice --gather--> rank 0     |
    sample, update the scheduler                 wait for the next record

The bookkeeping stays single and torch-free on rank 0: every rank's KV
cache has the same number of blocks with the same ids, so one block table
addresses all of them.
"""
