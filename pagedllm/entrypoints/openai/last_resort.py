"""The 500 for a bug in a route, answered so that the connection goes on serving.

A handler for ``Exception`` in FastAPI runs in Starlette's outermost
middleware, which sends its answer and then raises the exception again;
uvicorn, seeing an exception after the answer started, closes the
connection, and a keep-alive client's next request on it is never answered.
This middleware, inside the app's own error handling, catches what a route
raised before its answer started, logs it and answers the 500 itself, so the
connection stays usable. An exception after the answer started (a stream
cut mid-way) is raised as before: that answer cannot be completed.
"""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.entrypoints.openai.engine_errors import server_error
from pagedllm.entrypoints.openai.json_response import OpenAIJSONResponse

logger = logging.getLogger(__name__)


class LastResortMiddleware:
    """Answer an unexpected exception raised before the response started with a JSON 500."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception as exc:  # noqa: BLE001 - the last handler: everything a route raised
            if started:
                raise
            logger.exception("unexpected error in %s", scope.get("path", ""))
            err = server_error(f"internal error: {type(exc).__name__}")
            await OpenAIJSONResponse(err.body(), status_code=500)(scope, receive, send)
