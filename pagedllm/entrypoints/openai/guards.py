"""What a request must pass before a route sees it: Host, API key, body size, content type.

A server on loopback is reachable from every web page the user opens: a page
can POST to ``127.0.0.1:8000`` without a CORS preflight when the body is a
"simple" content type (``text/plain``, forms), and a DNS-rebinding page
(``evil.example`` resolving to 127.0.0.1) can even read the answers. Two
checks close that, as ASGI middleware ahead of the app:

- **Host**: bound to a loopback address, the server answers only requests
  whose ``Host`` names loopback (``localhost``, ``127.x.y.z``, ``[::1]``) or a
  host listed with ``--allowed-hosts``; a rebinding page sends its own name.
- **Content type**: JSON routes take ``application/json`` only (415 else), so
  a cross-origin page must ask first (preflight), and without
  ``--allowed-origins`` the server never says yes.

Then the key (``--api-key``, on every route but ``OPEN_ROUTES``: probes, the API's description, the ``/kv`` page)
and the body size (``--max-request-bytes``: a declared ``Content-Length``
over it is refused before a byte is read; a chunked body is counted as it
arrives). Every refusal is an OpenAI-style JSON error. A 413 closes the
connection; the rest of the body the client is still sending is read and
thrown away for a while first (``http_protocol.py``'s lingering close), so a
client that sends its whole body before reading still gets the 413.
"""

from __future__ import annotations

import hmac
import ipaddress

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.entrypoints.openai.json_response import OpenAIJSONResponse
from pagedllm.entrypoints.openai.protocol import APIError

# the default --max-request-bytes: a 128-prompt batch of 2048 token ids is under 2 MiB
DEFAULT_MAX_REQUEST_BYTES = 8 << 20
# routes open without the API key: probes and scrapers that hold no key, the API's
# description, and the live KV page (a browser sends no key when it opens a page,
# EventSource never does)
OPEN_ROUTES = ("/health", "/metrics", "/openapi.json", "/docs", "/kv", "/kv/state", "/kv/events")
# the API's description and its Swagger UI files: a browser cannot send the key, and they hold no data
OPEN_PREFIXES = ("/docs/static/",)
LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    """Whether a bind address or a Host name is loopback (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The host part of a ``Host`` header: ``[::1]:8000`` -> ``::1``, ``a.b:80`` -> ``a.b``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


async def _send_error(scope: Scope, receive: Receive, send: Send, err: APIError) -> None:
    await OpenAIJSONResponse(err.body(), status_code=err.status_code, headers=err.headers)(scope, receive, send)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


class HostCheckMiddleware:
    """Refuse requests whose ``Host`` is not allowed (400), before anything else runs.

    Args:
        app: the wrapped app.
        allowed_hosts: names let through besides loopback ones; ``"*"`` lets
            every name through.
    """

    def __init__(self, app: ASGIApp, allowed_hosts: list[str]) -> None:
        self.app = app
        self.allow_all = "*" in allowed_hosts
        self.allowed = {h.lower().strip("[]") for h in allowed_hosts}

    def allows(self, host_header: str) -> bool:
        name = _host_name(host_header)
        return self.allow_all or is_loopback(name) or name in self.allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = (_header(scope, b"host") or b"").decode("latin-1")
            if not self.allows(host):
                err = APIError(
                    400, f"the Host header {host!r} is not allowed on this server; start it with "
                    "--allowed-hosts to accept it", "invalid_request_error", "invalid_host",
                )
                await _send_error(scope, receive, send, err)
                return
        await self.app(scope, receive, send)


class APIKeyMiddleware:
    """Key authentication on every route but ``OPEN_ROUTES``, checked before the body is read.

    The key comes as ``Authorization: Bearer KEY`` (OpenAI's clients) or
    ``x-api-key: KEY`` (Anthropic's). The comparisons are constant-time. CORS
    preflights (``OPTIONS``) carry no credentials by design, so they pass to the CORS layer.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.expected_key = api_key.encode()

    def _authorized(self, scope: Scope) -> bool:
        bearer = hmac.compare_digest(_header(scope, b"authorization") or b"", self.expected)
        x_api_key = hmac.compare_digest(_header(scope, b"x-api-key") or b"", self.expected_key)
        return bearer or x_api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        open_route = path in OPEN_ROUTES or path.startswith(OPEN_PREFIXES)
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and not open_route:
            if not self._authorized(scope):
                err = APIError(401, "Incorrect API key provided.", "invalid_request_error", "invalid_api_key")
                err.headers = {"WWW-Authenticate": "Bearer"}
                await _send_error(scope, receive, send, err)
                return
        await self.app(scope, receive, send)


def _too_large(limit: int) -> APIError:
    # the rest of the body is not read: the connection cannot carry another request after it
    return APIError(
        413, f"the request body is larger than this server's limit of {limit} bytes (--max-request-bytes)",
        "invalid_request_error", "request_too_large", headers={"Connection": "close"},
    )


class BodyLimitMiddleware:
    """413 for a body over ``max_bytes``: at once from ``Content-Length``, or as a chunked body grows."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.max_bytes
            except ValueError:
                too_big = False  # the HTTP server refuses a malformed length itself
            if too_big:
                # answered unread; the server discards the rest before it closes (a lingering close)
                await _send_error(scope, receive, send, _too_large(self.max_bytes))
                return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _too_large(self.max_bytes)
            return message

        await self.app(scope, counted, send)


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def require_json(request: Request) -> None:
    """A route dependency: 415 unless the body is declared JSON (so a cross-origin page must preflight)."""
    content_type = request.headers.get("content-type", "")
    if not _is_json(content_type):
        raise APIError(
            415, f"the request body must be JSON (Content-Type: application/json), got {content_type or 'none'!r}",
            "invalid_request_error", "unsupported_media_type",
        )
