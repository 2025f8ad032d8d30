"""The step record's per-step cost at 64 decoding sequences: build, pickle, bytes (issue 32).

Drives the real scheduler and block manager without a model (sampled tokens
come from a seeded stream), so it measures only the bookkeeping: building
each decode step's record, and pickling it as it crosses to tensor-parallel
ranks. Runs against the code it is imported with: the incremental record
(``StepRecordBuilder``, with the runner's ``SequenceStates.apply`` timed too,
the work it moved to the runner) or, at an older commit, the whole record
(``build_step_record``)::

    PYTHONPATH=$PWD python benchmarks/step_record_cost.py
    git worktree add /tmp/record-base 39989f9
    PYTHONPATH=/tmp/record-base python benchmarks/step_record_cost.py   # the record sent whole

Prints the median of ``STEPS`` decode steps (contexts of 32-256 tokens at the
start), without and with penalties (the repetition penalty reads the prompt,
the frequency penalty the outputs).
"""

from __future__ import annotations

import os
import pickle
import random
import statistics
import time
from collections.abc import Callable

from pagedllm import SamplingParams
from pagedllm.engine import step_builder
from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence
from pagedllm.step_record import LogitsRules, StepRecord

NUM_SEQS = int(os.environ.get("NUM_SEQS", "64"))
STEPS = int(os.environ.get("STEPS", "50"))
BLOCK_SIZE = 16


def _builder() -> tuple[str, Callable[..., StepRecord], Callable[[StepRecord], object]]:
    """(which record, its build function, the runner's apply or a no-op)."""
    if hasattr(step_builder, "StepRecordBuilder"):
        from pagedllm.runner.sequence_states import SequenceStates

        builder, states = step_builder.StepRecordBuilder(), SequenceStates()
        return "incremental", builder.build, states.apply
    return "whole", step_builder.build_step_record, lambda record: None


def measure(penalties: bool, seed: int = 0) -> dict[str, float]:
    """Median build, pickle, unpickle and apply times (ms) and pickled bytes of ``STEPS`` decode steps."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=NUM_SEQS * (256 + STEPS + 64) // BLOCK_SIZE, block_size=BLOCK_SIZE)
    sched = Scheduler(bm, max_num_seqs=NUM_SEQS, max_num_batched_tokens=NUM_SEQS * 256)
    for i in range(NUM_SEQS):
        prompt = [rng.randrange(1, 32000) for _ in range(rng.randrange(32, 257))]
        sched.add(Sequence(prompt, BLOCK_SIZE, request_id=str(i), rng=random.Random(i)))
    params = SamplingParams(temperature=0.8, max_tokens=None, ignore_eos=True)
    rules = LogitsRules(repetition_penalty=1.1, frequency_penalty=0.2) if penalties else None
    kind, build, apply = _builder()
    build_ms, pickle_ms, unpickle_ms, apply_ms, sizes = [], [], [], [], []
    step = 0
    while step < STEPS:
        out = sched.schedule()
        num = len(out.scheduled)
        t0 = time.perf_counter()
        record = build(out, [params] * num, [None] * num, [rules] * num)
        t1 = time.perf_counter()
        data = pickle.dumps(record)
        t2 = time.perf_counter()
        received = pickle.loads(data)
        t3 = time.perf_counter()
        apply(received)
        t4 = time.perf_counter()
        decoding = all(s.num_new_tokens == 1 and not s.is_prefill for s in out.scheduled) and num == NUM_SEQS
        if decoding:  # the prompts' steps are not what runs every step
            build_ms.append((t1 - t0) * 1e3)
            pickle_ms.append((t2 - t1) * 1e3)
            unpickle_ms.append((t3 - t2) * 1e3)
            apply_ms.append((t4 - t3) * 1e3)
            sizes.append(len(data))
            step += 1
        sched.update(out)
        for s in out.scheduled:
            if s.samples:
                s.seq.append_token(rng.randrange(1, 32000))
    return {
        "kind": kind,
        "build_ms": statistics.median(build_ms),
        "pickle_ms": statistics.median(pickle_ms),
        "unpickle_ms": statistics.median(unpickle_ms),
        "apply_ms": statistics.median(apply_ms),
        "kb": statistics.median(sizes) / 1e3,
    }


def main() -> None:
    for penalties in (False, True):
        r = measure(penalties)
        print(
            f"{r['kind']:>11} record, {NUM_SEQS} decoding sequences, penalties {'on ' if penalties else 'off'}: "
            f"build {r['build_ms']:.3f} ms + pickle {r['pickle_ms']:.3f} ms, {r['kb']:.1f} KB a step; "
            f"runner: unpickle {r['unpickle_ms']:.3f} ms + apply to its state {r['apply_ms']:.3f} ms"
        )


if __name__ == "__main__":
    main()
