"""Time to first token of an agent-shaped request, server against server: pagedllm and llama-server.

The request is what a coding agent resends every turn: a long shared prefix
(``--prefix-len`` tokens of tool schemas and repository context) and a new
turn (``--turn-len`` tokens) that differs each time. Both servers get the
same token ids (tokenized once from the same text, with the GGUF's own
tokenizer), on the same GGUF file, with the same number of threads:

  cold      a fresh server: the whole prompt is computed
  ram hit   the same server, a new turn: the prefix comes from its prompt cache in RAM
  restart   the server stopped and started again, a new turn: pagedllm reads the prefix's
            blocks back from ``--kv-cache-dir``; llama-server restores the slot saved before the
            stop (``--slot-save-path``, ``POST /slots/0?action=save`` then ``?action=restore``),
            the restore counted in its TTFT

TTFT is the wall time of a ``max_tokens=1`` completion over HTTP on
loopback (``/v1/completions`` with ``prompt`` as token ids; llama-server's
``/completion`` with ``cache_prompt``). Each server's start is timed apart,
and the tokens each one computed are read back (pagedllm's
``pagedllm:prompt_tokens_computed`` on ``/metrics``, llama-server's
``timings.prompt_n``), so a figure without a hit shows as such. llama-server
runs with ``-np 1`` (one slot, so every turn lands in the slot holding the
prefix) and ``--cache-reuse 256``. Prints one line per case and, with
``--json``, one JSON object.

    PYTHONPATH=. python benchmarks/agent_prefix.py                                  # 8k + 200 tokens, 2 threads
    PYTHONPATH=. python benchmarks/agent_prefix.py --prefix-len 2000 --turn-len 200 # a quick run
    LLAMACPP_BIN=/path/to/llama.cpp/build/bin PYTHONPATH=. python benchmarks/agent_prefix.py --model FILE.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable

LLAMA_BIN = os.environ.get("LLAMACPP_BIN", "/work/peer-venvs/llamacpp/src/llama_cpp_python-0.3.36/build/bin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 1800) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _wait_healthy(url: str, proc: subprocess.Popen, log: str) -> None:
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); see {log}")
        time.sleep(0.2)


def _start(cmd: list[str], url: str, log: str) -> tuple[subprocess.Popen, float]:
    """Launch a server (its output to ``log``); the process and the seconds until it was healthy."""
    started = time.perf_counter()
    with open(log, "a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    _wait_healthy(url, proc, log)
    return proc, time.perf_counter() - started


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM and wait: pagedllm's shutdown lets its disk writer finish what it queued."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(300)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def agent_prompt(model: str, prefix_len: int, turn_len: int, num_turns: int) -> tuple[list[int], list[list[int]]]:
    """The shared prefix (tool schemas, then repository context) and ``num_turns`` new turns, as token ids."""
    from pagedllm.loader.tokenizer import Tokenizer

    rng = random.Random(0)
    words = ["path", "query", "line", "limit", "pattern", "branch", "commit", "file", "symbol", "range", "test"]
    parts = []
    for i in range(64):  # tool schemas, as an agent's system prompt lists them
        props = {f"{rng.choice(words)}_{j}": {"type": rng.choice(["string", "integer", "boolean"]),
                                              "description": f"the {rng.choice(words)} to use ({i}.{j})"}
                 for j in range(rng.randrange(2, 6))}
        parts.append(json.dumps({"type": "function", "function": {
            "name": f"tool_{i}_{rng.choice(words)}", "description": f"Tool {i}: acts on a {rng.choice(words)}.",
            "parameters": {"type": "object", "properties": props, "required": list(props)[:1]}}}))
    for i in range(4000):  # repository context: source lines
        parts.append(f"src/module_{i % 97}.py:{i}: def {rng.choice(words)}_{i}(x: int) -> int: return x + {i}")
    tokenizer = Tokenizer(model)
    ids = tokenizer.encode("\n".join(parts), add_special_tokens=False)
    if len(ids) < prefix_len:
        raise ValueError(f"the synthetic context is {len(ids)} tokens, fewer than --prefix-len {prefix_len}")
    turns = []
    for t in range(num_turns):
        text = " ".join(f"Turn {t}: please look at {rng.choice(words)} {rng.randrange(10**6)}." for _ in range(200))
        turns.append(tokenizer.encode(text, add_special_tokens=False)[:turn_len])
    return ids[:prefix_len], turns


def _computed(url: str) -> int:
    """pagedllm's count of prompt tokens its prefills computed so far (``/metrics``; prefix-cache hits excluded)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as resp:
        text = resp.read().decode()
    name = "pagedllm:prompt_tokens_computed_total"
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and line[len(name)] in " {"))


def _hit_turns(out: dict, ask: Callable[[list[int]], tuple[float, int]], turns: list[list[int]]) -> None:
    """Ask each new turn after the prefix was seen; the last one is the RAM-hit figure. A hybrid model's first
    of these turns hits the prefix up to its last periodic state snapshot inside it (``state_snapshot_interval``);
    the state at the prefix's end is kept once a second prompt shares it, so its whole hit comes on the second
    of these turns (``--hits 2``)."""
    for turn in turns:
        seconds, computed = ask(turn)
        out.setdefault("ram_hits_s", []).append(seconds)
        out.setdefault("ram_hits_computed", []).append(computed)
    out["ram_hit_s"], out["ram_hit_computed"] = out["ram_hits_s"][-1], out["ram_hits_computed"][-1]


def _timed(call: Callable[[], dict]) -> tuple[float, dict]:
    started = time.perf_counter()
    body = call()
    return time.perf_counter() - started, body


def run_pagedllm(model: str, threads: int, ctx: int, prefix: list[int], turns: list[list[int]], log: str,
                 restart: bool = True, hits: int = 1) -> dict:
    """Cold, RAM hit and (with ``restart``) restart-from-disk TTFT of ``pagedllm serve --kv-cache-dir``."""
    cache_dir = tempfile.mkdtemp(prefix="agent-prefix-kv-")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--port", str(port),
           "--num-threads", str(threads), "--max-model-len", str(ctx)]
    if restart:
        cmd += ["--kv-cache-dir", cache_dir]
    out: dict[str, float] = {}

    def ask(turn: list[int]) -> tuple[float, int]:
        before = _computed(url)
        seconds, _ = _timed(lambda: _post(f"{url}/v1/completions", {
            "prompt": prefix + turn, "max_tokens": 1, "temperature": 0}))
        return seconds, _computed(url) - before

    try:
        proc, out["start_s"] = _start(cmd, url, log)
        try:
            out["cold_s"], out["cold_computed"] = ask(turns[0])
            _hit_turns(out, ask, turns[1:1 + hits])
        finally:
            _stop(proc)
        if not restart:
            return out
        proc, out["restart_start_s"] = _start(cmd, url, log)
        try:
            out["restart_s"], out["restart_computed"] = ask(turns[1 + hits])
        finally:
            _stop(proc)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return out


def run_llama(model: str, threads: int, ctx: int, prefix: list[int], turns: list[list[int]], log: str,
              restart: bool = True, hits: int = 1) -> dict:
    """Cold, RAM hit and (with ``restart``) restart-with-slot-restore TTFT of llama-server."""
    slots = tempfile.mkdtemp(prefix="agent-prefix-slots-")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [os.path.join(LLAMA_BIN, "llama-server"), "-m", model, "-c", str(ctx), "-np", "1", "-t", str(threads),
           "-tb", str(threads), "--port", str(port), "--host", "127.0.0.1", "--cache-reuse", "256",
           "--slot-save-path", slots + os.sep]
    out: dict[str, float] = {}

    def ask(turn: list[int]) -> tuple[float, int]:
        seconds, body = _timed(lambda: _post(f"{url}/completion", {
            "prompt": prefix + turn, "n_predict": 1, "temperature": 0, "cache_prompt": True}))
        return seconds, int(body.get("timings", {}).get("prompt_n", -1))

    try:
        proc, out["start_s"] = _start(cmd, url, log)
        try:
            out["cold_s"], out["cold_computed"] = ask(turns[0])
            _hit_turns(out, ask, turns[1:1 + hits])
            if restart:
                out["slot_save_s"], _ = _timed(
                    lambda: _post(f"{url}/slots/0?action=save", {"filename": "agent.bin"}))
        finally:
            _stop(proc)
        if not restart:
            return out
        proc, out["restart_start_s"] = _start(cmd, url, log)
        try:
            out["slot_restore_s"], _ = _timed(
                lambda: _post(f"{url}/slots/0?action=restore", {"filename": "agent.bin"}))
            seconds, out["restart_computed"] = ask(turns[1 + hits])
            out["restart_s"] = out["slot_restore_s"] + seconds
        finally:
            _stop(proc)
    finally:
        shutil.rmtree(slots, ignore_errors=True)
    return out


def _report(name: str, r: dict) -> None:
    if "restart_s" not in r:
        print(f"{name:10s} cold {r['cold_s']:7.3f} s ({r['cold_computed']} computed)   "
              f"RAM hits {' / '.join(f'{x:.3f}' for x in r['ram_hits_s'])} s ({r['ram_hits_computed']})   "
              f"cold/RAM hit {r['cold_s'] / r['ram_hit_s']:.1f}x   (server start {r['start_s']:.1f} s)")
        return
    print(f"{name:10s} cold {r['cold_s']:7.3f} s ({r['cold_computed']} computed)   "
          f"RAM hit {r['ram_hit_s']:7.3f} s ({r['ram_hit_computed']})   "
          f"restart {r['restart_s']:7.3f} s ({r['restart_computed']})   "
          f"cold/restart {r['cold_s'] / r['restart_s']:.1f}x, restart/RAM hit {r['restart_s'] / r['ram_hit_s']:.2f}x   "
          f"(server start {r['start_s']:.1f} s, restarted {r['restart_start_s']:.1f} s)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2-135M Q4_1)")
    p.add_argument("--prefix-len", type=int, default=7900)  # + 200 + 64 fits the bundled model's 8,192
    p.add_argument("--turn-len", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip", default="", help="comma-separated: pagedllm, llama, restart (no disk cache / slot "
                   "restore: a hybrid model's state has no disk cache)")
    p.add_argument("--hits", type=int, default=1, help="new turns sent after the cold one (the last is the RAM hit)")
    p.add_argument("--log-dir", default=None, help="where the servers' logs go (default: a temporary folder)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from pagedllm.loader import bundled_model_path

    model = os.path.abspath(args.model or bundled_model_path())
    if args.hits < 1:
        raise ValueError(f"--hits must be >= 1, got {args.hits}")
    prefix, turns = agent_prompt(model, args.prefix_len, args.turn_len, 2 + args.hits)
    ctx = args.prefix_len + args.turn_len + 64
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="agent-prefix-logs-")
    skip = set(filter(None, args.skip.split(",")))
    print(f"{os.path.basename(model)}: {len(prefix)} shared + {len(turns[0])} new tokens, {args.threads} threads "
          f"(logs in {log_dir})")
    figures: dict[str, dict] = {}
    if "pagedllm" not in skip:
        figures["pagedllm"] = run_pagedllm(model, args.threads, ctx, prefix, turns, f"{log_dir}/pagedllm.log",
                                           restart="restart" not in skip, hits=args.hits)
        _report("pagedllm", figures["pagedllm"])
    if "llama" not in skip:
        figures["llama_server"] = run_llama(model, args.threads, ctx, prefix, turns, f"{log_dir}/llama.log",
                                            restart="restart" not in skip, hits=args.hits)
        _report("llama", figures["llama_server"])
    if args.json:
        print(json.dumps({"model": model, "prefix_len": len(prefix), "turn_len": len(turns[0]),
                          "threads": args.threads, **figures}))


if __name__ == "__main__":
    main()
