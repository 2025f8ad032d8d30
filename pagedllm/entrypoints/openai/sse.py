"""Streamed answers as server-sent events (``sse-starlette``), in OpenAI's framing.

A stream is ``data: {chunk}`` events, then (if asked) a usage chunk, then
``data: [DONE]``. ``sse-starlette`` watches for the client going away and
for the server shutting down; either way the request's engine work is
aborted (``on_close``), so no KV block outlives its reader.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from sse_starlette import EventSourceResponse

from pagedllm.engine.protocol import EngineDeadError, EngineStepError
from pagedllm.entrypoints.openai.engine_errors import engine_failure, server_error

logger = logging.getLogger(__name__)

# seconds a stream may keep running once the server is told to stop: a little
# over the engine's own drain time (api_server.SHUTDOWN_GRACE_S), which ends
# every request in flight with a final event first
STREAM_SHUTDOWN_GRACE_S = 6.0


def sse_response(events: AsyncIterator[str], on_close: Callable[[], None]) -> EventSourceResponse:
    """An event-stream response of ``events`` (each a JSON text or ``[DONE]``).

    ``on_close`` runs however the stream ends: finished, client gone, or
    cancelled at shutdown.
    """

    async def guarded() -> AsyncIterator[str]:
        try:
            async for data in events:
                yield data
        finally:
            on_close()

    # no pings: OpenAI's streams carry only data events, and some clients'
    # hand-written parsers choke on comment lines
    return EventSourceResponse(
        guarded(), ping=0, sep="\n", shutdown_grace_period=STREAM_SHUTDOWN_GRACE_S,
        headers={"Cache-Control": "no-cache"},
    )


async def sse_chunks(
    header: dict[str, Any],
    include_usage: bool,
    choices: AsyncIterator[list[dict[str, Any]]],
    usage: Callable[[], dict[str, Any]],
) -> AsyncIterator[str]:
    """The data of one streamed response: a chunk per batch of choices, then
    (if asked) a usage chunk, then ``[DONE]``. A failure ends this stream
    only, with an error event."""
    try:
        async for batch in choices:
            body: dict[str, Any] = {**header, "choices": batch}
            if include_usage:
                body["usage"] = None  # OpenAI: null on every chunk but the last
            yield _json(body)
        if include_usage:
            yield _json({**header, "choices": [], "usage": usage()})
    except (EngineStepError, EngineDeadError) as e:
        yield _json(engine_failure(e).body())
    except Exception as e:  # a bug here fails this stream only, with a message
        logger.exception("streaming failed")
        yield _json(server_error(f"internal error: {type(e).__name__}").body())
    yield "[DONE]"


def _json(data: dict[str, Any]) -> str:
    return json.dumps(data, ensure_ascii=False)


async def watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> None:
    """Call ``on_disconnect`` if the client leaves before its (non-streamed) answer."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return
