"""Resident memory of a server before, during and after a burst: pagedllm, llama-server, vLLM's CPU server.

Standard library only (any python3); after prepare.py and the peers' install.sh:

    python3 benchmarks/peers/idle_after_burst.py --engine llama [--threads 1] [--idle-s 30]
    python3 benchmarks/peers/idle_after_burst.py --engine pagedllm
    python3 benchmarks/peers/idle_after_burst.py --engine vllm [--vllm-kv-gib 1]

The burst is tests/server/test_kv_give_back.py's: 64 completions at once (one thread
each) of unique 40-token prompts given as token ids (first ids all different, so no
prompt shares a block with another), 64 tokens each, greedy, EOS ignored; every reply
must report 64 completion tokens. All three servers take it on their OpenAI
``/v1/completions`` route.

Memory is the resident set (VmRSS) summed over the server process and all its
descendants (vLLM runs an API server and an engine-core process; pagedllm may start
helpers): ``rss_before_mib`` once healthy and after one short warm-up request,
``rss_peak_mib`` the largest sum sampled every 20 ms while the burst runs,
``rss_idle_mib`` the sum ``--idle-s`` seconds after the last reply (also sampled at
5 s and 15 s). Prints ONE JSON line; the server's log goes to a temp file, shown on
failure. The server is stopped on exit.

Servers, as started here:

* ``llama``: ``llama-server -m GGUF -np 16 -c 16*512 --threads T --threads-batch T
  --no-webui --cache-ram 0 --no-kv-unified`` (run_server.py's defaults at -np 16),
  plus ``--extra-args``.
* ``pagedllm``: ``pagedllm serve --port P --num-threads T`` (default pool and model),
  plus ``--extra-args``; its /metrics KV resident/reserved bytes are recorded too.
* ``vllm``: ``vllm serve DATA/smollm2-135m-f32 --port P`` with
  ``VLLM_CPU_KVCACHE_SPACE=--vllm-kv-gib``, plus ``--extra-args``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
NUM_REQUESTS, PROMPT_LEN, MAX_TOKENS = 64, 40, 64


def prompt(i: int) -> list[int]:
    """The i-th request's prompt (test_kv_give_back.py's): its own first id, then ids no other prompt has in that order."""
    return [1000 + i] + [2000 + (i * 37 + k) % 5000 for k in range(PROMPT_LEN - 1)]


def fail(msg: str, log_path: str | None = None) -> None:
    print(f"idle_after_burst.py: {msg}", file=sys.stderr)
    if log_path and os.path.isfile(log_path):
        with open(log_path, errors="replace") as f:
            print(f"--- server log tail ({log_path}) ---\n{f.read()[-4000:]}", file=sys.stderr)
    sys.exit(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_pids(root: int) -> list[int]:
    """``root`` and every live descendant (from /proc/*/stat's parent ids)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss(root: int) -> tuple[int, int]:
    """(summed VmRSS in bytes, number of processes) over ``root``'s process tree."""
    pids = tree_pids(root)
    return sum(rss_bytes(p) for p in pids), len(pids)


def http_json(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_healthy(base: str, path: str, proc: subprocess.Popen, timeout: float, log: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            fail(f"server exited with code {proc.returncode} while starting", log)
        try:
            with urllib.request.urlopen(base + path, timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.5)
    fail(f"server not healthy after {timeout:.0f}s", log)


def pagedllm_kv(base: str) -> dict:
    """pagedllm's /metrics KV resident and reserved bytes, in MiB."""
    out = {}
    with urllib.request.urlopen(base + "/metrics", timeout=30) as resp:
        for line in resp.read().decode().splitlines():
            for key in ("kv_cache_resident_bytes", "kv_cache_reserved_bytes"):
                if line.startswith(f"pagedllm:{key}"):
                    out[key.replace("_bytes", "_mib")] = round(float(line.split()[-1]) / 2**20, 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["llama", "pagedllm", "vllm"], required=True)
    p.add_argument("--data", default=os.environ.get("PEER_DATA", "/work/peer-data"))
    p.add_argument("--threads", type=int, default=1, help="llama --threads/--threads-batch, pagedllm --num-threads")
    p.add_argument("--parallel", type=int, default=16, help="llama-server -np (slots of 512 tokens)")
    p.add_argument("--idle-s", type=float, default=30)
    p.add_argument("--vllm-kv-gib", type=int, default=1)
    p.add_argument("--llama-bin", default="/work/peer-venvs/llamacpp/bin/llama-server")
    p.add_argument("--vllm-bin", default="/work/peer-venvs/vllm/bin/python",
                   help="the vllm venv's python (runs vllm.entrypoints.openai.api_server) or its `vllm` CLI")
    p.add_argument("--pagedllm-bin", default=os.path.join(REPO, ".venv", "bin", "pagedllm"),
                   help="default: REPO/.venv/bin/pagedllm (a git worktree has no .venv: pass the main checkout's)")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--extra-args", default="", help="more server arguments, shell-quoted")
    args = p.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    for key, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        env.setdefault(key, value)
    if args.engine == "llama":
        with open(os.path.join(args.data, "model.txt")) as f:
            model = f.read().strip()
        cmd = [args.llama_bin, "-m", model, "--host", "127.0.0.1", "--port", str(port),
               "-np", str(args.parallel), "-c", str(args.parallel * 512), "--threads", str(args.threads),
               "--threads-batch", str(args.threads), "--no-webui", "--cache-ram", "0", "--no-kv-unified"]
        health = "/health"
    elif args.engine == "pagedllm":
        cmd = [args.pagedllm_bin, "serve", "--port", str(port), "--num-threads", str(args.threads)]
        health = "/health"
    else:
        # vllm-cpu installs as the distribution "vllm-cpu": the `vllm` CLI looks up the version of "vllm" and
        # stops (PackageNotFoundError), so give the venv's python to run the API server module instead
        model_dir = os.path.join(args.data, "smollm2-135m-f32")
        if os.path.basename(args.vllm_bin).startswith("python"):
            cmd = [args.vllm_bin, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
        else:
            cmd = [args.vllm_bin, "serve", model_dir]
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.vllm_kv_gib)
        env.setdefault("VLLM_HOST_IP", "127.0.0.1")
        health = "/health"
    cmd += shlex.split(args.extra_args)

    log_fd, log = tempfile.mkstemp(prefix=f"idle-{args.engine}-", suffix=".log")
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True, cwd=REPO)
    os.close(log_fd)
    ok = False
    try:
        t0 = time.monotonic()
        wait_healthy(base, health, proc, args.startup_timeout, log)
        load_s = time.monotonic() - t0
        model_id = http_json(base + "/v1/models")["data"][0]["id"]

        def complete(ids: list[int], n: int) -> dict:
            return http_json(base + "/v1/completions", {
                "model": model_id, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            })

        complete(prompt(NUM_REQUESTS), 4)  # warm-up, a prompt the burst does not use
        time.sleep(2)
        rss_before, nproc = tree_rss(proc.pid)
        kv_before = pagedllm_kv(base) if args.engine == "pagedllm" else {}

        peak = {"rss": rss_before}
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                peak["rss"] = max(peak["rss"], tree_rss(proc.pid)[0])
                time.sleep(0.02)

        results: list = [None] * NUM_REQUESTS
        gate = threading.Barrier(NUM_REQUESTS + 1)

        def worker(i: int) -> None:
            gate.wait()
            try:
                results[i] = complete(prompt(i), MAX_TOKENS)
            except Exception as e:  # noqa: BLE001 - reported below
                results[i] = e

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        workers = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(NUM_REQUESTS)]
        for w in workers:
            w.start()
        gate.wait()
        start = time.perf_counter()
        for w in workers:
            w.join()
        burst_s = time.perf_counter() - start
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            fail(f"{len(errors)} requests failed, e.g. {errors[0]!r}", log)
        tokens = [r["usage"]["completion_tokens"] for r in results]
        if tokens != [MAX_TOKENS] * NUM_REQUESTS:
            fail(f"completion token counts {sorted(set(tokens))}, expected {MAX_TOKENS} each", log)

        t_end = time.monotonic()
        idle = {}
        for mark in sorted({5.0, 15.0, args.idle_s}):
            if mark > args.idle_s:
                continue
            time.sleep(max(0.0, t_end + mark - time.monotonic()))
            idle[mark] = tree_rss(proc.pid)[0]
        done.set()
        watcher.join(5)
        mib = lambda b: round(b / 2**20, 1)  # noqa: E731
        result = {
            "engine": args.engine, "command": " ".join(shlex.quote(c) for c in cmd),
            "processes": nproc, "load_s": round(load_s, 1), "burst_s": round(burst_s, 2),
            "requests": NUM_REQUESTS, "prompt_len": PROMPT_LEN, "max_tokens": MAX_TOKENS,
            "rss_before_mib": mib(rss_before), "rss_peak_mib": mib(peak["rss"]),
            **{f"rss_idle_{int(k)}s_mib": mib(v) for k, v in idle.items()},
            "rss_idle_mib": mib(idle[args.idle_s]),
            "idle_minus_before_mib": mib(idle[args.idle_s] - rss_before),
            "peak_minus_idle_mib": mib(peak["rss"] - idle[args.idle_s]),
            "loadavg": open("/proc/loadavg").read().split()[:3],
            "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        }
        if args.engine == "pagedllm":
            result["kv_before"] = kv_before
            result["kv_idle"] = pagedllm_kv(base)
        if args.engine == "vllm":
            result["vllm_cpu_kvcache_space_gib"] = args.vllm_kv_gib
        print(json.dumps(result), flush=True)
        ok = True
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, 15)
                proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(proc.pid, 9)
                except ProcessLookupError:
                    pass
                proc.wait()
        if ok:
            os.unlink(log)


if __name__ == "__main__":
    main()
