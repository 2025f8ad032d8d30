"""Helpers of the tests that run real servers on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

STARTUP_TIMEOUT = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text() if log else ''}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"no /health from {url} within {STARTUP_TIMEOUT}s")


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics, keyed by name (labels other than model_name appended)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            extra = {k: v for k, v in s.labels.items() if k not in ("model_name", "le")}
            if "le" in s.labels:
                continue
            key = s.name + (json.dumps(extra, sort_keys=True) if extra else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


def kv_usage(url: str) -> float:
    return metrics(url)["pagedllm:kv_cache_usage_perc"]


def wait_kv_free(url: str, timeout: float = 15.0) -> float:
    deadline = time.monotonic() + timeout
    usage = kv_usage(url)
    while usage > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        usage = kv_usage(url)
    return usage


def sse_events(lines: Iterator[str]) -> Iterator[str]:
    """The data of each server-sent event."""
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: ") :]


def assert_openai_error(resp: httpx.Response, status: int, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    err = body["error"]
    assert set(err) >= {"message", "type", "code"}
    assert err["message"]
    if code is not None:
        assert err["code"] == code
    return err


def launch_server(args: list[str], log: Path) -> subprocess.Popen:
    """``pagedllm serve ARGS`` in a subprocess, its output in ``log`` (not waited for)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with open(log, "w") as out:
        # output to a file: a pipe nobody reads would block the server once full
        return subprocess.Popen(
            [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *args],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )


def served(args: list[str], log_dir: Path) -> Iterator[str]:
    """``pagedllm serve ARGS`` on a free port, its log in ``log_dir``: yields its URL once healthy, stops it after
    (the body of a module-scoped server fixture)."""
    port = free_port()
    proc = launch_server(["--port", str(port), *args], log_dir / "server.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log_dir / "server.log")
        yield url
    finally:
        stop_server(proc)


def served_with_port(args: list[str], log_dir: Path) -> Iterator[dict]:
    """Like ``served``, for tests that also open raw sockets or read the log: yields ``{"url", "port", "log"}``."""
    port = free_port()
    log = log_dir / "server.log"
    proc = launch_server(["--port", str(port), *args], log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        yield {"url": url, "port": port, "log": log}
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it does not exit in 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@contextlib.contextmanager
def serve_in_thread(engine, **settings) -> Iterator[str]:  # noqa: ANN001
    """A real uvicorn server around ``engine`` on a loopback port, on a thread; yields its base URL.

    ``settings``: ServerSettings fields besides the port. The torch thread
    count (which the engine sets) is restored afterwards.
    """
    import torch
    import uvicorn

    from pagedllm.entrypoints.openai.api_server import (
        SHUTDOWN_GRACE_S,
        ServerSettings,
        create_server_app,
    )

    threads = torch.get_num_threads()
    port = free_port()
    app = create_server_app(engine, ServerSettings(port=port, **settings))
    # the real server's grace: a stream left open (a browser's /kv page) would otherwise hold the stop (and the
    # join below) for its whole 30 s
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
        torch.set_num_threads(threads)


def wait_for(cond: Callable[[], object], timeout: float = 60, what: str = "condition") -> object:
    """``cond()``'s first truthy value, polled every 20 ms; an AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")
