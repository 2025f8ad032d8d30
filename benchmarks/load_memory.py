"""Peak resident memory and time of loading a GGUF file, each in a fresh process (issue 48's "real sizes").

For each file, a new Python process imports pagedllm, builds ``LLM(model=FILE, max_model_len=...)`` and
generates one greedy token; it reads its own /proc/self/status (VmRSS, and VmHWM: the peak) at each
stage. Printed per file, one JSON line:

    file_bytes, import_s, load_s (LLM() built), first_token_s (from process start to the first token),
    rss_import_mb (torch and pagedllm imported), peak_load_mb (VmHWM once LLM() returns: the peak during the
    load), rss_after_load_mb, peak_first_token_mb (VmHWM after the first token), weight_bytes (what the model
    holds), goal_mb (issue 48: 1.1 x file + 200 MB) and peak_ratio (peak_first_token_mb / goal_mb; <= 1 meets it)

    PYTHONPATH=. .venv/bin/python benchmarks/load_memory.py /work/peer-data/llama3b-q4_k_m.gguf \
        /work/peer-data/llama8b-q4_k_m.gguf [--max-model-len 4096] [--threads 2]

The page cache is not counted (it is the kernel's, shared, dropped under pressure); the file's pages
mapped while a tensor is copied are (RSS counts mapped file pages), which is why the loader drops them
tensor by tensor. A run with a cold page cache adds the disk's time to load_s, not to the peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MB = 1_000_000
GOAL_FACTOR, GOAL_EXTRA = 1.1, 200 * MB

# runs in the fresh process: argv = file, max_model_len, threads
_CHILD = r"""
import json, sys, time
start = time.perf_counter()

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

path, max_model_len, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
import torch
torch.set_num_threads(threads)
from pagedllm import LLM, SamplingParams
imported, rss_import = time.perf_counter(), status("VmRSS")
llm = LLM(model=path, max_model_len=max_model_len)
loaded, peak_load, rss_after_load = time.perf_counter(), status("VmHWM"), status("VmRSS")
llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=1, temperature=0.0))
first = time.perf_counter()
print(json.dumps({
    "import_s": imported - start, "load_s": loaded - imported, "first_token_s": first - start,
    "rss_import": rss_import, "peak_load": peak_load, "rss_after_load": rss_after_load,
    "peak_first_token": status("VmHWM"), "rss_after_first_token": status("VmRSS"),
}))
"""


def measure(path: str, max_model_len: int, threads: int) -> dict[str, object]:
    """One fresh process's load of ``path``: timings (s) and memory (MB), with the goal and the ratio to it."""
    wall = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CHILD, path, str(max_model_len), str(threads)],
                         capture_output=True, text=True, check=False)
    wall = time.perf_counter() - wall
    if out.returncode != 0:
        raise SystemExit(f"load_memory.py: loading {path} failed:\n{out.stderr[-4000:]}")
    child = json.loads(out.stdout.strip().splitlines()[-1])
    file_bytes = os.path.getsize(path)
    goal = GOAL_FACTOR * file_bytes + GOAL_EXTRA
    result: dict[str, object] = {"file": os.path.basename(path), "file_mb": round(file_bytes / MB),
                                 "wall_to_first_token_s": round(wall, 2)}
    result.update({key: round(value, 2) for key, value in child.items() if key.endswith("_s")})
    result.update({f"{key}_mb": round(value / MB) for key, value in child.items() if not key.endswith("_s")})
    result["goal_mb"] = round(goal / MB)
    result["peak_ratio"] = round(max(child["peak_load"], child["peak_first_token"]) / goal, 3)
    result["peak_over_file"] = round(max(child["peak_load"], child["peak_first_token"]) / file_bytes, 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    for path in args.files:
        print(json.dumps(measure(path, args.max_model_len, args.threads)), flush=True)


if __name__ == "__main__":
    main()
