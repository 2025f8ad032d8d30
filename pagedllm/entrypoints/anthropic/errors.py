"""Every error answer on the Anthropic routes in Anthropic's shape.

The server's errors are OpenAI's ``{"error": {"message", "type", "param",
"code"}}`` (``protocol.APIError``), whoever raises them: a guard (API key
401, body size 413, content type 415), FastAPI's validation (400), a
handler. Anthropic's clients read ``{"type": "error", "error": {"type",
"message"}}`` with Anthropic's error types. ``AnthropicErrorMiddleware``
sits outermost and rewrites the JSON error answers of ``/v1/messages...``
as they leave, so every path to an error is covered at once; successful
answers and streams pass untouched. An error inside a stream is an
``error`` event with the same body.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# the routes whose errors are rewritten
MESSAGES_PREFIX = "/v1/messages"
# Anthropic's error type for each status (docs: API errors)
_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def _rewrite(body: bytes, status: int) -> bytes | None:
    """The Anthropic body for an OpenAI-shaped error body; None when ``body`` is not one."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str) or data.get("type") == "error":
        return None
    return json.dumps(anthropic_error(status, error["message"]), ensure_ascii=True).encode()


class AnthropicErrorMiddleware:
    """Rewrites the JSON error answers (status >= 400) of ``MESSAGES_PREFIX`` routes in Anthropic's shape."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith(MESSAGES_PREFIX):
            await self.app(scope, receive, send)
            return
        held: list[Message] = []  # an error's start, held until its body is whole
        chunks: list[bytes] = []

        async def rewriting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held.append(message)
                return
            if not held or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            start, body = held.pop(), b"".join(chunks)
            new = _rewrite(body, start["status"])
            if new is not None:
                headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                start = {**start, "headers": [*headers, (b"content-length", str(len(new)).encode())]}
                body = new
            await send(start)
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewriting_send)
