"""A 4,000-token ``echo`` + ``logprobs: 20`` request through ``pagedllm serve`` (the bundled model): a short streamed
request's time to first token alone and sent 1 s into it, the echo request's time, a plain prompt of the same length
for comparison, and the server's resident memory before and at its peak during the echo request (sampled every 20 ms).
BENCHMARKS.md, "Prompt logprobs in the step budget" (issue 53).

    .venv/bin/python benchmarks/echo_step_budget.py [--repo CHECKOUT] [--port 18500] [--save echo.json]

``--repo``: the checkout whose pagedllm the server runs (default: this one), to measure another branch with the same
script; ``--save``: where to write the echo request's ``logprobs`` (to compare two checkouts' values).
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ECHO_LEN = 4000


def rss_mb(pid: int) -> float:
    """The process's resident memory now, in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def ttft(url: str) -> float:
    """Seconds from sending a short streamed completion to its first token."""
    body = {"prompt": "Once upon a time", "max_tokens": 4, "stream": True, "temperature": 0}
    start = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=900) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.monotonic() - start
    raise RuntimeError("no token")


def start_server(repo: str, port: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=repo, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    args = ["serve", "--port", str(port), "--max-model-len", "4608", "--num-kv-blocks", "400", "--max-num-seqs", "8"]
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", *args], cwd=repo, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:
        if proc.poll() is not None:
            raise RuntimeError("the server exited")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def measure(url: str, pid: int) -> dict:
    """The figures of one run against a started server."""
    alone = [ttft(url) for _ in range(3)]
    before = rss_mb(pid)
    peak, done, echo = [before], threading.Event(), {}
    ids = [100 + (i * 7919) % 40000 for i in range(ECHO_LEN)]

    def run_echo() -> None:
        start = time.monotonic()
        body = {"prompt": ids, "max_tokens": 2, "echo": True, "logprobs": 20, "temperature": 0}
        echo["resp"] = httpx.post(f"{url}/v1/completions", json=body, timeout=1800)
        echo["s"] = time.monotonic() - start

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mb(pid))
            time.sleep(0.02)

    threads = [threading.Thread(target=run_echo), threading.Thread(target=sample)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    beside = ttft(url)
    threads[0].join()
    done.set()
    threads[1].join()
    start = time.monotonic()  # a plain prompt of the same length (other ids: no prefix-cache hit)
    plain = {"prompt": [100 + (i * 7907) % 40000 for i in range(ECHO_LEN)], "max_tokens": 2, "temperature": 0}
    httpx.post(f"{url}/v1/completions", json=plain, timeout=1800).raise_for_status()
    return {"ttft_alone_s": [round(a, 3) for a in alone], "ttft_beside_s": round(beside, 3), "echo_s": round(echo["s"], 1),
            "plain_s": round(time.monotonic() - start, 1), "rss_before_mb": round(before), "rss_peak_mb": round(peak[0]),
            "growth_mb": round(peak[0] - before), "echo": echo["resp"].json()["choices"][0]["logprobs"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repo", default=str(Path(__file__).resolve().parent.parent))
    p.add_argument("--port", type=int, default=18500)
    p.add_argument("--save", default=None)
    args = p.parse_args()
    proc = start_server(args.repo, args.port)
    try:
        out = measure(f"http://127.0.0.1:{args.port}", proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
    logprobs = out.pop("echo")
    if args.save:
        Path(args.save).write_text(json.dumps(logprobs))
    print(json.dumps({"repo": args.repo, **out}))


if __name__ == "__main__":
    main()
