"""Throughput of llama.cpp's llama-server on the shared peer workload.

Standard library only; after prepare.py and install.sh:

    python3 benchmarks/peers/llama_cpp/run_server.py [-np 16] [--data /work/peer-data]

Starts ``llama-server`` on the bundled GGUF (its own Q4_1 weights; llama.cpp reads GGUF
directly) on a free loopback port with ``-np`` slots of ``--ctx-per-slot`` tokens each,
waits for /health, sends one short warm-up request, then POSTs every request of
workload.json to /completion at once (one thread each): prompt as token ids, greedy,
``n_predict`` = output_len, ``ignore_eos``, no prompt cache. The wall time runs from
the first send to the last reply. Every reply must report ``tokens_predicted`` ==
output_len. Memory: the server's VmRSS right after /health (``rss_after_load_mib``),
its VmHWM before it is stopped (``peak_rss_mib``), and the KV buffer the server logs
at start-up (``kv_buffer_mib``: every "KV buffer size" line summed; llama-server
reserves each slot's whole context there), also per slot. ``-ctk``/``-ctv`` in
``--extra-args`` show in ``kv_cache_type`` (e.g. ``--extra-args "-ctk q8_0 -ctv q8_0 -fa on"``).
Prints ONE JSON line on stdout; the server's log goes to a temp file that
is shown on failure. The server is killed on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

DEFAULT_BIN = os.path.join(
    os.environ.get("LLAMACPP_PREFIX", "/work/peer-venvs/llamacpp"), "bin", "llama-server"
)


def fail(msg: str, log_path: str | None = None) -> None:
    print(f"llama_cpp/run_server.py: {msg}", file=sys.stderr)
    if log_path and os.path.isfile(log_path):
        with open(log_path, errors="replace") as f:
            tail = f.read()[-4000:]
        print(f"--- last lines of the server log ({log_path}) ---\n{tail}", file=sys.stderr)
    sys.exit(1)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float, log_path: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            fail(f"llama-server exited with code {proc.returncode} while starting", log_path)
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass  # 503 while loading, or not listening yet
        time.sleep(0.25)
    fail(f"llama-server not healthy after {timeout:.0f}s", log_path)


def server_version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    for line in (out.stdout + out.stderr).splitlines():
        if line.startswith("version:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def read_source(binary: str) -> str | None:
    """What install.sh built the binary from (PREFIX/VERSION), if known."""
    try:
        with open(os.path.join(os.path.dirname(os.path.dirname(binary)), "VERSION")) as f:
            return f.read().strip()
    except OSError:
        return None


def proc_status_mib(pid: int, key: str) -> float | None:
    """``key`` (e.g. VmRSS, VmHWM) of /proc/PID/status in MiB, None when unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def kv_buffer_mib(log_path: str) -> float | None:
    """The KV cache buffer llama-server logged at start-up (sum of its "KV buffer size = X MiB" lines)."""
    total, found = 0.0, False
    with open(log_path, errors="replace") as f:
        for line in f:
            m = re.search(r"KV buffer size\s*=\s*([0-9.]+)\s*MiB", line)
            if m:
                total, found = total + float(m.group(1)), True
    return round(total, 2) if found else None


def kv_cache_type(extra: list[str]) -> str:
    """K and V cache types as the server was told (-ctk/-ctv, or the f16 default)."""
    types = {"k": "f16", "v": "f16"}
    for flag, which in (("-ctk", "k"), ("--cache-type-k", "k"), ("-ctv", "v"), ("--cache-type-v", "v")):
        if flag in extra and extra.index(flag) + 1 < len(extra):
            types[which] = extra[extra.index(flag) + 1]
    return f"k {types['k']}, v {types['v']}"


def main() -> None:
    p = argparse.ArgumentParser(description="llama-server throughput on the peer workload")
    p.add_argument("--data", default=os.environ.get("PEER_DATA", "/work/peer-data"))
    p.add_argument(
        "--model", default=None, help="GGUF file (default: the one named in DATA/model.txt)"
    )
    p.add_argument("--server-bin", default=DEFAULT_BIN)
    p.add_argument(
        "-np", "--parallel", type=int, default=16, help="server slots (concurrent sequences)"
    )
    p.add_argument(
        "--ctx-per-slot", type=int, default=512, help="context tokens per slot; -c = np * this"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=None, help="-b (default: llama-server's)")
    p.add_argument("--ubatch-size", type=int, default=None, help="-ub (default: llama-server's)")
    p.add_argument("--port", type=int, default=0, help="0 = a free loopback port")
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--request-timeout", type=float, default=3600)
    p.add_argument("--extra-args", default="", help="more llama-server arguments, shell-quoted")
    args = p.parse_args()

    wl_path = os.path.join(args.data, "workload.json")
    if not os.path.isfile(wl_path):
        fail(f"{wl_path} missing: run benchmarks/peers/prepare.py first")
    with open(wl_path) as f:
        workload = json.load(f)
    model = args.model
    if model is None:
        try:
            with open(os.path.join(args.data, "model.txt")) as f:
                model = f.read().strip()
        except OSError:
            fail(f"{args.data}/model.txt missing: run benchmarks/peers/prepare.py first")
    if not os.path.isfile(model):
        fail(f"model {model} not found")
    if not os.access(args.server_bin, os.X_OK):
        fail(f"{args.server_bin} not found: run benchmarks/peers/llama_cpp/install.sh")

    longest = max(len(r["prompt_token_ids"]) + r["output_len"] for r in workload)
    if longest > args.ctx_per_slot:
        fail(f"--ctx-per-slot {args.ctx_per_slot} is below the longest request ({longest} tokens)")

    port = args.port or free_port()
    base = f"http://127.0.0.1:{port}"
    ctx = args.parallel * args.ctx_per_slot
    server_args = [
        "-m",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(args.parallel),
        "-c",
        str(ctx),
        "--threads",
        str(args.threads),
        "--threads-batch",
        str(args.threads),
        "--no-webui",
        "--cache-ram",
        "0",
        "--no-kv-unified",
    ]
    if args.batch_size:
        server_args += ["-b", str(args.batch_size)]
    if args.ubatch_size:
        server_args += ["-ub", str(args.ubatch_size)]
    server_args += shlex.split(args.extra_args)

    log_fd, log_path = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
    proc = subprocess.Popen(
        [args.server_bin, *server_args],
        stdin=subprocess.DEVNULL,
        stdout=log_fd,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    os.close(log_fd)

    def stop_server(*_):
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    signal.signal(signal.SIGTERM, lambda *a: (stop_server(), sys.exit(143)))
    ok = False
    try:
        t0 = time.perf_counter()
        wait_healthy(base, proc, args.startup_timeout, log_path)
        load_s = time.perf_counter() - t0
        rss_after_load = proc_status_mib(proc.pid, "VmRSS")

        def body(ids: list[int], n: int) -> dict:
            return {
                "prompt": ids,
                "n_predict": n,
                "temperature": 0,
                "ignore_eos": True,
                "cache_prompt": False,
                "stream": False,
            }

        # warm-up: one short request
        post(base + "/completion", body(workload[0]["prompt_token_ids"], 4), args.request_timeout)

        results: list[dict | None] = [None] * len(workload)
        errors: list[str] = []
        gate = threading.Barrier(len(workload) + 1)

        def worker(i: int) -> None:
            r = workload[i]
            gate.wait()
            try:
                results[i] = post(
                    base + "/completion",
                    body(r["prompt_token_ids"], r["output_len"]),
                    args.request_timeout,
                )
            except Exception as e:  # noqa: BLE001 - collected and reported below
                errors.append(f"request {i}: {type(e).__name__}: {e}")

        threads = [
            threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(workload))
        ]
        for t in threads:
            t.start()
        gate.wait()
        start = time.perf_counter()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start

        if errors:
            fail(f"{len(errors)} requests failed, e.g. {errors[:3]}", log_path)
        bad = [
            (i, res.get("tokens_predicted"), r["output_len"])
            for i, (res, r) in enumerate(zip(results, workload))
            if res is None or res.get("tokens_predicted") != r["output_len"]
        ]
        if bad:
            fail(
                f"{len(bad)} replies have the wrong token count, e.g. {bad[:3]} (index, got, want)",
                log_path,
            )
        bad_prompt = [
            i
            for i, (res, r) in enumerate(zip(results, workload))
            if res.get("tokens_evaluated") not in (None, len(r["prompt_token_ids"]))
        ]
        if bad_prompt:
            fail(
                f"{len(bad_prompt)} replies evaluated a different prompt length, e.g. request {bad_prompt[0]}"
            )

        peak_rss = proc_status_mib(proc.pid, "VmHWM")
        kv_mib = kv_buffer_mib(log_path)
        num_prompt = sum(len(r["prompt_token_ids"]) for r in workload)
        num_out = sum(res["tokens_predicted"] for res in results)
        timings = [res.get("timings") or {} for res in results]
        result = {
            "engine": f"llama.cpp-server-np{args.parallel}",
            "version": server_version(args.server_bin),
            "source": read_source(args.server_bin),
            "num_requests": len(workload),
            "prompt_tokens": num_prompt,
            "output_tokens": num_out,
            "elapsed_s": round(elapsed, 3),
            "requests_per_s": round(len(workload) / elapsed, 3),
            "output_tokens_per_s": round(num_out / elapsed, 2),
            "total_tokens_per_s": round((num_out + num_prompt) / elapsed, 2),
            "weights": os.path.basename(model),
            "parallel": args.parallel,
            "ctx_size": ctx,
            "threads": args.threads,
            "batch_size": args.batch_size,
            "ubatch_size": args.ubatch_size,
            "kv_cache_type": kv_cache_type(shlex.split(args.extra_args)),
            "kv_buffer_mib": kv_mib,
            "kv_buffer_mib_per_slot": None if kv_mib is None else round(kv_mib / args.parallel, 3),
            "rss_after_load_mib": rss_after_load,
            "peak_rss_mib": peak_rss,
            "server_args": " ".join(
                a if a != model else os.path.basename(model) for a in server_args
            ),
            "mean_server_prompt_ms": round(
                sum(t.get("prompt_ms", 0) for t in timings) / len(timings), 1
            ),
            "mean_server_predicted_ms": round(
                sum(t.get("predicted_ms", 0) for t in timings) / len(timings), 1
            ),
            "load_s": round(load_s, 1),
            "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        }
        print(json.dumps(result), flush=True)
        ok = True
    finally:
        stop_server()
        if ok:
            os.unlink(log_path)


if __name__ == "__main__":
    main()
