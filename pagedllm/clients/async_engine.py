"""The in-process engine client: one thread that owns the ``LLMEngine``, fed by the event loop.

``AsyncEngine`` implements ``engine/protocol.py``'s ``EngineClient``.

Threads: uvicorn's event loop answers HTTP; one engine thread owns the
``LLMEngine`` (which is not thread-safe). Handlers never touch the engine:
they send commands (add tokenized requests, abort) to the engine thread,
which applies them between steps and steps while work exists. Outputs go
back to each request's ``asyncio.Queue`` through ``call_soon_threadsafe``.
torch releases the GIL in its kernels, so the loop stays responsive while
the engine computes.

::

    handler --add_requests()--> command deque --> engine thread: add, step, step...
       ^                                               |
       +---- asyncio.Queue <-- call_soon_threadsafe ---+  (one queue per API request)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, TypeVar

from pagedllm.clients.metrics import ServerMetrics
from pagedllm.distributed.group import DistributedError
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.protocol import (
    EngineDeadError,
    EngineOverloadedError,
    EngineStepError,
    Prompt,
    TooManyPromptsError,
)
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# seconds a client told 429 is asked to wait before it retries
RETRY_AFTER_S = 1


class StreamSink(Protocol):
    """Where the engine thread hands one engine request's outputs (``_RequestStream``, or a replica's pipe)."""

    request_id: str

    def put(self, item: RequestOutput | BaseException) -> None: ...

    def observe(self, out: RequestOutput, now: float, metrics: ServerMetrics | None) -> None: ...


class SubmissionOwner(Protocol):
    """What a submission and its streams call back: ``AsyncEngine`` or ``DataParallelEngine``."""

    def abort(self, request_ids: list[str]) -> None: ...

    def release_waiting(self, stream: _RequestStream) -> None: ...


class _Admitting(Protocol):
    draining: bool
    max_waiting: int | None
    num_waiting: int

    @property
    def is_alive(self) -> bool: ...


def check_admission(client: _Admitting, num_prompts: int) -> None:
    """Refuse a request of ``num_prompts`` prompts now, or let it in (the engine clients share this).

    Raises EngineDeadError while stopping, TooManyPromptsError for more
    prompts than ``max_waiting`` could ever admit, EngineOverloadedError
    (retry after ``RETRY_AFTER_S``) past ``max_waiting`` now; the server maps
    them to 503, 400 and 429.
    """
    if client.draining or not client.is_alive:
        raise EngineDeadError("the server is shutting down")
    limit = client.max_waiting
    if limit is not None and num_prompts > limit:
        raise TooManyPromptsError(
            f"the request has {num_prompts} prompts, more than this server ever queues at once "
            f"(--max-waiting {limit}); send them in smaller requests"
        )
    if limit is not None and client.num_waiting + num_prompts > limit:
        raise EngineOverloadedError(
            f"the server has {client.num_waiting} requests waiting (limit {limit}); retry later", RETRY_AFTER_S
        )


# --- the engine thread ---------------------------------------------------------------


class _RequestStream:
    """One engine request's path from the engine thread to its HTTP handler.

    The timing fields are touched only by the engine thread, ``waiting`` only
    by the event loop.
    """

    def __init__(
        self, request_id: str, index: int, queue: asyncio.Queue, loop: asyncio.AbstractEventLoop,
        owner: SubmissionOwner, delta: bool = False,
    ) -> None:
        self.request_id = request_id
        self.delta = delta  # outputs carry only what is new (RequestOutputKind.DELTA): token counts add up
        self.index = index
        self.queue = queue
        self.loop = loop
        self.owner = owner
        self.arrival = time.monotonic()
        self.waiting = True  # counted in owner.num_waiting until its first output
        self.first_token_time: float | None = None
        self.last_token_time: dict[int, float] = {}
        self.num_tokens: dict[int, int] = {}
        self.finish_reasons: dict[int, str] = {}  # choice index -> why it ended, as seen

    def put(self, item: RequestOutput | BaseException) -> None:
        """Hand an output or an error to the handler (from the engine thread)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self.loop.call_soon_threadsafe(self._deliver, item)

    def _deliver(self, item: RequestOutput | BaseException) -> None:
        self.owner.release_waiting(self)
        self.queue.put_nowait((self.index, item))

    def observe(self, out: RequestOutput, now: float, metrics: ServerMetrics | None) -> None:
        """Time to first token, inter-token latencies and end-to-end latency (engine thread)."""
        if metrics is None:
            return
        for c in out.outputs:
            if c.finish_reason is not None:
                # with deltas a choice that finished early is absent from later outputs
                self.finish_reasons.setdefault(c.index, c.finish_reason)
            prev = self.num_tokens.get(c.index, 0)
            n = prev + len(c.token_ids) if self.delta else len(c.token_ids)
            if n <= prev:
                continue
            if self.first_token_time is None:
                self.first_token_time = now
                metrics.time_to_first_token.observe(now - self.arrival)
            last = self.last_token_time.get(c.index)
            if last is not None:
                # one step makes one token per sequence; more would share the gap
                for _ in range(n - prev):
                    metrics.inter_token_latency.observe((now - last) / (n - prev))
            self.num_tokens[c.index] = n
            self.last_token_time[c.index] = now
        if out.finished:
            metrics.e2e_request_latency.observe(now - self.arrival)
            first = min(self.finish_reasons, default=None)
            metrics.request_success(self.finish_reasons[first] if first is not None else "abort")


# queued to a submission's reader once the submission is aborted
_ABORTED = object()


class Submission:
    """The engine requests of one API request (one per prompt) and their outputs."""

    def __init__(self, owner: SubmissionOwner, streams: list[_RequestStream], queue: asyncio.Queue) -> None:
        self.owner = owner
        self.streams = streams
        self.queue = queue
        self.prompt_token_counts: list[int] = []
        self.finished: set[int] = set()

    @property
    def done(self) -> bool:
        """Every prompt has finished (or the submission was aborted)."""
        return len(self.finished) == len(self.streams)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative output) as the engine makes them; raises on failure.

        Ends early, without error, once ``abort()`` ran.
        """
        while not self.done:
            index, item = await self.queue.get()
            if item is _ABORTED or self.done:
                return
            if isinstance(item, BaseException):
                self.abort()  # the other prompts of a failed request are not worth finishing
                raise item
            if item.finished:
                self.finished.add(index)
            yield index, item

    def abort(self) -> None:
        """Abort every unfinished engine request of this submission; their blocks are freed at once."""
        ids = [s.request_id for s in self.streams if s.index not in self.finished]
        self.finished.update(range(len(self.streams)))
        if ids:
            self.owner.abort(ids)
            for s in self.streams:
                self.owner.release_waiting(s)
            self.queue.put_nowait((-1, _ABORTED))  # wakes a reader blocked on the queue



class _Client(SubmissionOwner, _Admitting, Protocol):
    """An engine client as a submission sees it: it admits, counts waiting streams, aborts."""


def open_submission(owner: _Client, request_id: str, num_prompts: int, params: SamplingParams) -> Submission:
    """Admit one API request's ``num_prompts`` prompts (``check_admission``: 400 / 429 / 503) and open their
    streams, counted in ``owner.num_waiting`` until each one's first output; ``params`` says whether the
    outputs will be deltas."""
    check_admission(owner, num_prompts)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    delta = params.output_kind is RequestOutputKind.DELTA
    streams = [_RequestStream(f"{request_id}-{i}", i, queue, loop, owner, delta) for i in range(num_prompts)]
    owner.num_waiting += len(streams)
    return Submission(owner, streams, queue)

class AsyncEngine:
    """Runs an ``LLMEngine`` on its own thread, fed by commands from the event loop.

    Args:
        engine: the engine; no other thread may use it once ``start()`` ran.
        metrics: where to record statistics, or None.
        max_waiting: most accepted requests still waiting for their first
            token; past it ``add_requests`` raises EngineOverloadedError (a 429). None: no limit.
    """

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None, max_waiting: int | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.num_waiting = 0  # event-loop side only
        self._cv = threading.Condition()
        self._commands: deque[Callable[[], None]] = deque()
        self._stopping = False
        self._streams: dict[str, StreamSink] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self.crash: BaseException | None = None
        self.draining = False  # shutting down: no new requests
        # called with the engine on its thread after each pass of the loop, with the
        # metrics (the /kv page's snapshot publisher); set before start()
        self.between_steps: list[Callable[[LLMEngine], object]] = []

    # --- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        """Capture the decode step (so no first request waits seconds for it), then start the engine thread."""
        self.engine.model_runner.warm_up()
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests in flight get an EngineDeadError."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        """The engine thread runs and is not stopping."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def has_work(self) -> bool:
        """Requests in flight or commands queued (read from the event loop; a snapshot)."""
        return bool(self._streams) or bool(self._commands)

    def health_report(self) -> dict[str, Any] | None:
        """None: one engine thread has no more to say than ``/health``'s status."""
        return None

    async def drain(self, timeout: float) -> None:
        """Refuse new requests, give those in flight ``timeout`` seconds, then stop.

        Requests still running then end with an error (an error event for a
        stream), so no connection is left to be cut mid-response.
        """
        self.draining = True
        if self.has_work:
            logger.info("shutting down: requests in flight get %.0fs to finish", timeout)
        deadline = time.monotonic() + timeout
        while self.has_work and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self.stop)

    # --- commands (from the event loop) ---------------------------------------------
    def _submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller, who decides
                fut.set_exception(e)

        with self._cv:
            if not self.is_alive:
                raise EngineDeadError("the engine is not running")
            self._commands.append(run)
            self._cv.notify()
        return fut

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (fire and forget); their blocks are freed before the next step."""
        def run() -> None:
            self.engine.abort_request(request_ids)
            for rid in request_ids:
                self._streams.pop(rid, None)

        with contextlib.suppress(EngineDeadError):
            self._submit(run)

    def release_waiting(self, stream: _RequestStream) -> None:
        """The request has left the waiting count (first output, error or abort)."""
        if stream.waiting:
            stream.waiting = False
            self.num_waiting -= 1

    async def add_requests(self, request_id: str, prompts: list[Prompt], params: SamplingParams) -> Submission:
        """Queue one engine request per (text, token ids) prompt, all or none.

        The prompts arrive tokenized (off the engine thread); the engine thread
        only checks and queues them. Raises what ``check_admission`` raises
        (past ``max_waiting``, or stopping), and what the engine raises for a
        prompt it rejects (``ContextLengthError``, a ValueError for token ids
        outside the vocabulary...); the server maps them to its answers
        (``entrypoints/openai/engine_errors.py``).
        """
        sub = open_submission(self, request_id, len(prompts), params)
        streams = sub.streams

        try:
            counts = await asyncio.wrap_future(self.submit_add(streams, prompts, params))
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(sum(counts))
            sub.prompt_token_counts = counts
        except BaseException as e:
            for s in streams:
                self.release_waiting(s)
            if isinstance(e, asyncio.CancelledError):
                # the add may have run already: take the requests back out
                self.abort([s.request_id for s in streams])
            raise
        return sub

    def submit_add(
        self, streams: list[StreamSink], prompts: list[Prompt], params: SamplingParams
    ) -> concurrent.futures.Future[list[int]]:
        """Queue ``add_requests``' work for the engine thread: one engine request per stream, all or none.

        Each stream receives its request's outputs (``put``) from then on. The
        future gives the prompts' token counts, or the error adding raised.
        A data-parallel replica process feeds its engine through this too.
        """
        def add() -> list[int]:
            added: list[str] = []
            try:
                for stream, (text, ids) in zip(streams, prompts):
                    self.engine.add_request(stream.request_id, {"prompt": text, "prompt_token_ids": ids}, params)
                    added.append(stream.request_id)
                    self._streams[stream.request_id] = stream
            except BaseException:
                self.engine.abort_request(added)
                for rid in added:
                    self._streams.pop(rid, None)
                raise
            return [len(ids) for _, ids in prompts]

        return self._submit(add)

    # --- the loop (engine thread) -----------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cv:
                    while not self._commands and not self._stopping and not engine.has_unfinished_requests():
                        self._cv.wait()
                    if self._stopping:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                for command in commands:
                    command()
                if engine.has_unfinished_requests() and not self._step():
                    # nothing could be scheduled: wait for a command rather than spin
                    with self._cv:
                        if not self._commands and not self._stopping:
                            self._cv.wait(0.01)
                if self.metrics is not None:
                    self.metrics.update_from_engine(engine)
                for hook in self.between_steps:
                    hook(engine)
        except BaseException as e:  # a bug in the loop itself: say so, fail everyone
            logger.exception("the engine thread crashed")
            self.crash = e
        finally:
            with self._cv:
                self._stopping = True
                pending = list(self._commands)
                self._commands.clear()
            for command in pending:
                command()  # answered, so no caller waits forever
            for stream in self._streams.values():
                stream.put(EngineDeadError("the server is shutting down; the request was not finished"))
            self._streams.clear()

    def _step(self) -> bool:
        """One engine step; its outputs go to their handlers. False if nothing ran."""
        engine = self.engine
        try:
            outputs = engine.step()
        except DistributedError:
            # a tensor-parallel rank failed: the engine cannot step again. The loop ends, every
            # request gets an error and /health reports the server unhealthy
            raise
        except Exception as e:
            # the engine has aborted the requests of the failed step; fail those
            # (and only those) and keep serving the rest
            logger.exception("an engine step failed")
            lost = [rid for rid in self._streams if rid not in engine.requests]
            if not lost and engine.requests:
                # the failure took no request with it (e.g. a scheduler that cannot
                # progress): stepping again would fail again. End the newest
                # request, the likeliest culprit, as the engine does with stalled
                # beams; if that was not it, the next step takes the next one.
                victim = next(reversed(engine.requests))
                engine.abort_request(victim)
                lost = [victim] if victim in self._streams else []
            for rid in lost:
                self._streams.pop(rid).put(EngineStepError(f"the engine failed on this request: {e}"))
            return True
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted while the step ran
            if out.error is not None:
                # this request failed alone; the step's others carry on
                del self._streams[out.request_id]
                stream.put(EngineStepError(f"the engine failed on this request: {out.error}"))
                continue
            stream.observe(out, now, self.metrics)
            if out.finished:
                del self._streams[out.request_id]
            stream.put(out)
        return bool(outputs) or engine.last_step_scheduled
