"""Many-stream greedy decode: each decode step's CPU and wall time, and a hash of every stream's tokens.

The instrument for issue 48's many-stream work on a loaded machine: N requests
of PROMPT random tokens arrive at once (prefix caching off), each generates
OUTPUT tokens greedily with EOS ignored; the steps in which every stream
decodes (the prefill steps left out) are timed. With ``--threads 1`` the
process's CPU time per step (``time.process_time``) leaves out the time other
processes hold the core, so two checkouts run alternated give an A/B that
holds up under load. The token hash checks that a change kept the bits (batch
invariance: a stream's tokens do not depend on its batch-mates either way).

    PYTHONPATH=<checkout> .venv/bin/python benchmarks/streams_step_cpu.py /work/peer-data/llama1b-q4_k_m.gguf \\
        --streams 64 --output 32 --threads 1 [--phases] [--torch-profile]

A profile of the decode steps alone (the prefill steps left out):

    mkfifo /tmp/ctl && PYTHONPATH=<checkout> perf record -F 999 -D -1 --control=fifo:/tmp/ctl -o perf.data \\
        .venv/bin/python benchmarks/streams_step_cpu.py FILE --streams 64 --threads 1 --runs 1 --perf-ctl /tmp/ctl

``--phases`` wraps the runner's and engine's step phases in wall-clock timers
(from outside; the engine carries no profiling code) and prints each phase's
share of the whole run's wall time (prefill steps included).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import time
import types
from collections import defaultdict


def _timed(table: dict, name: str, fn):  # noqa: ANN001, ANN202
    def wrapper(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        start = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            table[name] += time.perf_counter() - start

    return wrapper


def _wrap_phases(engine, table: dict) -> None:  # noqa: ANN001
    """Per-phase wall-clock timers around the runner's and engine's methods (instance attributes)."""
    runner = engine.model_runner
    for obj, names in ((engine, ("_execute", "_process")), (engine.step_records, ("build",)),
                       (engine.scheduler, ("schedule", "update")), (runner, dir(runner))):
        for name in names:
            # methods only (a property's getter is not run here)
            if name.startswith("__") or not isinstance(getattr(type(obj), name, None), types.FunctionType):
                continue
            setattr(obj, name, _timed(table, f"{type(obj).__name__}.{name}", getattr(obj, name)))


def _run(engine, params, prompts: list[list[int]], perf_ctl: str | None = None) -> tuple[list[float], list[float], list]:  # noqa: ANN001, E501
    """Every request to its end: the CPU and wall seconds of the steps that decode all of them, the outputs.

    ``perf_ctl``: a ``perf record --control=fifo:...`` control fifo, enabled from the second all-decode step
    on (the prefill steps stay out of the profile)."""
    for prompt in prompts:
        engine.add_request(engine.new_request_id(), {"prompt_token_ids": prompt}, params)
    schedule, plans = engine._schedule, []

    def recording_schedule():  # noqa: ANN202
        plans.append(schedule())
        return plans[-1]

    engine._schedule = recording_schedule
    cpu, wall, finished = [], [], []
    try:
        while engine.has_unfinished_requests():
            cpu_start, wall_start = time.process_time(), time.perf_counter()
            outputs = engine.step()
            elapsed_cpu, elapsed_wall = time.process_time() - cpu_start, time.perf_counter() - wall_start
            plan = plans[-1]
            if len(plan.scheduled) == len(prompts) and plan.num_batched_tokens == len(prompts):
                cpu.append(elapsed_cpu)
                wall.append(elapsed_wall)
                if perf_ctl is not None and len(cpu) == 1:
                    _perf(perf_ctl, "enable")
            finished.extend(o for o in outputs if o.finished)
    finally:
        del engine._schedule
        if perf_ctl is not None:
            _perf(perf_ctl, "disable")
    return cpu, wall, finished


def _perf(fifo: str, command: str) -> None:
    with open(fifo, "w") as f:
        f.write(command + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a GGUF file or model folder")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--output", type=int, default=32, help="tokens each stream generates")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--runs", type=int, default=2, help="timed runs (after one warm-up run)")
    p.add_argument("--phases", action="store_true", help="time the step's phases (adds a little overhead)")
    p.add_argument("--torch-profile", action="store_true", help="torch.profiler's top ops over one run")
    p.add_argument("--perf-ctl", default=None,
                   help="control fifo of `perf record -D -1 --control=fifo:FIFO`: only the decode steps recorded")
    args = p.parse_args()

    from pagedllm.engine.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    llm = LLM(args.model, max_model_len=args.prompt_len + args.output + 16, num_threads=args.threads,
              max_num_seqs=args.streams, enable_prefix_caching=False)
    engine = llm.llm_engine
    engine.model_runner.warm_up()
    params = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.streams)]
    _run(engine, params, prompts[:2])
    phases: dict[str, float] = defaultdict(float)
    if args.phases:
        _wrap_phases(engine, phases)
    for _ in range(args.runs):
        phases.clear()
        start = time.perf_counter()
        cpu, wall, finished = _run(engine, params, prompts, args.perf_ctl)
        total = time.perf_counter() - start
        print(f"{args.streams} streams, threads {args.threads}: decode step CPU median "
              f"{1e3 * statistics.median(cpu):.2f} ms (min {1e3 * min(cpu):.2f}, n {len(cpu)}), wall median "
              f"{1e3 * statistics.median(wall):.2f} ms (min {1e3 * min(wall):.2f}); whole run {total:.2f} s, "
              f"{args.streams * args.output / total:.1f} output tok/s", flush=True)
        for name, seconds in sorted(phases.items(), key=lambda kv: -kv[1])[:25]:
            print(f"    {name:55s} {seconds:8.3f} s  {100 * seconds / total:5.1f}%")
    if args.torch_profile:
        import torch

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _run(engine, params, prompts)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    tokens = sorted(tuple(o.outputs[0].token_ids) for o in finished)  # the set of completions, order-free
    print("tokens", hashlib.sha1(repr(tokens).encode()).hexdigest()[:12])


if __name__ == "__main__":
    main()
