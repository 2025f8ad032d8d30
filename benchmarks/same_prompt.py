"""The same prompt N times at temperature 0 through the server, under other load: how many answers?

Thinking Machines' experiment ("Defeating Nondeterminism in LLM Inference", Sept 2025) on
our server: for each mode (``--modes off,on``: ``--no-batch-invariant`` and ``--batch-invariant``)
this starts ``pagedllm serve`` on a free loopback port, waits for ``/health``, and sends
the *needle* (the first lines of the GPL-3 text and a question, a chat request at
temperature 0, top-5 logprobs) ``--num-requests`` times, ``--concurrency`` at once,
while ``--background`` other clients keep the batches mixed and changing: excerpts of the
other licenses in ``/usr/share/common-licenses`` (short, medium and long prompts, up to
~1,500 tokens), random ``max_tokens`` and temperatures. Every request goes through the
official ``openai`` client (``AsyncOpenAI``). Prints per mode the needles answered, the
distinct completions (text), the most common one's count, the distinct logprob vectors
(every sampled token's logprob and its top 5, compared bitwise) and the wall time; one
JSON line per mode with ``--json``. The server is stopped on exit, Ctrl-C and errors.

    python benchmarks/same_prompt.py                       # both modes, 1,000 needles each
    python benchmarks/same_prompt.py --max-seconds 600     # at most ~10 min of needles per mode
    python benchmarks/same_prompt.py --num-requests 40     # a quick check
    python benchmarks/same_prompt.py --modes on --json --server-args "--no-prefix-caching"

Run it from the checkout (``PYTHONPATH=.``) or with the package installed; the server is
``python -m pagedllm.entrypoints.cli serve`` with this interpreter. The background
requests are drawn from ``--seed``, so both modes get the same mix (not the same timing).
On a 2-vCPU AVX2 box shared with other work it answered ~0.8 needles/s (24 in flight,
4 background clients), so the full run takes ~20 min per mode there; ``--max-seconds``
caps a mode's needle phase and the figures then count the needles answered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from openai import AsyncOpenAI

LICENSES = Path("/usr/share/common-licenses")
NEEDLE_SOURCE = LICENSES / "GPL-3"
NEEDLE_QUESTION = "In two sentences: what does the license above let you do, and why was it written?"
# background prompt lengths in characters (~4 per token) and their weights: short, medium, long
BACKGROUND_KINDS = ((100, 400, 5), (800, 2000, 3), (3000, 6000, 1))
BACKGROUND_MAX_TOKENS = (1, 4, 8, 16, 32, 64, 96)
BACKGROUND_ASKS = ("Summarize this.", "What is this text about?", "Continue the text.", "List three key terms.")


@dataclass
class ModeResult:
    """What one mode's run gave."""

    mode: str
    batch_invariant: bool | None = None
    texts: Counter[str] = field(default_factory=Counter)
    logprob_vectors: Counter[str] = field(default_factory=Counter)
    errors: int = 0
    background_done: int = 0
    background_errors: int = 0
    startup_s: float = 0.0
    wall_s: float = 0.0

    def summary(self, args: argparse.Namespace) -> dict[str, object]:
        common = self.texts.most_common(1)
        return {
            "mode": self.mode, "batch_invariant": self.batch_invariant,
            "needles": sum(self.texts.values()), "errors": self.errors,
            "distinct_completions": len(self.texts), "most_common_count": common[0][1] if common else 0,
            "distinct_logprob_vectors": len(self.logprob_vectors) if args.logprobs else None,
            "first_divergence_token": first_divergence(self.logprob_vectors),
            "background_requests": self.background_done, "background_errors": self.background_errors,
            "wall_s": round(self.wall_s, 1), "startup_s": round(self.startup_s, 1),
            "num_requests": args.num_requests, "concurrency": args.concurrency,
            "background": args.background, "max_tokens": args.max_tokens, "server_args": args.server_args,
            "max_seconds": args.max_seconds,
            "top_completions": [[n, text] for text, n in self.texts.most_common(5)],
        }


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def needle_prompt(lines: int) -> str:
    """The first ``lines`` lines of the GPL-3 text and the question."""
    head = NEEDLE_SOURCE.read_text(encoding="utf-8").splitlines()[:lines]
    return "\n".join(head).strip() + "\n\n" + NEEDLE_QUESTION


def background_texts() -> list[str]:
    """The other licenses' texts (the long ones, not the needle's: ``GPL`` is often GPL-3), the background's sources."""
    needle = NEEDLE_SOURCE.read_text(encoding="utf-8", errors="replace")
    paths = sorted(p for p in LICENSES.iterdir() if p.is_file())
    texts = {p.read_text(encoding="utf-8", errors="replace") for p in paths} - {needle}
    return sorted(t for t in texts if len(t) > 8000) or sorted(texts)


def background_request(rng: random.Random, texts: list[str]) -> dict[str, object]:
    """One background chat request's arguments: an excerpt of random length, random max_tokens and temperature."""
    low, high, _ = rng.choices(BACKGROUND_KINDS, weights=[k[2] for k in BACKGROUND_KINDS])[0]
    text = rng.choice(texts)
    size = min(rng.randint(low, high), len(text))
    start = rng.randint(0, len(text) - size)
    content = text[start:start + size] + "\n\n" + rng.choice(BACKGROUND_ASKS)
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": rng.choice(BACKGROUND_MAX_TOKENS),
        "temperature": rng.choice((0.0, 0.7, 1.0)),
    }


def logprob_key(choice: object) -> str:
    """A chat choice's logprobs as one string: every token, its logprob and its top 5, floats as repr (exact)."""
    content = choice.logprobs.content if choice.logprobs is not None else None
    rows = [
        (t.token, repr(t.logprob), [(a.token, repr(a.logprob)) for a in (t.top_logprobs or [])])
        for t in content or []
    ]
    return json.dumps(rows)


def first_divergence(vectors: Counter[str]) -> int | None:
    """The first token position where a logprob vector differs from the most common one (None: all agree)."""
    if len(vectors) < 2:
        return None
    common = json.loads(vectors.most_common(1)[0][0])
    first = None
    for key in vectors:
        rows = json.loads(key)
        at = next((i for i, (a, b) in enumerate(zip(rows, common)) if a != b), min(len(rows), len(common)))
        first = at if first is None else min(first, at)
    return first


def start_server(args: argparse.Namespace, mode: str, port: int, log_path: Path) -> subprocess.Popen:
    """``pagedllm serve`` for ``mode`` on ``port``, in its own session (a Ctrl-C here is ours to pass on)."""
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port)]
    if args.model:
        command.append(args.model)
    # the server's default is on wherever the kernels allow it: each mode says which it wants
    command.append("--batch-invariant" if mode == "on" else "--no-batch-invariant")
    command += shlex.split(args.server_args)
    print(f"[{mode}] {' '.join(command)} (log: {log_path})", file=sys.stderr)
    with open(log_path, "wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen, log_path: Path, timeout: float) -> None:
    """Return once ``/health`` answers 200; RuntimeError if the server exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was healthy:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"no /health from {url} within {timeout:.0f}s (log: {log_path})")


def stop_server(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM (uvicorn's clean shutdown), then SIGKILL to the server's process group after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def batch_invariant_metric(url: str) -> bool | None:
    """The server's own ``pagedllm:batch_invariant`` gauge (None if it has none)."""
    with contextlib.suppress(httpx.HTTPError):
        for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
            if line.startswith("pagedllm:batch_invariant"):
                return float(line.split()[-1]) == 1.0
    return None


async def needle_worker(
    client: AsyncOpenAI, model: str, args: argparse.Namespace, prompt: str,
    queue: asyncio.Queue[int], rng: random.Random, result: ModeResult,
) -> None:
    """Take needle numbers off ``queue`` and send the needle for each, after a short random delay."""
    extra = {"logprobs": True, "top_logprobs": 5} if args.logprobs else {}
    deadline = time.monotonic() + args.max_seconds
    while True:
        try:
            queue.get_nowait()
        except asyncio.QueueEmpty:
            return
        await asyncio.sleep(rng.uniform(0, args.jitter))
        if args.max_seconds and time.monotonic() > deadline:
            return
        try:
            reply = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}],
                temperature=0, max_tokens=args.max_tokens, **extra,
            )
        except Exception as exc:  # noqa: BLE001 - counted and shown, the run goes on
            result.errors += 1
            print(f"[{result.mode}] needle failed: {exc!r}", file=sys.stderr)
            continue
        choice = reply.choices[0]
        result.texts[choice.message.content or ""] += 1
        if args.logprobs:
            result.logprob_vectors[logprob_key(choice)] += 1


async def background_worker(
    client: AsyncOpenAI, model: str, rng: random.Random, texts: list[str],
    stop: asyncio.Event, result: ModeResult,
) -> None:
    """Send background requests one after another until ``stop`` is set."""
    while not stop.is_set():
        request = background_request(rng, texts)
        try:
            await client.chat.completions.create(model=model, **request)
            result.background_done += 1
        except Exception:  # noqa: BLE001 - background load: counted, not fatal
            result.background_errors += 1
            await asyncio.sleep(0.5)


async def drive(url: str, args: argparse.Namespace, result: ModeResult) -> None:
    """The needles and the background load against the server at ``url``; fills ``result``."""
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=args.request_timeout, max_retries=0)
    model = (await client.models.list()).data[0].id
    prompt = needle_prompt(args.needle_lines)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(args.num_requests):
        queue.put_nowait(i)
    rng = random.Random(args.seed)
    texts = background_texts()
    stop = asyncio.Event()
    background = [
        asyncio.create_task(background_worker(client, model, random.Random(rng.random()), texts, stop, result))
        for _ in range(args.background)
    ]
    try:
        await asyncio.sleep(args.warmup)  # the background gets going before the first needle
        needles = [
            needle_worker(client, model, args, prompt, queue, random.Random(rng.random()), result)
            for _ in range(args.concurrency)
        ]
        await asyncio.gather(*needles)
    finally:
        stop.set()
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await client.close()


def run_mode(args: argparse.Namespace, mode: str, log_dir: Path) -> ModeResult:
    """Start the server for ``mode``, run the experiment against it, stop it; whatever happens, it stops."""
    result = ModeResult(mode)
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = log_dir / f"same_prompt_{mode}.log"
    t0 = time.perf_counter()
    proc = start_server(args, mode, port, log_path)
    try:
        wait_healthy(url, proc, log_path, args.startup_timeout)
        result.startup_s = time.perf_counter() - t0
        result.batch_invariant = batch_invariant_metric(url)
        t1 = time.perf_counter()
        asyncio.run(drive(url, args, result))
        result.wall_s = time.perf_counter() - t1
    finally:
        stop_server(proc)
    return result


def print_result(summary: dict[str, object], result: ModeResult, as_json: bool) -> None:
    """One mode's figures: a JSON line, or a few lines of text with the most common completions."""
    if as_json:
        print(json.dumps(summary), flush=True)
        return
    print(f"mode {summary['mode']} (server reports batch_invariant={summary['batch_invariant']}):")
    print(f"  needle requests answered  {summary['needles']} ({summary['errors']} failed)")
    print(f"  distinct completions      {summary['distinct_completions']}")
    print(f"  most common completion    {summary['most_common_count']} times")
    print(f"  distinct logprob vectors  {summary['distinct_logprob_vectors']}"
          f" (first differing token: {summary['first_divergence_token']})")
    print(f"  background requests       {summary['background_requests']} ({summary['background_errors']} failed)")
    print(f"  wall time                 {summary['wall_s']} s (server start {summary['startup_s']} s)")
    for text, count in result.texts.most_common(5):
        print(f"    {count:5d} x {text[:100]!r}")
    sys.stdout.flush()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="off,on", help="comma-separated: off (--no-batch-invariant), on (--batch-invariant); default off,on")
    p.add_argument("--num-requests", type=int, default=1000, help="needle requests per mode (default 1000)")
    p.add_argument("--concurrency", type=int, default=24, help="needle requests in flight (default 24)")
    p.add_argument("--background", type=int, default=4, help="background clients, one request each in flight")
    p.add_argument("--max-tokens", type=int, default=48, help="the needle's max_tokens (default 48)")
    p.add_argument("--needle-lines", type=int, default=24, help="lines of the GPL-3 text in the needle")
    p.add_argument("--no-logprobs", dest="logprobs", action="store_false", help="do not ask for logprobs")
    p.add_argument("--jitter", type=float, default=0.3, help="most seconds a needle waits before it is sent")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of background load before the needles")
    p.add_argument("--max-seconds", type=float, default=0.0,
                   help="per mode, send no new needle after this many seconds (0: no limit); the figures count the answered ones")
    p.add_argument("--seed", type=int, default=0, help="seed of the background requests and delays")
    p.add_argument("--model", default=None, help="model for pagedllm serve (default: the bundled SmolLM2)")
    p.add_argument("--server-args", default="", help="more pagedllm serve arguments, one string")
    p.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--log-dir", default=None, help="where the server logs go (default: a temporary folder)")
    p.add_argument("--json", action="store_true", help="one JSON line per mode instead of text")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in ("off", "on") for m in args.modes):
        p.error("--modes takes off, on or both (comma-separated)")
    if args.num_requests < 1 or args.concurrency < 1 or args.background < 0:
        p.error("--num-requests and --concurrency must be at least 1, --background at least 0")
    return args


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM as Ctrl-C, so the servers' finally blocks run
    signal.signal(signal.SIGTERM, _interrupt)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="same_prompt_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    failed = False
    for mode in args.modes:
        result = run_mode(args, mode, log_dir)
        summary = result.summary(args)
        print_result(summary, result, args.json)
        failed |= result.errors > 0
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; the server was stopped", file=sys.stderr)
        sys.exit(130)
