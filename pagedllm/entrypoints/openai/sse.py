"""Streamed answers as server-sent events (``sse-starlette``), in OpenAI's framing.

A stream is ``data: {chunk}`` events, then (if asked) a usage chunk, then
``data: [DONE]``. ``sse-starlette`` watches for the client going away and
for the server shutting down; either way the request's engine work is
aborted (``on_close``), so no KV block outlives its reader.

A client that stays connected but stops reading is bounded too. Its events
fill the socket buffers (the kernel's, then uvicorn's 64 KiB), and then each
write waits for it; meanwhile the engine went on generating to ``max_tokens``
and held the request's blocks (20 such streams held 1,604 of 5,825 blocks,
issue 53). A write that stays blocked for ``StreamWrites.timeout_s``
(``--stream-write-timeout``) ends the stream: the request is aborted, its
blocks freed, and ``StreamWrites.on_timeout`` counts it
(``pagedllm:stream_write_timeouts_total``). The connection is then closed
(uvicorn closes it once the buffered bytes are out or the client goes).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from sse_starlette import EventSourceResponse
from sse_starlette.sse import SendTimeoutError
from starlette.types import Receive, Scope, Send

from pagedllm.engine.protocol import EngineDeadError, EngineStepError
from pagedllm.entrypoints.openai.engine_errors import engine_failure, server_error

logger = logging.getLogger(__name__)

# seconds a stream may keep running once the server is told to stop: a little
# over the engine's own drain time (api_server.SHUTDOWN_GRACE_S), which ends
# every request in flight with a final event first
STREAM_SHUTDOWN_GRACE_S = 6.0
# seconds one write of a stream may wait for a client that reads nothing (--stream-write-timeout)
DEFAULT_STREAM_WRITE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class StreamWrites:
    """How long one write of a stream may stay blocked on its client, and what counts a stream ended so.

    Args:
        timeout_s: seconds; None: no bound (a stalled reader holds its request until ``max_tokens``).
        on_timeout: called once for each stream ended by the bound (the server's metric), if set.
    """

    timeout_s: float | None = DEFAULT_STREAM_WRITE_TIMEOUT_S
    on_timeout: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf")):
            raise ValueError(f"stream write timeout must be a finite number of seconds > 0 or None, got {t!r}")


class _BoundedEventSource(EventSourceResponse):
    """An event stream whose blocked writes end it after ``StreamWrites.timeout_s`` (sse-starlette's
    ``send_timeout``: it closes the events, which aborts the request) and are counted."""

    def __init__(self, *args: Any, writes: StreamWrites, **kwargs: Any) -> None:
        super().__init__(*args, send_timeout=writes.timeout_s, **kwargs)
        self._writes = writes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            # the client is connected and reads nothing: its request is aborted (the events were
            # closed), and uvicorn closes the connection
            logger.info("a stream to %s was ended: its client read nothing for %g s (--stream-write-timeout)",
                        scope.get("client"), self._writes.timeout_s)
            if self._writes.on_timeout is not None:
                self._writes.on_timeout()


def sse_response(
    events: AsyncIterator[str], on_close: Callable[[], None], writes: StreamWrites | None = None
) -> EventSourceResponse:
    """An event-stream response of ``events`` (each a JSON text or ``[DONE]``).

    ``on_close`` runs however the stream ends: finished, client gone, a write
    blocked past ``writes.timeout_s`` (default ``StreamWrites()``), or
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
    return _BoundedEventSource(
        guarded(), ping=0, sep="\n", shutdown_grace_period=STREAM_SHUTDOWN_GRACE_S,
        headers={"Cache-Control": "no-cache"}, writes=writes if writes is not None else StreamWrites(),
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
