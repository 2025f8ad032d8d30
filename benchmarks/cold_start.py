"""Cold start of the offline API, stage by stage: import, kernel load, model load, first token.

One process per measurement (a stage's cost is a first time's cost):

    python benchmarks/cold_start.py [--model PATH] [--empty-cache]

``--empty-cache`` runs with a new, empty ``$PAGEDLLM_CACHE_DIR`` except for
``kernels/``, linked to the current cache's (so the measurement is not a
kernel build; a wheel's prebuilt kernels never use that folder). Prints one
JSON line: seconds per stage, then ``next_tokens`` (8 more tokens: the first
decode steps, which trace the decode step once) and ``next_tokens_again`` (the
same without the trace), and whether transformers was imported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def measure(model: str | None) -> dict[str, object]:
    t0 = time.perf_counter()
    from pagedllm.engine.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    t1 = time.perf_counter()
    from pagedllm.kernels import load_kernels

    load_kernels()
    t2 = time.perf_counter()
    llm = LLM(model, max_model_len=512)
    t3 = time.perf_counter()
    prompt = "The capital of France is"
    first = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    t4 = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    t5 = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    t6 = time.perf_counter()
    return {
        "import": round(t1 - t0, 2), "kernel_load": round(t2 - t1, 2), "model_load": round(t3 - t2, 2),
        "first_token": round(t4 - t3, 2), "to_first_token": round(t4 - t0, 2),
        "next_tokens": round(t5 - t4, 2), "next_tokens_again": round(t6 - t5, 2),
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
