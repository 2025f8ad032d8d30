"""One-sequence greedy decode: each step's CPU time and wall time, and a hash of the tokens and logprobs.

On a machine other processes load, a step's wall time says little, but with
``--threads 1`` the process's CPU time per step (``time.process_time``) leaves
out the time others hold the core: an A/B of two checkouts that holds up at a
load of 10-15 on 2 cores (memory contention still moves it a few per cent).
The hashes of the tokens and of the logprobs check that a change kept the bits.

    PYTHONPATH=<checkout> .venv/bin/python benchmarks/decode_step_cpu.py /work/peer-data/llama1b-q4_k_m.gguf \\
        --threads 1 --steps 48 --runs 2

Alternate the checkouts in one session (the kernels build per checkout). The
steps run the captured decode program (warmed up first, as a server runs).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import time


def _run(engine, params, prompt: list[int]) -> tuple[list[float], list[float], object]:  # noqa: ANN001
    """One request to its end: the decode steps' CPU and wall seconds (the prefill step left out), its output."""
    engine.add_request(engine.new_request_id(), {"prompt_token_ids": prompt}, params)
    cpu, wall, finished = [], [], None
    while engine.has_unfinished_requests():
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        outputs = engine.step()
        cpu.append(time.process_time() - cpu_start)
        wall.append(time.perf_counter() - wall_start)
        finished = next((o for o in outputs if o.finished), finished)
    return cpu[1:], wall[1:], finished


def _digest(values: list) -> str:
    return hashlib.sha1(repr(values).encode()).hexdigest()[:12]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a GGUF file or model folder")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=48, help="tokens to generate per run")
    p.add_argument("--runs", type=int, default=2, help="timed runs (after one warm-up run)")
    p.add_argument("--prompt-len", type=int, default=16)
    args = p.parse_args()

    from pagedllm.engine.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    llm = LLM(args.model, max_model_len=max(512, args.prompt_len + args.steps), num_threads=args.threads,
              enable_prefix_caching=False)
    llm.llm_engine.model_runner.warm_up()
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True, logprobs=0)
    prompt = [random.Random(1).randrange(1000, 20000) for _ in range(args.prompt_len)]
    _run(engine, params, prompt)
    for _ in range(args.runs):
        cpu, wall, out = _run(engine, params, prompt)
        print(f"threads {args.threads}: decode step CPU median {1e3 * statistics.median(cpu):.2f} ms "
              f"(min {1e3 * min(cpu):.2f}), wall median {1e3 * statistics.median(wall):.2f} ms "
              f"(min {1e3 * min(wall):.2f}): {1 / statistics.median(wall):.1f} tok/s", flush=True)
    completion = out.outputs[0]
    logprobs = [next(iter(d.values())).logprob for d in completion.logprobs or []]
    print(f"tokens {_digest(list(completion.token_ids))}  logprobs {_digest(logprobs)}")


if __name__ == "__main__":
    main()
