"""Peak resident memory while a mixture-of-experts GGUF file loads and decodes, against the file and the KV written.

Issue 49's goal: a Qwen3-30B-A3B-shaped file runs with a peak RSS of at most the file plus 10% plus the KV
cache actually written, so the load must never hold the file's bytes twice. The loader copies each tensor's
blocks once into its layer (a stacked experts' tensor one expert at a time, ``loader/gguf_loader.py``) and
drops the file's mapped pages of each tensor once it is copied (``_drop_mapped_pages``), so the file's pages
never stay resident beside the weights; the KV pool is an anonymous mapping, resident only where written
(``runner/kv_cache.py``).

In a fresh process: import, build ``LLM(FILE)``, then one request of ``--prompt-len`` tokens and
``--max-tokens`` greedy tokens; /proc/self/status's VmHWM (the peak) and VmRSS read after the import, after
the load and after the steps. Printed as one JSON line:

    file_mb, weights_mb (the bytes the model's parameters and buffers hold), kv_written_mb (the KV blocks
    the request's tokens filled, K and V of every layer), rss_import_mb, peak_load_mb, rss_after_load_mb,
    peak_run_mb, rss_after_run_mb, goal_mb (rss_import + 1.1 x file + KV written), peak_ratio (peak_run /
    goal; <= 1 meets it), peak_over_file (peak_run - rss_import, over the file) and decode tok/s.

    PYTHONPATH=. .venv/bin/python benchmarks/moe_rss.py /work/peer-data/qwen3-30b-a3b-12l-q4_k_m.gguf \
        [--prompt-len 64] [--max-tokens 16] [--threads 2]

The page cache is not counted (the kernel's, shared); the import's own resident memory (torch, ~0.5 GB) is
reported apart and added to the goal, as it is the same for any model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MB = 1_000_000
GOAL_FACTOR = 1.1

# runs in the fresh process: argv = file, prompt_len, max_tokens, threads
_CHILD = r"""
import json, math, sys, time

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

path, prompt_len, max_tokens, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
import torch
torch.set_num_threads(threads)
from pagedllm import LLM, SamplingParams
rss_import = status("VmRSS")
start = time.perf_counter()
llm = LLM(model=path, max_model_len=prompt_len + max_tokens + 16, num_threads=threads)
load_s = time.perf_counter() - start
peak_load, rss_after_load = status("VmHWM"), status("VmRSS")
runner = llm.llm_engine.model_runner
model = runner.model
weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
prompt = [100 + (i * 7919) % 30000 for i in range(prompt_len)]
params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
start = time.perf_counter()
out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
run_s = time.perf_counter() - start
tokens = prompt_len + len(out[0].outputs[0].token_ids) - 1  # the last sampled token's K/V is never written
blocks = math.ceil(tokens / runner.block_size)
print(json.dumps({
    "load_s": load_s, "run_s": run_s, "rss_import": rss_import, "peak_load": peak_load,
    "rss_after_load": rss_after_load, "peak_run": status("VmHWM"), "rss_after_run": status("VmRSS"),
    "weights": weights, "kv_written": blocks * runner.kv_bytes_per_block, "tokens": tokens,
    "generated": len(out[0].outputs[0].token_ids),
}))
"""


def measure(path: str, prompt_len: int, max_tokens: int, threads: int) -> dict[str, object]:
    """One fresh process's load of ``path`` and one request: memory (MB) against the file and the KV written."""
    out = subprocess.run([sys.executable, "-c", _CHILD, path, str(prompt_len), str(max_tokens), str(threads)],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"moe_rss.py: running {path} failed:\n{out.stderr[-4000:]}")
    child = json.loads(out.stdout.strip().splitlines()[-1])
    file_bytes = os.path.getsize(path)
    goal = child["rss_import"] + GOAL_FACTOR * file_bytes + child["kv_written"]
    result: dict[str, object] = {"file": os.path.basename(path), "file_mb": round(file_bytes / MB)}
    for key in ("weights", "kv_written", "rss_import", "peak_load", "rss_after_load", "peak_run", "rss_after_run"):
        result[f"{key}_mb"] = round(child[key] / MB, 1)
    result["goal_mb"] = round(goal / MB)
    result["peak_ratio"] = round(child["peak_run"] / goal, 3)
    result["peak_over_file"] = round((child["peak_run"] - child["rss_import"]) / file_bytes, 3)
    result["load_s"] = round(child["load_s"], 1)
    result["tokens"] = child["tokens"]
    result["tok_s"] = round(child["generated"] / child["run_s"], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.prompt_len < 1 or args.max_tokens < 1 or args.threads < 1:
        raise SystemExit("--prompt-len, --max-tokens and --threads must be positive")
    for path in args.files:
        print(json.dumps(measure(path, args.prompt_len, args.max_tokens, args.threads)), flush=True)


if __name__ == "__main__":
    main()
