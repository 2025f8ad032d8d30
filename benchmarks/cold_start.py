"""Cold start of the offline API, stage by stage: import, kernel load, model load, first token.

One process per measurement (a stage's cost is a first time's cost):

    python benchmarks/cold_start.py [--model PATH] [--empty-cache]

``--empty-cache`` runs with a new, empty ``$PAGEDLLM_CACHE_DIR`` except for
``kernels/``, linked to the current cache's (so the measurement is not a
kernel build; a wheel's prebuilt kernels never use that folder). Prints one
JSON line: seconds per stage, ``next_15_tokens`` (the rest of a 16-token
``pagedllm generate``, decoded without a trace), ``decode_trace`` (tracing
the decode step, as a server does at start), ``decode_tok_s`` (one sequence,
128 tokens, replayed steps: the kernels' steady speed), the kernel variant
loaded and whether transformers was imported. Run it with ``PYTHONPATH`` at
an installed wheel and at the checkout, alternated, to compare the wheel's
prebuilt kernels with the checkout's own build.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

DECODE_TOKENS = 128  # one sequence, after the trace: the steady decode speed of the kernels loaded


def measure(model: str | None) -> dict[str, object]:
    """Seconds per stage of one fresh process, then its steady decode speed."""
    t0 = time.perf_counter()
    from pagedllm.engine.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    t1 = time.perf_counter()
    from pagedllm.kernels import kernels_prebuilt, load_kernels, loaded_variant

    load_kernels()
    t2 = time.perf_counter()
    llm = LLM(model, max_model_len=512)
    t3 = time.perf_counter()
    prompt = "The capital of France is"
    first = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    t4 = time.perf_counter()
    # the rest of a 16-token `pagedllm generate`: too short to trace the decode step (capture_min_decode_steps)
    llm.generate(prompt, SamplingParams(max_tokens=15, temperature=0, ignore_eos=True), use_tqdm=False)
    t5 = time.perf_counter()
    llm.llm_engine.model_runner.warm_up()  # the trace a server (or a long run) makes
    t6 = time.perf_counter()
    steady = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0, ignore_eos=True)
    llm.generate(prompt, steady, use_tqdm=False)
    t7 = time.perf_counter()
    return {
        "import": round(t1 - t0, 2), "kernel_load": round(t2 - t1, 2), "model_load": round(t3 - t2, 2),
        "first_token": round(t4 - t3, 2), "to_first_token": round(t4 - t0, 2),
        "next_15_tokens": round(t5 - t4, 2), "decode_trace": round(t6 - t5, 2),
        "decode_tok_s": round(DECODE_TOKENS / (t7 - t6), 1),
        "kernels": f"{loaded_variant()}{' (prebuilt)' if kernels_prebuilt() else ''}",
        "transformers_imported": "transformers" in sys.modules, "text": first[0].outputs[0].text,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a .gguf file or model folder (default: the bundled model)")
    parser.add_argument("--empty-cache", action="store_true", help="a new PAGEDLLM_CACHE_DIR (kernels linked)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.model)))
        return
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as empty:
        if args.empty_cache:
            from pagedllm.cache_dir import cache_root  # torch-free

            os.symlink(cache_root() / "kernels", os.path.join(empty, "kernels"))
            env["PAGEDLLM_CACHE_DIR"] = empty
        cmd = [sys.executable, os.path.abspath(__file__), "--child"] + (["--model", args.model] if args.model else [])
        start = time.perf_counter()
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        result["process_wall"] = round(time.perf_counter() - start, 2)  # interpreter start and exit included
        result["empty_cache"] = args.empty_cache
        print(json.dumps(result))


if __name__ == "__main__":
    main()
