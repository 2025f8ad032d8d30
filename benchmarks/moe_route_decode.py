"""One-sequence decode step time of a mixture-of-experts file with the routing in torch ops or in native calls.

The model loads once; then runs alternate between the two routings (``RouterScores`` and ``PairGrouping``,
``layers/router.py`` / ``layers/moe_pairs.py``, bound to torch or to the native ops), each run with a fresh
captured decode (traced again for that routing) and one greedy request of ``--prompt-len`` tokens and
``--max-tokens`` new ones, its steps timed one by one through the engine's ``step``. A run's decode step time is
the median of its decode steps after the first two (the first traces the step). Printed per run, then the
medians of each routing's runs; the two routings' tokens must be the same (their bits are).

    PYTHONPATH=. .venv/bin/python benchmarks/moe_route_decode.py /work/peer-data/qwen3-30b-a3b-12l-q4_k_m.gguf \
        [--runs 4] [--prompt-len 16] [--max-tokens 24] [--threads 2]

On a shared machine the spread between runs is the machine's: alternate, and read the medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedllm import LLM, SamplingParams
from pagedllm.layers.moe_pairs import PairGrouping
from pagedllm.layers.router import RouterScores


def _bind(llm: LLM, native: bool) -> None:
    """Every routing layer on the native ops (``native``) or torch; a fresh captured decode for it."""
    runner = llm.llm_engine.model_runner
    for module in runner.model.modules():
        if isinstance(module, (RouterScores, PairGrouping)):
            module.select_impl(runner.native_ops if native else None)
    runner.captured_decode = runner._make_captured_decode(runner.config, runner.model_config)


def _run(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """(median decode step seconds, the tokens) of one greedy request through the engine's steps."""
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                       ignore_eos=True))
    times, tokens = [], []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - start)
        for out in outs:
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    return statistics.median(times[3:]), tokens  # past the prefill and the step that traces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.max_tokens < 6 or args.runs < 1:
        raise SystemExit("--max-tokens must be at least 6 (two steps are not timed) and --runs positive")
    llm = LLM(model=args.model, num_threads=args.threads, max_model_len=args.prompt_len + args.max_tokens + 16,
              enable_prefix_caching=False)
    if llm.llm_engine.model_runner.native_ops is None:
        raise SystemExit("the native kernels are not built here: nothing to compare")
    prompt = [100 + (i * 7919) % 30000 for i in range(args.prompt_len)]
    results: dict[str, list[float]] = {"torch": [], "native": []}
    tokens: dict[str, list[int]] = {}
    for i in range(args.runs):
        for name in ("torch", "native") if i % 2 == 0 else ("native", "torch"):
            _bind(llm, name == "native")
            step_s, tokens[name] = _run(llm, prompt, args.max_tokens)
            results[name].append(step_s)
            print(f"run {i} {name:>6}: decode step {step_s * 1e3:.1f} ms", flush=True)
    same = tokens["torch"] == tokens["native"]
    t, n = statistics.median(results["torch"]), statistics.median(results["native"])
    print(f"median decode step: torch routing {t * 1e3:.1f} ms, native {n * 1e3:.1f} ms "
          f"(torch / native {t / n:.3f}); same tokens: {same}")


if __name__ == "__main__":
    main()
