"""What ``pagedllm serve`` needs besides the engine: names, key, limits, address."""

from __future__ import annotations

import time
from dataclasses import field
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from pagedllm.config_record import NonEmptyStr, PositiveFloat, PositiveInt, config_record
from pagedllm.entrypoints.openai.guards import DEFAULT_MAX_REQUEST_BYTES, is_loopback
from pagedllm.entrypoints.openai.http_protocol import HTTPLimits
from pagedllm.entrypoints.openai.sse import DEFAULT_STREAM_WRITE_TIMEOUT_S
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS


def _check_tool_call_parser(name: str) -> str:
    if name != "auto" and name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser {name!r} is unknown; known: auto, {', '.join(sorted(TOOL_PARSERS))}")
    return name


LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]


@config_record
class ServerSettings:
    """What ``pagedllm serve`` needs besides the engine.

    Args:
        model_name: the name clients use in ``model``.
        model_path: where the weights came from (shown in /v1/models).
        api_key: when set, every /v1 route needs ``Authorization: Bearer <key>``.
        max_waiting: most requests waiting for their first token before new
            ones get 429; None: no limit.
        host: address to bind (loopback by default).
        port: TCP port.
        log_level: uvicorn's log level.
        max_request_bytes: largest request body; larger ones get 413 unread.
        allowed_hosts: ``Host`` names accepted besides loopback ones while
            bound to loopback (``["*"]``: any); None: loopback names only.
            Bound elsewhere, None accepts any name.
        allowed_origins: origins a browser may call from (CORS); None: no
            CORS headers at all, so no other origin can read an answer.
        tool_call_parser: the model's tool-call format for ``tool_choice="auto"``:
            ``hermes``, ``llama3_json``, or ``auto`` (read from the chat template).
        kv_page: serve the live KV-cache page (``/kv``, ``/kv/state``, ``/kv/events``).
        http_limits: header deadline and count, lingering close (``http_protocol.py``).
        default_max_tokens: the most tokens a reply gets when its request sets
            no ``max_tokens`` / ``max_completion_tokens``; None: no cap (to the
            end of the context). Never raises or lowers a request's own value.
        stream_write_timeout_s: seconds one write of a streamed answer may wait
            for a client that reads nothing; past it the stream ends and its
            request is aborted (``sse.py``). None: no bound.
    """

    model_name: str
    model_path: str = ""
    api_key: str | None = None
    max_waiting: PositiveInt | None = 1024
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    log_level: LogLevel = "info"
    max_request_bytes: PositiveInt = DEFAULT_MAX_REQUEST_BYTES
    allowed_hosts: list[NonEmptyStr] | None = None
    allowed_origins: list[NonEmptyStr] | None = None
    tool_call_parser: Annotated[str, AfterValidator(_check_tool_call_parser)] = "auto"
    kv_page: bool = True
    http_limits: HTTPLimits = field(default_factory=HTTPLimits)
    default_max_tokens: PositiveInt | None = None
    stream_write_timeout_s: PositiveFloat | None = DEFAULT_STREAM_WRITE_TIMEOUT_S
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def host_check(self) -> list[str] | None:
        """The extra Host names to allow, or None when no Host check applies."""
        if self.allowed_hosts is not None:
            return self.allowed_hosts
        return [] if is_loopback(self.host) else None

