"""A client's mistakes are 4xx OpenAI errors and the connection goes on serving (issue 53, items 1-3).

On a real ``pagedllm serve`` (the bundled SmolLM2, its own HTTP protocol),
over raw sockets, so that what happens to the connection is seen:

- a lone UTF-16 surrogate in ``model`` (JSON ``\\ud800`` or the raw bytes
  ``ED A0 80``) on the four JSON routes, and in every other string field, is
  a 400 naming the field; a second request on the same keep-alive connection
  is answered normally (it used to be a 500, then a dead connection);
- sampling settings that leave no token to sample: a 400 where it can be
  known up front (the issue's triggers, verbatim), else a clean finish with
  ``finish_reason: "no_valid_token"``;
- framing errors (``Content-Length: -5``, ``1e3``, ``0x10``) and
  ``Transfer-Encoding`` with ``Content-Length`` are JSON 400s that close the
  connection, and the server goes on serving others.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import served_with_port, wait_kv_free

pytestmark = pytest.mark.slow  # a real server: outside the fast tier

SERVER_ARGS = ["--num-kv-blocks", "96", "--max-model-len", "256", "--num-threads", "1", "--max-num-seqs", "8",
               "--no-kv-page"]
SECOND = ("/tokenize", b'{"prompt": "hi"}')  # the keep-alive follow-up: always a 200


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    yield from served_with_port(SERVER_ARGS, tmp_path_factory.mktemp("client-mistakes"))


def _post(sock: socket.socket, route: str, body: bytes, extra_headers: str = "") -> None:
    head = (f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{extra_headers}"
            f"Content-Length: {len(body)}\r\n\r\n")
    sock.sendall(head.encode() + body)


def _read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One answer with a ``Content-Length`` body: (status, headers, body); raises if the server closes first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"the server closed the connection after {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection mid-body")
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _assert_error_shape(status: int, body: bytes, expected_status: int, param: str | None = None) -> dict:
    assert status == expected_status, body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def _then_served(sock: socket.socket) -> None:
    """A second request on the same connection is answered normally."""
    _post(sock, *SECOND)
    status, _, body = _read_answer(sock)
    assert status == 200 and json.loads(body)["count"] == 1, body


def _refused_then_served(port: int, route: str, body: bytes, param: str | None) -> dict:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        _post(sock, route, body)
        status, _, answer = _read_answer(sock)
        err = _assert_error_shape(status, answer, 400, param)
        _then_served(sock)
    return err


# --- 1. lone surrogates ---------------------------------------------------------------------------

MODEL_TRIGGERS = {
    "/tokenize": b'{"model": %s, "prompt": "x"}',
    "/detokenize": b'{"model": %s, "tokens": [1]}',
    "/v1/completions": b'{"model": %s, "prompt": "x", "max_tokens": 1}',
    "/v1/chat/completions": b'{"model": %s, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}',
}
SURROGATES = {"json-escape": b'"\\ud800"', "raw-bytes": b'"\xed\xa0\x80"'}


@pytest.mark.parametrize("encoding", SURROGATES)
@pytest.mark.parametrize("route", MODEL_TRIGGERS)
def test_a_lone_surrogate_in_model_is_400_and_the_connection_lives(server: dict, route: str, encoding: str) -> None:
    err = _refused_then_served(server["port"], route, MODEL_TRIGGERS[route] % SURROGATES[encoding], "model")
    assert err["code"] == "invalid_value" and "lone surrogate" in err["message"]


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COMPLETION = {"prompt": "hi", "max_tokens": 1}
TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
# (route, body with the marker "@" where the surrogate goes, the param named, or None for a key)
STRING_FIELDS = [
    ("/v1/completions", {**COMPLETION, "prompt": "@"}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["ok", "@"]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "stop": ["ok", "@"]}, "stop"),
    ("/v1/completions", {**COMPLETION, "bad_words": ["@"]}, "bad_words"),
    ("/v1/completions", {**COMPLETION, "user": "@"}, "user"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"@": 1.0}}, None),
    ("/v1/completions", {**COMPLETION, "@": 1}, None),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "a@"}}, "structured_outputs"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"choice": ["a", "@"]}}, "structured_outputs"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"grammar": "root ::= \"@\""}}, "structured_outputs"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"json": {"type": "object", "title": "@"}}},
     "structured_outputs"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "@"}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "@"}]}]},
     "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi", "name": "@"}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "@", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "@", "schema": {"type": "object"}}}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "tools": [{**TOOL, "function": {**TOOL["function"], "name": "@"}}]}, "tools"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "@"}}},
     "tool_choice"),
    ("/tokenize", {"prompt": "@"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "@"}]}, "messages"),
]


@pytest.mark.parametrize("route,body,param", STRING_FIELDS)
def test_a_lone_surrogate_in_any_string_is_400(server: dict, route: str, body: dict, param: str | None) -> None:
    raw = json.dumps(body).replace("@", "\\udc80").encode()  # json.dumps escapes nothing in "@"
    err = _refused_then_served(server["port"], route, raw, param)
    assert "lone surrogate" in err["message"], err


def test_an_unknown_model_is_still_404(server: dict) -> None:
    with socket.create_connection(("127.0.0.1", server["port"]), timeout=60) as sock:
        _post(sock, "/v1/completions", json.dumps({**COMPLETION, "model": "gpt-\u00e9"}).encode())
        status, _, body = _read_answer(sock)
        err = _assert_error_shape(status, body, 404, "model")
        assert err["code"] == "model_not_found" and "gpt-\u00e9" in err["message"]
        _then_served(sock)


# --- 2. sampling settings that leave no token ---------------------------------------------------


def _token(url: str, word: str) -> int:
    (token,) = httpx.post(f"{url}/tokenize", json={"prompt": word, "add_special_tokens": False}).json()["tokens"]
    return token


def test_the_issues_no_token_triggers_are_400s(server: dict) -> None:
    port = server["port"]
    err = _refused_then_served(port, "/v1/completions", json.dumps(
        {"prompt": "Once", "max_tokens": 4, "allowed_token_ids": [0], "bad_words": ["<|endoftext|>"]}).encode(),
        "allowed_token_ids")
    assert "banned by bad_words" in err["message"] and "structured output" not in err["message"]
    err = _refused_then_served(port, "/v1/completions", json.dumps(
        {"prompt": "Once", "max_tokens": 4, "n": 2, "allowed_token_ids": list(range(100)),
         "structured_outputs": {"json": {"type": "object"}}}).encode(), "allowed_token_ids")
    assert "start the structured output" in err["message"]
    err = _refused_then_served(port, "/v1/chat/completions", json.dumps(
        {**CHAT, "max_tokens": 8, "min_tokens": 4, "structured_outputs": {"choice": ["yes", "no"]}}).encode(),
        "min_tokens")
    assert "more tokens than any structured_outputs.choice" in err["message"]


def test_a_choice_with_min_tokens_2_finishes_cleanly(server: dict) -> None:
    """The issue's ``choice`` with ``min_tokens: 2``: runs, and where it dead-ends it says so."""
    url = server["url"]
    body = {"prompt": "Answer:", "max_tokens": 4, "min_tokens": 2, "structured_outputs": {"choice": ["yes", "no"]}}
    with socket.create_connection(("127.0.0.1", server["port"]), timeout=120) as sock:
        _post(sock, "/v1/completions", json.dumps(body).encode())
        status, _, answer = _read_answer(sock)
        assert status == 200, answer
        (choice,) = json.loads(answer)["choices"]
        assert choice["text"] in ("yes", "no") and choice["finish_reason"] in ("stop", "no_valid_token")
        # only whole-word tokens allowed: one token, then only EOS, which the allowed ids leave out
        dead_end = {**body, "n": 2, "allowed_token_ids": [_token(url, "yes"), _token(url, "no")]}
        _post(sock, "/v1/completions", json.dumps(dead_end).encode())
        status, _, answer = _read_answer(sock)
        assert status == 200, answer
        for c in json.loads(answer)["choices"]:
            assert c["text"] in ("yes", "no") and c["finish_reason"] == "no_valid_token", c
        _then_served(sock)
    assert wait_kv_free(url) == 0


def test_a_streamed_dead_end_ends_with_its_finish_reason(server: dict) -> None:
    url = server["url"]
    body = {**CHAT, "max_tokens": 4, "stream": True, "structured_outputs": {"choice": ["yes", "no"]},
            "allowed_token_ids": [_token(url, "yes"), _token(url, "no")]}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) in ("yes", "no")
    assert chunks[-1]["choices"][0]["finish_reason"] == "no_valid_token"
    assert not any("error" in c for c in chunks)


# --- 3. HTTP framing ------------------------------------------------------------------------------


def _raw_answer(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes, bool]:
    """Send raw bytes; (status, headers, body, whether the server then closed the connection)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(raw)
        status, headers, body = _read_answer(sock)
        sock.settimeout(10)
        closed = sock.recv(65536) == b""
    return status, headers, body, closed


@pytest.mark.parametrize("length", ["-5", "1e3", "0x10"])
def test_a_malformed_content_length_is_a_json_400(server: dict, length: str) -> None:
    raw = (f"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           f"Content-Length: {length}\r\n\r\n").encode() + SECOND[1]
    status, headers, body, closed = _raw_answer(server["port"], raw)
    err = _assert_error_shape(status, body, 400)
    assert headers["content-type"] == "application/json" and err["code"] == "invalid_http_request"
    assert "Content-Length" in err["message"]
    assert closed and headers["connection"] == "close"


def test_transfer_encoding_with_content_length_is_refused(server: dict) -> None:
    body = SECOND[1]
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    raw = (f"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           f"Transfer-Encoding: chunked\r\nContent-Length: {len(body)}\r\n\r\n").encode() + chunked
    status, headers, answer, closed = _raw_answer(server["port"], raw)
    err = _assert_error_shape(status, answer, 400)
    assert err["code"] == "invalid_http_request" and "Transfer-Encoding and Content-Length" in err["message"]
    assert closed
    # chunked alone is served
    alone = raw.replace(f"Content-Length: {len(body)}\r\n".encode(), b"Connection: close\r\n")
    assert _raw_answer(server["port"], alone)[0] == 200


def test_the_server_logged_no_traceback(server: dict) -> None:
    assert httpx.get(f"{server['url']}/health").status_code == 200
    log = Path(server["log"]).read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
