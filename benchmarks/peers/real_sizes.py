"""pagedllm against llama.cpp on real-size GGUF files (issue 48), the two engines alternated on the same file.

For each file (made by ``benchmarks/real_size_gguf.py``), with the same threads:

* ``load``: pagedllm's fresh process to its first token (``benchmarks/load_memory.py``: time and peak
  RSS) against ``llama-server -c CTX -np 1`` from its start to the reply of a one-token /completion
  (time, and the server's VmHWM then);
* ``single``: one sequence's prefill (PROMPT tokens) and decode (OUTPUT tokens) rates: pagedllm's
  ``LLM.generate`` (prefill: a 1-token request's time; decode: the rest of a PROMPT + OUTPUT request)
  against ``llama-bench -p PROMPT -n OUTPUT -r 1``;
* ``streams``: N requests at once (32-token prompts, OUTPUT tokens each, greedy, EOS ignored): pagedllm's
  ``LLM.generate`` against ``llama-server -np N`` (``benchmarks/peers/llama_cpp/run_server.py``, the same
  token ids), output tokens per second;
* ``bandwidth``: the machine's copy bandwidth (numpy, 256 MB arrays: read + write bytes / s) and the
  decode bound it gives, the file's tensor bytes read once per token.

pagedllm's engines capture their decode steps from the first one, as a server does before it serves
(``capture_min_decode_steps=0``; the library's default waits for 512 steps ahead, which 32 output tokens never
reach), and each warm-up runs what is timed, so the trace is made before the clock starts.

One JSON line per measurement, with ``ratio`` = pagedllm / llama.cpp (higher is better for rates, lower
for time and memory). The machine's state (other processes) is not controlled: say so with the numbers.

    PYTHONPATH=. .venv/bin/python benchmarks/peers/real_sizes.py /work/peer-data/llama1b-q4_k_m.gguf \
        [--streams 16,64] [--output 64] [--prompt 128] [--threads 2] [--skip load,single,streams]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
LLAMA_BIN = os.path.join(os.environ.get("LLAMACPP_PREFIX", "/work/peer-venvs/llamacpp"), "bin")
MB = 1_000_000

# pagedllm in a fresh process: argv = file, threads, mode ("single" PROMPT OUTPUT | "streams" N OUTPUT)
_OURS = r"""
import json, random, sys, time
import torch
path, threads, mode, a, b = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
from pagedllm import LLM, SamplingParams
rng = random.Random(0)
def params(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
if mode == "single":
    llm = LLM(model=path, max_model_len=a + b + 16, max_num_seqs=1, enable_prefix_caching=False, capture_min_decode_steps=0)
    prompt = {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(a)]}
    llm.generate([prompt], params(b + 1), use_tqdm=False)  # warm-up, as long as the timed run (decode capture)
    t = time.perf_counter(); llm.generate([prompt], params(1), use_tqdm=False); prefill = time.perf_counter() - t
    t = time.perf_counter(); llm.generate([prompt], params(b + 1), use_tqdm=False); whole = time.perf_counter() - t
    print(json.dumps({"prefill_tok_s": a / prefill, "decode_tok_s": b / max(whole - prefill, 1e-9)}))
else:
    llm = LLM(model=path, max_model_len=32 + b + 16, max_num_seqs=a, enable_prefix_caching=False, capture_min_decode_steps=0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(32)]} for _ in range(a)]
    llm.generate(prompts, params(4), use_tqdm=False)  # warm-up: decode capture at the timed run's row count
    t = time.perf_counter()
    outs = llm.generate(prompts, params(b), use_tqdm=False)
    elapsed = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"output_tokens": n, "elapsed_s": elapsed, "output_tok_s": n / elapsed}))
"""


def emit(record: dict[str, object]) -> None:
    print(json.dumps(record), flush=True)


def ours(path: str, threads: int, mode: str, a: int, b: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", _OURS, path, str(threads), mode, str(a), str(b)],
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"pagedllm {mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bandwidth_bytes_per_s() -> float:
    """Copy bandwidth: best of 5 copies of a 256 MB array (read + write counted)."""
    src = np.ones(256 * MB // 8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best


def status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def llama_load(path: str, threads: int, ctx: int) -> dict[str, float]:
    """llama-server's start to the reply of a one-token completion, and its peak RSS then."""
    port = 18000 + random.randrange(1000)
    start = time.perf_counter()
    proc = subprocess.Popen([os.path.join(LLAMA_BIN, "llama-server"), "-m", path, "-c", str(ctx), "-np", "1",
                             "-t", str(threads), "--port", str(port), "--host", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        body = json.dumps({"prompt": [1, 2, 3, 4], "n_predict": 1, "temperature": 0}).encode()
        while True:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                             {"Content-Type": "application/json"})
                urllib.request.urlopen(req, timeout=600).read()
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError("llama-server exited") from None
                time.sleep(0.1)
        elapsed = time.perf_counter() - start
        return {"first_token_s": elapsed, "peak_rss_mb": status_kb(proc.pid, "VmHWM") * 1024 / MB,
                "rss_mb": status_kb(proc.pid, "VmRSS") * 1024 / MB}
    finally:
        proc.terminate()
        proc.wait(30)


def llama_bench(path: str, threads: int, prompt: int, output: int) -> dict[str, float]:
    out = subprocess.run([os.path.join(LLAMA_BIN, "llama-bench"), "-m", path, "-p", str(prompt), "-n", str(output),
                          "-t", str(threads), "-r", "1", "-o", "jsonl"], capture_output=True, text=True, check=True)
    rates = {}
    for line in out.stdout.splitlines():
        row = json.loads(line)
        rates["prefill_tok_s" if row["n_prompt"] else "decode_tok_s"] = row["avg_ts"]
    return rates


def llama_streams(path: str, threads: int, streams: int, output: int) -> dict[str, float]:
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as data:
        with open(os.path.join(data, "workload.json"), "w") as f:
            json.dump([{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(32)], "output_len": output}
                       for _ in range(streams)], f)
        out = subprocess.run([sys.executable, os.path.join(HERE, "llama_cpp", "run_server.py"), "--data", data,
                              "--model", path, "-np", str(streams), "--ctx-per-slot", str(32 + output + 16),
                              "--threads", str(threads)], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {"output_tok_s": result["output_tokens_per_s"], "elapsed_s": result.get("elapsed_s", 0.0)}


def run_file(path: str, args: argparse.Namespace, bandwidth: float) -> None:
    name, skip = os.path.basename(path), set(args.skip.split(",")) if args.skip else set()
    file_bytes = os.path.getsize(path)
    emit({"file": name, "what": "bandwidth", "copy_gb_s": round(bandwidth / 1e9, 2),
          "decode_bound_tok_s": round(bandwidth / file_bytes, 2)})
    if "load" not in skip:
        theirs = llama_load(path, args.threads, 4096)
        load = subprocess.run([sys.executable, os.path.join(os.path.dirname(HERE), "load_memory.py"), path,
                               "--threads", str(args.threads)], capture_output=True, text=True, check=True)
        mine = json.loads(load.stdout.strip().splitlines()[-1])
        emit({"file": name, "what": "load", "ours_first_token_s": mine["wall_to_first_token_s"],
              "llama_first_token_s": round(theirs["first_token_s"], 2),
              "ratio_time": round(mine["wall_to_first_token_s"] / theirs["first_token_s"], 2),
              "ours_peak_rss_mb": max(mine["peak_load_mb"], mine["peak_first_token_mb"]),
              "llama_peak_rss_mb": round(theirs["peak_rss_mb"]), "ours_goal_ratio": mine["peak_ratio"]})
    if "single" not in skip:
        theirs = llama_bench(path, args.threads, args.prompt, args.output)
        mine = ours(path, args.threads, "single", args.prompt, args.output)
        emit({"file": name, "what": "single", **{f"ours_{k}": round(v, 2) for k, v in mine.items()},
              **{f"llama_{k}": round(v, 2) for k, v in theirs.items()},
              "ratio_prefill": round(mine["prefill_tok_s"] / theirs["prefill_tok_s"], 2),
              "ratio_decode": round(mine["decode_tok_s"] / theirs["decode_tok_s"], 2),
              "decode_bound_tok_s": round(bandwidth / file_bytes, 2)})
    if "streams" not in skip:
        for streams in (int(n) for n in args.streams.split(",")):
            theirs = llama_streams(path, args.threads, streams, args.output)
            mine = ours(path, args.threads, "streams", streams, args.output)
            emit({"file": name, "what": f"streams{streams}", "ours_output_tok_s": round(mine["output_tok_s"], 2),
                  "llama_output_tok_s": round(theirs["output_tok_s"], 2),
                  "ratio": round(mine["output_tok_s"] / theirs["output_tok_s"], 2)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--streams", default="16,64")
    parser.add_argument("--skip", default="", help="comma-separated: load, single, streams")
    args = parser.parse_args()
    bandwidth = bandwidth_bytes_per_s()
    for path in args.files:
        run_file(path, args, bandwidth)


if __name__ == "__main__":
    main()
