"""The pieces behind issue 53's refusals, without a model: fast.

- ``find_lone_surrogate`` finds a lone UTF-16 surrogate anywhere in a parsed
  body (strings, keys, nested lists), and skips a million token ids quickly;
- ``OpenAIJSONResponse`` writes one as JSON's escape instead of failing;
- ``LastResortMiddleware`` answers a route's bug with a JSON 500 and the
  keep-alive connection goes on (Starlette's own handler closed it);
- ``FramingCheckedConnection`` refuses ``Transfer-Encoding`` with
  ``Content-Length`` and remembers h11's reason for a malformed request.
"""

from __future__ import annotations

import json
import time

import h11
import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from pagedllm.entrypoints.openai.http_protocol import FramingCheckedConnection, _protocol_error_body
from pagedllm.entrypoints.openai.json_response import OpenAIJSONResponse, find_lone_surrogate
from pagedllm.entrypoints.openai.last_resort import LastResortMiddleware


@pytest.mark.parametrize("body,where", [
    ({"model": "\ud800"}, ("model", 0)),
    ({"model": "ok", "messages": [{"role": "user", "content": "ab\udfff"}]}, ("messages[0].content", 2)),
    ({"prompt": [[1, 2], ["x", "y\udc80"]]}, ("prompt[1][1]", 1)),
    ({"logit_bias": {"\ud83d": 1.0}}, ("a key of logit_bias", 0)),
    ("\udbff", ("the request body", 0)),
    ({"a": "\U0001f600 ok", "b": [1, 2.5, None, True]}, None),  # a surrogate pair written as one char is text
])
def test_find_lone_surrogate(body: object, where: tuple[str, int] | None) -> None:
    assert find_lone_surrogate(body) == where


def test_find_lone_surrogate_skips_numbers_quickly() -> None:
    body = {"prompt": list(range(1_000_000)), "stop": ["x\ud800"]}
    start = time.perf_counter()
    assert find_lone_surrogate(body) == ("stop[0]", 1)
    assert time.perf_counter() - start < 1.0  # ~0.03 s: one C-level pass over the ids


def test_a_response_holding_a_surrogate_is_written_escaped() -> None:
    plain = OpenAIJSONResponse({"m": "caf\u00e9"})
    assert plain.body == '{"m":"café"}'.encode()  # UTF-8 as before when it can be
    escaped = OpenAIJSONResponse({"m": "a\ud800\u00e9"})
    assert escaped.body == b'{"m":"a\\ud800\\u00e9"}'
    assert json.loads(escaped.body) == {"m": "a\ud800\u00e9"}


def _app_with_a_bug() -> FastAPI:
    app = FastAPI(default_response_class=OpenAIJSONResponse)

    @app.get("/bug")
    async def bug() -> dict:
        raise RuntimeError("a bug")

    @app.get("/ok")
    async def ok() -> dict:
        return {"ok": True}

    app.add_middleware(LastResortMiddleware)
    return app


def test_a_bug_is_a_json_500_that_keeps_the_connection() -> None:
    with TestClient(_app_with_a_bug(), raise_server_exceptions=True) as client:
        resp = client.get("/bug")  # would raise here if the exception went on to the server
        assert resp.status_code == 500
        assert resp.json()["error"] == {"message": "internal error: RuntimeError", "type": "server_error",
                                        "param": None, "code": "internal_error"}
        assert client.get("/ok").json() == {"ok": True}


def _feed(request: bytes) -> tuple[FramingCheckedConnection, BaseException | None]:
    conn = FramingCheckedConnection(h11.SERVER)
    conn.receive_data(request)
    try:
        conn.next_event()
    except h11.RemoteProtocolError as e:
        return conn, e
    return conn, None


@pytest.mark.parametrize("length", [b"-5", b"1e3", b"0x10"])
def test_a_malformed_content_length_keeps_h11s_reason(length: bytes) -> None:
    conn, error = _feed(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: " + length + b"\r\n\r\n")
    assert error is conn.last_error is not None
    status, body = _protocol_error_body(conn.last_error)
    assert status == 400
    assert json.loads(body)["error"] == {"message": "invalid HTTP/1.1 request: bad Content-Length",
                                         "type": "invalid_request_error", "param": None,
                                         "code": "invalid_http_request"}


def test_both_framing_headers_are_refused_and_either_alone_is_not() -> None:
    head = b"POST / HTTP/1.1\r\nHost: a\r\n"
    conn, error = _feed(head + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n")
    assert error is not None and "Transfer-Encoding and Content-Length" in str(error)
    assert _protocol_error_body(conn.last_error)[0] == 400
    for framing in (b"Transfer-Encoding: chunked\r\n", b"Content-Length: 5\r\n"):
        assert _feed(head + framing + b"\r\n")[1] is None


def test_an_unknown_transfer_coding_is_a_400_too() -> None:
    conn, error = _feed(b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n")
    assert error is not None and error.error_status_hint == 501  # h11's hint; every refusal here is a 4xx
    status, body = _protocol_error_body(conn.last_error)
    assert status == 400 and json.loads(body)["error"]["code"] == "unsupported_transfer_encoding"
