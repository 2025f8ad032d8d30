"""A streaming client that stops reading (issue 53, item 5).

``pagedllm serve`` runs the tiny random Llama in a subprocess with
``--stream-write-timeout 1``. A raw socket with a tiny receive buffer asks for
a long stream (every chunk carrying 20 top logprobs, ~2 KB) and never reads:
the socket buffers and uvicorn's fill (a few MiB), the next
write waits, and within the timeout (plus the time to fill them) the request
must be aborted, its blocks back in the pool (``/kv/state``), and counted in
``pagedllm:stream_write_timeouts_total``. A client that reads is untouched.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import free_port, launch_server, metrics, sse_events, stop_server, wait_healthy

pytestmark = pytest.mark.slow  # a real server in a subprocess: outside the fast tier

WRITE_TIMEOUT_S = 1.0
MAX_TOKENS = 900
# samples of the stalled request: their events (~2 KB each, with 20 top logprobs) must outgrow what the
# socket buffers take (the server's send buffer grows to 4 MiB on loopback) before the request ends
NUM_SAMPLES = 8
NUM_BLOCKS = 1024


@pytest.fixture(scope="module")
def server(tiny_model_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = Path(tmp_path_factory.mktemp("stream_write")) / "server.log"
    port = free_port()
    proc = launch_server([tiny_model_dirs["llama"], "--port", str(port), "--served-model-name", "tiny",
                          "--num-kv-blocks", str(NUM_BLOCKS), "--block-size", "8", "--max-model-len", "1024",
                          "--num-threads", "1", "--stream-write-timeout", str(WRITE_TIMEOUT_S)], log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        yield url
    finally:
        stop_server(proc)


def _used_blocks(url: str) -> int:
    """Blocks held by requests, from the server's /kv/state."""
    return httpx.get(f"{url}/kv/state", timeout=10).json()["counters"]["used_blocks"]


def _body(n: int) -> dict:
    return {"model": "tiny", "prompt": "the KV cache " * 4, "max_tokens": MAX_TOKENS, "stream": True, "n": n,
            "logprobs": 20, "ignore_eos": True, "temperature": 0}


def _stalled_stream(url: str) -> socket.socket:
    """A socket that sent a streamed completions request and will never read its answer."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connect: the window stays small
    sock.connect((host, int(port)))
    body = json.dumps(_body(NUM_SAMPLES)).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body)
    return sock


def _counted(url: str) -> float:
    return metrics(url).get("pagedllm:stream_write_timeouts_total", 0.0)


def test_a_client_that_reads_nothing_is_aborted_and_its_blocks_freed(server: str) -> None:
    url = server
    assert httpx.get(f"{url}/kv/state", timeout=10).json()["num_blocks"] == NUM_BLOCKS
    assert _used_blocks(url) == 0 and _counted(url) == 0
    generated_before = metrics(url)["pagedllm:generation_tokens_total"]
    sock = _stalled_stream(url)
    try:
        deadline = time.monotonic() + 60
        while _used_blocks(url) == 0:  # it runs
            assert time.monotonic() < deadline, "the stalled request never ran"
            time.sleep(0.05)
        started = time.monotonic()
        # aborted within the write timeout once the buffers are full: seconds, where running to
        # max_tokens holds the blocks for the whole generation
        while _used_blocks(url) > 0:
            assert time.monotonic() - started < 30, "the stalled stream still holds its blocks"
            time.sleep(0.05)
        freed_after = time.monotonic() - started
        assert _counted(url) == 1
        m = metrics(url)
        assert m.get('pagedllm:request_success_total{"finished_reason": "length"}', 0) == 0  # not to its end
        generated = m["pagedllm:generation_tokens_total"] - generated_before
        assert generated < NUM_SAMPLES * MAX_TOKENS  # it did not run to max_tokens
        print(f"freed {freed_after:.2f}s after it started, {generated:.0f} of {NUM_SAMPLES * MAX_TOKENS} tokens generated")
    finally:
        sock.close()


def test_a_client_that_reads_gets_its_whole_stream(server: str) -> None:
    counted = _counted(server)
    with httpx.stream("POST", f"{server}/v1/completions", json=_body(1), timeout=120) as resp:
        assert resp.status_code == 200
        chunks = [json.loads(d) for d in sse_events(resp.iter_lines()) if d != "[DONE]"]
    text_chunks = [c for c in chunks if c["choices"]]
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in text_chunks) == MAX_TOKENS
    assert _counted(server) == counted


def test_bad_stream_write_timeouts_are_refused() -> None:
    from pagedllm.entrypoints.openai.settings import ServerSettings

    for bad in (0, -1.0, float("inf"), float("nan"), True, "5"):
        with pytest.raises(ValueError, match="stream_write_timeout_s must be a (positive |finite )?number"):
            ServerSettings(model_name="m", stream_write_timeout_s=bad)
    assert ServerSettings(model_name="m", stream_write_timeout_s=None).stream_write_timeout_s is None
