"""The HTTP/1.1 connection ``pagedllm serve`` runs: uvicorn's h11 protocol with two bounds added.

**Header time and count.** uvicorn waits as long as a client likes for the
request line and headers, so a client sending them a byte at a time holds a
connection (and its memory) forever. Here a connection gets
``header_timeout_s`` from when it opens (or, kept alive, from the first byte
of its next request) until its headers are complete; past that it is closed,
with a 408 if it sent anything. At most ``max_header_connections`` may be
sending their headers at once: a new one past that closes the one that has
waited longest, if it has waited ``MIN_EVICTABLE_S`` (a burst of fast clients
connecting together evicts nobody).

**Lingering close.** An answer sent before the request body was read (the
413 of ``--max-request-bytes``) carries ``Connection: close``. uvicorn then
closes the socket at once; the kernel, holding unread bytes, answers with a
reset, and a client that sends its whole body before reading (Python's
``urllib``) gets ``ConnectionResetError`` instead of the 413. Here such a
connection is half-closed instead (the answer is complete, then FIN), and what
the client still sends is read and thrown away, never buffered, until it closes,
``max_linger_bytes`` were read, ``linger_timeout_s`` passed, or it sent nothing for
``LINGER_IDLE_S``; then the socket closes. nginx and Apache do the same
("lingering close").

**Framing errors in JSON, and one more refused.** A request h11 cannot
parse (``Content-Length: -5``, ``1e3``, ``0x10``, a bad chunk size...) was
answered by uvicorn in plain text ("Invalid HTTP request received."); here
it gets the OpenAI error body like every other refusal: a 400 with h11's
reason (``code`` ``unsupported_transfer_encoding`` for a transfer coding
other than chunked, where h11 would hint 501). A
request carrying both ``Transfer-Encoding`` and ``Content-Length`` is refused
the same way (400): h11 would read it as chunked, but a proxy in front that
trusts ``Content-Length`` would see another request boundary, the ingredient
of request smuggling; RFC 9112 section 6.3 lets a server reject it. Either
answer closes the connection: its framing can no longer be trusted.

Only the h11 protocol is extended: the server runs it even where ``httptools``
is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Annotated, Any

import h11
from uvicorn.protocols.http.h11_impl import (
    DEFAULT_MAX_INCOMPLETE_EVENT_SIZE,
    STATUS_PHRASES,
    H11Protocol,
)

from pagedllm.config_record import (
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    config_record,
)
from pagedllm.entrypoints.arg_fields import Flag
from pagedllm.entrypoints.openai.protocol import APIError

logger = logging.getLogger(__name__)

# a connection waiting this long for its headers may be closed to make room for a new one;
# a client sends its headers in milliseconds, so one this old at the head of the line is slow
MIN_EVICTABLE_S = 1.0
# a lingering connection that sends nothing for this long is done with its body (or stalled)
LINGER_IDLE_S = 2.0

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_HEADER_CONNECTIONS = 64
DEFAULT_LINGER_TIMEOUT_S = 10.0
DEFAULT_MAX_LINGER_BYTES = 64 << 20


@config_record
class HTTPLimits:
    """Bounds on how long and how many connections may hold the server before a request runs.

    Attributes:
        header_timeout_s: seconds a connection gets to send its request line and headers, from when
            it opens (or its next request's first byte); then it is closed, with a 408 if it sent any.
        max_header_connections: most connections sending their headers at once; past it a new one
            closes the one waiting longest (if it waited a second or more, ``MIN_EVICTABLE_S``).
        linger_timeout_s: after an answer sent before the body was read (413), the most seconds the
            rest of the body is read and discarded so the client can read the answer (0: close at
            once, as uvicorn does).
        max_linger_bytes: the most bytes of it read and discarded (0: close at once).
    """

    header_timeout_s: Annotated[PositiveFloat, Flag("--header-timeout", metavar="SECONDS")] = DEFAULT_HEADER_TIMEOUT_S
    max_header_connections: Annotated[PositiveInt, Flag(metavar="N")] = DEFAULT_MAX_HEADER_CONNECTIONS
    linger_timeout_s: Annotated[NonNegativeFloat, Flag("--linger-timeout", metavar="SECONDS")] = DEFAULT_LINGER_TIMEOUT_S
    max_linger_bytes: Annotated[NonNegativeInt, Flag(metavar="N")] = DEFAULT_MAX_LINGER_BYTES

    @property
    def lingers(self) -> bool:
        """Whether an unread body is drained at all."""
        return self.linger_timeout_s > 0 and self.max_linger_bytes > 0


class HeaderWaitList:
    """The connections of one server still sending their headers, oldest first."""

    def __init__(self, max_num_waiting: int) -> None:
        self.max_num_waiting = max_num_waiting
        # a dict as an ordered set: insertion order is the order they started waiting
        self.waiting: dict[GuardedH11Protocol, float] = {}

    def add(self, conn: GuardedH11Protocol, now: float) -> None:
        """``conn`` starts waiting for its headers; close the longest waiting one if full and it is old enough."""
        while len(self.waiting) >= self.max_num_waiting:
            oldest, since = next(iter(self.waiting.items()))
            if now - since < MIN_EVICTABLE_S:
                break
            oldest.close_slow_headers(  # removes it from the list
                f"the server has {len(self.waiting)} connections sending their headers "
                "(--max-header-connections); this one waited longest"
            )
        self.waiting[conn] = now

    def discard(self, conn: GuardedH11Protocol) -> None:
        """``conn`` has its headers, or closed."""
        self.waiting.pop(conn, None)


class _CloseHook:
    """The transport as the h11 protocol and its request cycles see it: ``close()`` asks the connection first.

    uvicorn closes the transport itself once an answer with ``Connection:
    close`` is sent; this is where a connection with an unread body turns that
    into a lingering close instead.
    """

    def __init__(self, transport: asyncio.Transport, on_close: Any) -> None:
        self._transport = transport
        self._on_close = on_close

    def close(self) -> None:
        self._on_close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _timeout_response(message: str) -> bytes:
    """A complete 408 with an OpenAI-style body (written raw: h11 cannot answer a request it never got)."""
    body = json.dumps(APIError(408, message, "invalid_request_error", "request_timeout").body()).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode("latin-1") + body


def _has_both_framings(request: h11.Request) -> bool:
    """Whether a request declares its body both chunked and by ``Content-Length`` (h11 lowercases names)."""
    names = {name for name, _ in request.headers}
    return b"transfer-encoding" in names and b"content-length" in names


class FramingCheckedConnection(h11.Connection):
    """h11's server connection that also refuses a request with both framing headers, and keeps the
    last error it raised (uvicorn's handler gets no exception to describe)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.last_error: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:
            self.last_error = e
            raise
        if isinstance(event, h11.Request) and _has_both_framings(event):
            # h11 is now reading the body as chunked; the answer closes the connection, so it never does
            self.last_error = h11.RemoteProtocolError(
                "the request has both Transfer-Encoding and Content-Length headers (RFC 9112 section 6.3: "
                "a request smuggling risk); send one of them", 400,
            )
            raise self.last_error
        return event


def _protocol_error_body(error: h11.RemoteProtocolError | None) -> tuple[int, bytes]:
    """The status and OpenAI-style body of the answer to a request h11 refused.

    Always a 4xx: h11 hints 501 for a transfer coding other than chunked, but
    that is the client's framing too, and every refusal of this server is a
    4xx (a 5xx reads as the server failing); the code tells the two apart.
    A 431 hint (headers past h11's buffer) is kept.
    """
    hint = error.error_status_hint if error is not None else 400
    status = hint if 400 <= hint < 500 else 400
    reason = str(error) if error is not None and str(error) else "unparsable request"
    code = "unsupported_transfer_encoding" if hint == 501 else "invalid_http_request"
    body = APIError(status, f"invalid HTTP/1.1 request: {reason}", "invalid_request_error", code).body()
    return status, json.dumps(body).encode()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 connection with a header deadline, a cap on connections sending headers, a
    lingering close, and framing errors answered in JSON (see the module's docstring). Made per
    server by ``make_protocol_class``."""

    limits: HTTPLimits
    header_waits: HeaderWaitList

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = FramingCheckedConnection(  # uvicorn's, with the framing check
            h11.SERVER, max_incomplete_event_size=self.config.h11_max_incomplete_event_size
            if self.config.h11_max_incomplete_event_size is not None else DEFAULT_MAX_INCOMPLETE_EVENT_SIZE,
        )
        self._raw: asyncio.Transport = None  # type: ignore[assignment]  # set in connection_made, like uvicorn's
        self._header_timer: asyncio.TimerHandle | None = None
        self._lingering = False
        self._linger_tick: asyncio.TimerHandle | None = None
        self._linger_deadline = 0.0
        self._num_linger_bytes = 0
        self._num_linger_bytes_at_tick = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._raw = transport
        # everything after this (request cycles included) closes through the hook; flow control keeps the raw one
        self.transport = _CloseHook(transport, self._close_requested)  # type: ignore[assignment]
        self._watch_headers(opened=True)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._discard(len(data))
            return
        super().data_received(data)
        self._watch_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._lingering:
            self._unset_keepalive_if_required()  # the linger has its own bounds
        self._watch_headers()  # a pipelined next request may be waiting, half sent

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        self._stop_lingering()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 refused, as an OpenAI JSON error (``_protocol_error_body``)."""
        status, body = _protocol_error_body(self.conn.last_error)
        logger.info("refusing a request from %s: %s", self.client, self.conn.last_error)
        self._stop_header_timer()
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            self.transport.close()  # an answer is under way: the connection can only end
            return
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        response = h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status])
        for event in (response, h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    # --- headers -------------------------------------------------------------------------

    def _waiting_for_headers(self, opened: bool) -> bool:
        if self._raw is None or self._raw.is_closing() or self._lingering:
            return False
        if self.conn.their_state is not h11.IDLE or self.conn.our_state is not h11.IDLE:
            return False
        # a kept-alive connection with nothing sent is idle (uvicorn's keep-alive timeout), not slow
        return opened or bool(self.conn.trailing_data[0])

    def _watch_headers(self, opened: bool = False) -> None:
        waiting = self._waiting_for_headers(opened)
        if waiting and self._header_timer is None:
            self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timed_out)
            self.header_waits.add(self, self.loop.time())
        elif not waiting:
            self._stop_header_timer()

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self.header_waits.discard(self)

    def _header_timed_out(self) -> None:
        self._header_timer = None
        self.close_slow_headers(
            f"the request line and headers did not arrive within {self.limits.header_timeout_s:g} s (--header-timeout)"
        )

    def close_slow_headers(self, message: str) -> None:
        """Close this connection, still sending its headers: a 408 saying ``message`` if it sent any bytes."""
        self._stop_header_timer()
        if self._raw is None or self._raw.is_closing():
            return
        num_sent = len(self.conn.trailing_data[0])
        logger.info("closing a connection from %s after %d bytes of headers: %s", self.client, num_sent, message)
        if num_sent:
            self._raw.write(_timeout_response(message))
        with contextlib.suppress(h11.LocalProtocolError):
            self.conn.send(h11.ConnectionClosed())
        self._raw.close()

    # --- lingering close -----------------------------------------------------------------

    def _close_requested(self) -> None:
        """uvicorn closes the connection: linger first when the client is still sending a body we did not read."""
        if self._lingering:
            self._stop_lingering()
            self._raw.close()
        elif self.limits.lingers and not self._raw.is_closing() and self.conn.their_state is h11.SEND_BODY:
            self._start_lingering()
        else:
            self._raw.close()

    def _start_lingering(self) -> None:
        self._lingering = True
        self._stop_header_timer()
        self._unset_keepalive_if_required()
        if self.cycle is not None:
            self.cycle.body = bytearray()  # what it buffered and nobody read
        if self._raw.can_write_eof():
            self._raw.write_eof()  # FIN once the answer is out: the client knows it is complete
        self.flow.resume_reading()  # the cycle paused reading when its buffer filled
        self._linger_deadline = self.loop.time() + self.limits.linger_timeout_s
        self._schedule_linger_tick()

    def _schedule_linger_tick(self) -> None:
        delay = min(LINGER_IDLE_S, max(0.0, self._linger_deadline - self.loop.time()))
        self._num_linger_bytes_at_tick = self._num_linger_bytes
        self._linger_tick = self.loop.call_later(delay, self._on_linger_tick)

    def _on_linger_tick(self) -> None:
        self._linger_tick = None
        if self.loop.time() >= self._linger_deadline:
            self._end_lingering(f"still sending after {self.limits.linger_timeout_s:g} s")
        elif self._num_linger_bytes == self._num_linger_bytes_at_tick:
            self._end_lingering(f"nothing sent for {LINGER_IDLE_S:g} s")
        else:
            self._schedule_linger_tick()

    def _discard(self, num_bytes: int) -> None:
        self._num_linger_bytes += num_bytes
        if self._num_linger_bytes > self.limits.max_linger_bytes:
            self._end_lingering(f"more than {self.limits.max_linger_bytes} bytes sent")

    def _end_lingering(self, why: str) -> None:
        logger.info("closing a connection from %s after discarding %d bytes of an unread body (%s)",
                    self.client, self._num_linger_bytes, why)
        self._stop_lingering()
        self._raw.close()

    def _stop_lingering(self) -> None:
        if self._linger_tick is not None:
            self._linger_tick.cancel()
            self._linger_tick = None


def make_protocol_class(limits: HTTPLimits) -> type[GuardedH11Protocol]:
    """A ``GuardedH11Protocol`` class for one server (``uvicorn.Config(http=...)``): its limits and
    the list of its connections waiting for headers live on the class, shared by its connections."""
    return type(
        "GuardedH11Protocol", (GuardedH11Protocol,),
        {"limits": limits, "header_waits": HeaderWaitList(limits.max_header_connections)},
    )
