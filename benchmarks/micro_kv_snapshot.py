"""What one /kv snapshot costs the engine thread: build + JSON, on the serving benchmark's pool.

The pool and the load of ``pagedllm bench serve --num-prompts 32
--max-concurrency 32`` on the default server: 2912 blocks of 16 tokens, 32
running sequences of 128 prompt + up to 64 generated tokens, prefix caching
on. Prints the median time of ``KVSnapshotPublisher.publish`` and the share
of the engine thread it takes at the publisher's rate limit (4 a second).

    PYTHONPATH=. python benchmarks/micro_kv_snapshot.py
"""

from __future__ import annotations

import random
import statistics
import time

from pagedllm.clients.kv_publisher import DEFAULT_MIN_INTERVAL_S, KVSnapshotPublisher
from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence

NUM_BLOCKS, BLOCK_SIZE, NUM_SEQS, PROMPT, OUTPUT = 2912, 16, 32, 128, 64


class _Engine:
    """The two things the publisher reads of an LLMEngine."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()


def loaded_scheduler(num_generated: int) -> Scheduler:
    """32 prompts admitted and prefilled, then ``num_generated`` decode steps each."""
    rng = random.Random(0)
    sched = Scheduler(BlockManager(NUM_BLOCKS, BLOCK_SIZE), max_num_seqs=128, max_num_batched_tokens=8192)
    for i in range(NUM_SEQS):
        sched.add(Sequence([rng.randrange(49152) for _ in range(PROMPT)], BLOCK_SIZE, request_id=f"cmpl-{i}"))
    sched.update(sched.schedule())
    for _ in range(num_generated):
        for s in sched.running:
            s.append_token(rng.randrange(49152))
        sched.update(sched.schedule())
    return sched


def main() -> None:
    for generated in (0, OUTPUT // 2, OUTPUT):
        engine = _Engine(loaded_scheduler(generated))
        pub = KVSnapshotPublisher()
        times = []
        for _ in range(200):
            start = time.perf_counter()
            pub.publish(engine)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        share = median / DEFAULT_MIN_INTERVAL_S
        print(f"{generated:3d} tokens generated: {median * 1e3:.3f} ms per snapshot, "
              f"{len(pub.latest.body) / 1024:.1f} KiB, at most {share:.2%} of the engine thread")


if __name__ == "__main__":
    main()
