"""``pagedllm serve``'s connection limits (``http_protocol.py``) on a real server and model.

- A body over ``--max-request-bytes`` is answered 413 and the rest of it is read
  and discarded (a lingering close), so even a client that sends its whole body
  before reading (stdlib ``urllib``) reads the 413; the discarded bytes are never
  buffered.
- A connection sending its headers a byte at a time is closed (408) within
  ``--header-timeout``; past ``--max-header-connections`` the longest waiting is
  closed at once; requests and streams made meanwhile are answered promptly.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import httpx
import psutil
import pytest

from pagedllm.entrypoints import cli
from pagedllm.entrypoints.openai.http_protocol import HTTPLimits
from tests.server_helpers import free_port, launch_server, sse_events, stop_server, wait_healthy

pytestmark = pytest.mark.slow  # real servers or subprocesses: outside the fast tier

BODY_LIMIT = 1 << 20
BIG_BODY_BYTES = 20 << 20
HEADER_TIMEOUT_S = 4.0
MAX_HEADER_CONNECTIONS = 8
SERVER_ARGS = [
    "--num-kv-blocks", "64", "--max-model-len", "256", "--num-threads", "1", "--max-num-seqs", "4", "--no-kv-page",
    "--max-request-bytes", str(BODY_LIMIT), "--header-timeout", str(HEADER_TIMEOUT_S),
    "--max-header-connections", str(MAX_HEADER_CONNECTIONS),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    port = free_port()
    log = tmp_path_factory.mktemp("http-limits") / "server.log"
    proc = launch_server(["--port", str(port), *SERVER_ARGS], log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        yield {"url": url, "port": port, "pid": proc.pid, "log": log}
    finally:
        stop_server(proc)


def _paced_body(num_bytes: int) -> Iterator[bytes]:
    """``num_bytes`` in 256 KiB pieces with a short pause between: the upload lasts long enough for the
    memory sampler to see a server that kept what it read."""
    piece = b"x" * (256 << 10)
    for _ in range(num_bytes // len(piece)):
        time.sleep(0.002)
        yield piece


def _urllib_post(url: str, body: bytes | Iterator[bytes], num_bytes: int | None) -> tuple[int, dict, dict]:
    """POST ``body`` to /tokenize with plain urllib; ``num_bytes`` declared as Content-Length (None: chunked).
    Returns (status, the JSON answer, its headers)."""
    headers = {"Content-Type": "application/json"}
    if num_bytes is not None:
        headers["Content-Length"] = str(num_bytes)
    req = urllib.request.Request(f"{url}/tokenize", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as e:  # a 4xx: what the test wants to read
        return e.code, json.loads(e.read()), dict(e.headers)


def _assert_413(status: int, body: dict, headers: dict) -> None:
    assert status == 413, body
    err = body["error"]
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert str(BODY_LIMIT) in err["message"] and "--max-request-bytes" in err["message"]
    assert headers.get("connection", headers.get("Connection", "")).lower() == "close"


def _assert_still_serves(url: str) -> None:
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    resp = httpx.post(f"{url}/tokenize", json={"prompt": "Hello there"}, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["count"] > 0


def test_urllib_reads_the_413_of_a_declared_20mb_body(server) -> None:  # noqa: ANN001
    body = b'{"prompt": "' + b"x" * (BIG_BODY_BYTES - 14) + b'"}'
    for _ in range(3):  # each time: it failed with ConnectionResetError 3 times of 3 before
        _assert_413(*_urllib_post(server["url"], body, len(body)))
    _assert_still_serves(server["url"])


def test_urllib_reads_the_413_of_a_chunked_20mb_body(server) -> None:  # noqa: ANN001
    for _ in range(2):
        _assert_413(*_urllib_post(server["url"], _paced_body(BIG_BODY_BYTES), None))
    _assert_still_serves(server["url"])


def _peak_rss_while(pid: int, work: threading.Thread) -> int:
    """The server's largest resident size, sampled every 5 ms while ``work`` runs (at most 120 s)."""
    proc = psutil.Process(pid)
    peak = proc.memory_info().rss
    deadline = time.monotonic() + 120
    while work.is_alive() and time.monotonic() < deadline:
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.005)
    return peak


def test_the_discarded_body_is_never_buffered(server) -> None:  # noqa: ANN001
    _assert_still_serves(server["url"])  # the routes' first use allocates what they keep
    baseline = psutil.Process(server["pid"]).memory_info().rss
    answers: list[tuple[int, dict, dict]] = []

    def upload() -> None:
        for chunked in (False, True, False):
            size = None if chunked else BIG_BODY_BYTES
            answers.append(_urllib_post(server["url"], _paced_body(BIG_BODY_BYTES), size))

    work = threading.Thread(target=upload)
    work.start()
    peak = _peak_rss_while(server["pid"], work)
    work.join(10)
    assert len(answers) == 3
    for answer in answers:
        _assert_413(*answer)
    # 60 MiB went through; a server that kept one body would grow by 20 MiB
    assert peak - baseline < 8 << 20, f"the server grew by {(peak - baseline) >> 20} MiB while discarding"
    _assert_still_serves(server["url"])


def test_an_early_answer_to_a_client_that_stopped_sending_closes_at_once(server) -> None:  # noqa: ANN001
    """A client that declared a big body, sent a little and waits for the answer sees it and the end of it."""
    head = (
        "POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {BIG_BODY_BYTES}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server["port"]), timeout=10) as sock:
        start = time.monotonic()
        sock.sendall(head.encode() + b'{"prompt": "')
        data = b""
        while chunk := sock.recv(65536):  # until the server's FIN
            data += chunk
        seconds = time.monotonic() - start
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    assert b"request_too_large" in data
    assert seconds < 5  # the answer is complete when sent: no waiting for a body that will not come


def _slow_header_clients(port: int, num_clients: int) -> list[socket.socket]:
    socks = []
    for _ in range(num_clients):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.setblocking(False)
        socks.append(sock)
    return socks


def _closed_now(sock: socket.socket) -> bytes | None:
    """What the server sent before closing ``sock`` (b"" if it reset it), or None while it is open."""
    if not select.select([sock], [], [], 0)[0]:
        return None
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except BlockingIOError:  # the answer came, the FIN not yet: it follows the 408 at once
        return data or None
    except ConnectionResetError:
        pass
    return data


def _trickle_headers(socks: list[socket.socket], opened: float, during: threading.Event) -> dict[int, tuple]:
    """Send each client's headers a byte per 0.25 s; return {client: (seconds after opening it was closed,
    what it got)}. Bounded: stops ``HEADER_TIMEOUT_S + 10`` s after opening."""
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 500
    closed: dict[int, tuple] = {}
    num_sent = 0
    while len(closed) < len(socks) and time.monotonic() - opened < HEADER_TIMEOUT_S + 10:
        for i, sock in enumerate(socks):
            if i in closed:
                continue
            got = _closed_now(sock)
            if got is None:
                try:
                    sock.send(head[num_sent : num_sent + 1])
                    continue
                except OSError:  # closed and reset between the check and the send
                    got = b""
            closed[i] = (time.monotonic() - opened, got)
        num_sent += 1
        during.set()
        time.sleep(0.25)
    return closed


def _normal_traffic(url: str, start: threading.Event) -> dict:
    """A /health, a /tokenize and a short stream while the slow clients hold their connections."""
    start.wait(30)
    time.sleep(1.5)  # every slow client has waited past MIN_EVICTABLE_S
    took = {}
    t = time.monotonic()
    took["health"] = (httpx.get(f"{url}/health", timeout=30).status_code, time.monotonic() - t)
    t = time.monotonic()
    took["tokenize"] = (httpx.post(f"{url}/tokenize", json={"prompt": "hi"}, timeout=30).status_code,
                        time.monotonic() - t)
    t = time.monotonic()
    body = {"prompt": "Count:", "max_tokens": 8, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
        events = list(sse_events(resp.iter_lines()))
    took["stream"] = (resp.status_code if events[-1] == "[DONE]" else -1, time.monotonic() - t)
    return took


def test_slow_header_clients_are_closed_and_others_are_served(server) -> None:  # noqa: ANN001
    num_clients = 2 * MAX_HEADER_CONNECTIONS
    socks = _slow_header_clients(server["port"], num_clients)
    opened = time.monotonic()
    started = threading.Event()
    took: dict = {}
    normal = threading.Thread(target=lambda: took.update(_normal_traffic(server["url"], started)))
    normal.start()
    try:
        closed = _trickle_headers(socks, opened, started)
    finally:
        for sock in socks:
            sock.close()
    normal.join(60)
    assert len(closed) == num_clients, f"{num_clients - len(closed)} slow clients still open after the timeout"
    evicted = [at for at, got in closed.values() if b"--max-header-connections" in got]
    timed_out = [at for at, got in closed.values() if b"--header-timeout" in got]
    for at, got in closed.values():
        assert got == b"" or got.startswith(b"HTTP/1.1 408"), got[:200]
        assert b"" == got or b'"request_timeout"' in got
        assert at < HEADER_TIMEOUT_S + 3
    assert len(evicted) + len(timed_out) >= num_clients // 2  # most saw the 408, not just a reset
    # the normal requests' connections made room: the longest waiting closed long before their timeout
    assert len(evicted) >= num_clients - MAX_HEADER_CONNECTIONS - 1, closed
    assert all(at < HEADER_TIMEOUT_S - 0.5 for at in evicted)
    assert all(at > HEADER_TIMEOUT_S - 0.1 for at in timed_out)  # the deadline, not something sooner
    for name in ("health", "tokenize", "stream"):
        status, seconds = took[name]
        assert status == 200, took
        assert seconds < 3, took  # not held up behind the slow clients' timeout
    _assert_still_serves(server["url"])


def test_the_header_timeout_bounds_headers_only(server) -> None:  # noqa: ANN001
    """Headers sent at once and a body sent slowly, over longer than the header timeout: answered 200."""
    body = json.dumps({"prompt": "Hello there"}).encode()
    head = (
        "POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server["port"]), timeout=30) as sock:
        sock.sendall(head)
        pause = (HEADER_TIMEOUT_S + 1) / 4
        for i in range(4):
            time.sleep(pause)
            sock.sendall(body[i * len(body) // 4 : (i + 1) * len(body) // 4])
        answer = _read_answer(sock)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["count"] > 0


def _read_answer(sock: socket.socket) -> bytes:
    """One whole answer with a Content-Length (the connection stays open after it)."""
    data = b""
    for _ in range(100):  # bounded: a few reads in practice
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                          if line.startswith(b"content-length:"))
            if len(body) >= length:
                return data
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    return data


def test_the_limits_reject_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ({"header_timeout_s": 0}, {"header_timeout_s": float("inf")}, {"max_header_connections": 0},
                {"linger_timeout_s": -1}, {"max_linger_bytes": -1}, {"max_header_connections": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            HTTPLimits(**bad)
    assert not HTTPLimits(linger_timeout_s=0).lingers and HTTPLimits().lingers
    for flag, value in (("--header-timeout", "0"), ("--max-header-connections", "0"), ("--linger-timeout", "-1"),
                        ("--max-linger-bytes", "-5")):
        assert cli.main(["serve", flag, value]) == 2  # refused before the model loads
        assert flag in capsys.readouterr().err
