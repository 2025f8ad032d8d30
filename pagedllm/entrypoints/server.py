"""``pagedllm serve``: an OpenAI-compatible HTTP server, as vLLM's.

Threads: uvicorn's event loop answers HTTP; one engine thread owns the
``LLMEngine`` (which is not thread-safe). Handlers never touch the engine:
they send commands (add tokenized requests, abort) to the engine thread,
which applies them between steps and steps while work exists. Outputs go
back to each request's ``asyncio.Queue`` through ``call_soon_threadsafe``.
torch releases the GIL in its kernels, so the loop stays responsive while
the engine computes. Prompts are tokenized before they reach the engine
thread, in a tokenizer process of the server's own (``tokenizer_worker.py``),
so no prompt's size delays another request's next token. Every request first
passes the guards of ``server_guards.py`` (Host, API key, body size, JSON).

A program that builds the app itself (``create_server_app``) starts the
tokenizer process with ``multiprocessing``'s spawn method, so its main
module needs the usual ``if __name__ == "__main__":`` guard.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
server-sent-event streaming), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus), ``POST /tokenize``, ``POST /detokenize``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import jinja2
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from pagedllm.engine.llm_engine import ContextLengthError, LLMEngine
from pagedllm.entrypoints.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
)
from pagedllm.entrypoints.server_guards import (
    DEFAULT_MAX_REQUEST_BYTES,
    APIKeyMiddleware,
    BodyLimitMiddleware,
    ClientGone,
    HostCheckMiddleware,
    client_gone_response,
    is_loopback,
    read_json,
)
from pagedllm.entrypoints.server_metrics import ServerMetrics
from pagedllm.entrypoints.tokenizer_worker import TokenizerWorker
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams, check_text

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A prompt as the engine queues it: (text or None, token ids).
Prompt = tuple[str | None, list[int]]
# seconds a client told 429 is asked to wait before it retries
RETRY_AFTER_S = 1


# --- errors ------------------------------------------------------------------------


class EngineStepError(RuntimeError):
    """The engine step that carried this request failed; the request is lost."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shutdown or a crash)."""


def _server_error(message: str) -> APIError:
    return APIError(500, message, "server_error", "internal_error")


def _engine_failure(e: EngineStepError | EngineDeadError) -> APIError:
    """500 for a failed step, 503 for a server that is stopping."""
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "server_error", "engine_unavailable")
    return _server_error(str(e))


# --- the engine thread ---------------------------------------------------------------


class _RequestStream:
    """One engine request's path from the engine thread to its HTTP handler.

    The timing fields are touched only by the engine thread, ``waiting`` only
    by the event loop.
    """

    def __init__(
        self, request_id: str, index: int, queue: asyncio.Queue, loop: asyncio.AbstractEventLoop,
        owner: AsyncEngine,
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.queue = queue
        self.loop = loop
        self.owner = owner
        self.arrival = time.monotonic()
        self.waiting = True  # counted in owner.num_waiting until its first output
        self.first_token_time: float | None = None
        self.last_token_time: dict[int, float] = {}
        self.num_tokens: dict[int, int] = {}

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
            n = len(c.token_ids)
            prev = self.num_tokens.get(c.index, 0)
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
            metrics.request_success(out.outputs[0].finish_reason or "abort")


# queued to a submission's reader once the submission is aborted
_ABORTED = object()


class Submission:
    """The engine requests of one API request (one per prompt) and their outputs."""

    def __init__(self, owner: AsyncEngine, streams: list[_RequestStream], queue: asyncio.Queue) -> None:
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


class AsyncEngine:
    """Runs an ``LLMEngine`` on its own thread, fed by commands from the event loop.

    Args:
        engine: the engine; no other thread may use it once ``start()`` ran.
        metrics: where to record statistics, or None.
        max_waiting: most accepted requests still waiting for their first
            token; past it ``add_requests`` raises a 429 APIError. None: no limit.
    """

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None, max_waiting: int | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.num_waiting = 0  # event-loop side only
        self._cv = threading.Condition()
        self._commands: deque[Callable[[], None]] = deque()
        self._stopping = False
        self._streams: dict[str, _RequestStream] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self.crash: BaseException | None = None
        self.draining = False  # shutting down: no new requests

    # --- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread."""
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

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps."""
        return await asyncio.wrap_future(self._submit(lambda: fn(self.engine)))

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

    async def add_requests(
        self, request_id: str, prompts: list[Prompt], params: SamplingParams, param: str = "prompt"
    ) -> Submission:
        """Queue one engine request per (text, token ids) prompt, all or none.

        The prompts arrive tokenized (off the engine thread); the engine thread
        only checks and queues them. Raises APIError: 400 for more prompts
        than ``max_waiting`` could ever admit, 429 (with ``Retry-After``) past
        ``max_waiting`` now, 400 for a prompt the engine rejects (too long for
        the context, token ids outside the vocabulary...); ``param`` names the
        request field that holds the prompt.
        """
        if self.draining or not self.is_alive:
            raise APIError(503, "the server is shutting down", "server_error", "engine_unavailable")
        if self.max_waiting is not None and len(prompts) > self.max_waiting:
            raise bad_request(
                f"the request has {len(prompts)} prompts, more than this server ever queues at once "
                f"(--max-waiting {self.max_waiting}); send them in smaller requests", param, "too_many_prompts",
            )
        if self.max_waiting is not None and self.num_waiting + len(prompts) > self.max_waiting:
            raise APIError(
                429,
                f"the server has {self.num_waiting} requests waiting (limit {self.max_waiting}); retry later",
                "rate_limit_error",
                "too_many_waiting_requests",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        streams = [_RequestStream(f"{request_id}-{i}", i, queue, loop, self) for i in range(len(prompts))]
        self.num_waiting += len(streams)
        sub = Submission(self, streams, queue)

        def add(engine: LLMEngine) -> list[int]:
            added: list[str] = []
            try:
                for stream, (text, ids) in zip(streams, prompts):
                    engine.add_request(stream.request_id, {"prompt": text, "prompt_token_ids": ids}, params)
                    added.append(stream.request_id)
                    self._streams[stream.request_id] = stream
            except BaseException:
                engine.abort_request(added)
                for rid in added:
                    self._streams.pop(rid, None)
                raise
            counts = [len(ids) for _, ids in prompts]
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(sum(counts))
            return counts

        try:
            sub.prompt_token_counts = await self.call(add)
        except BaseException as e:
            for s in streams:
                self.release_waiting(s)
            if isinstance(e, asyncio.CancelledError):
                # the add may have run already: take the requests back out
                self.abort([s.request_id for s in streams])
                raise
            raise _to_api_error(e, param) from e
        return sub

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


# sampling fields checked against the vocabulary and tokenizer when the engine adds the request;
# their errors start with the field's name
_ENGINE_CHECKED_FIELDS = ("logit_bias", "allowed_token_ids", "bad_words", "min_tokens")


def _to_api_error(e: BaseException, param: str | None = None) -> APIError:
    """Map what adding a request (or tokenizing) can raise to the client's error."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ContextLengthError):
        return bad_request(str(e), param, "context_length_exceeded")
    if isinstance(e, ValueError) and str(e).split(" ", 1)[0] in _ENGINE_CHECKED_FIELDS:
        return bad_request(str(e), str(e).split(" ", 1)[0])
    if isinstance(e, (ValueError, jinja2.TemplateError)):
        return bad_request(str(e), param)
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "server_error", "engine_unavailable")
    logger.error("request failed: %r", e)
    return _server_error(f"the request failed: {type(e).__name__}: {e}")


class PromptEncoder:
    """Turns request prompts into (text, token ids) off the engine thread.

    Text goes to the tokenizer process (``tokenizer_worker.py``); a prompt
    that cannot fit in the context is refused from its token count. Chat
    templates render on a worker thread of this process.
    """

    def __init__(self, engine: LLMEngine, worker: TokenizerWorker) -> None:
        self.engine = engine  # only its configuration and chat template are read here
        self.worker = worker

    async def text(self, text: str, params: SamplingParams | None, add_special_tokens: bool = True) -> Prompt:
        """A text prompt, tokenized; ValueError (ContextLengthError) when it is empty or too long.

        With ``truncate_prompt_tokens`` the whole text is tokenized and its
        last k tokens kept, so a longer text may still fit.
        """
        if not text:
            raise ValueError("the prompt is empty")
        check_text("the prompt", text)
        keep = params.truncate_prompt_tokens if params is not None else None
        limit = self.engine.config.max_model_len if keep is None else None
        count, ids = await self.worker.encode(text, add_special_tokens, limit=limit)
        if keep is not None and ids is not None:
            ids = ids[-keep:]
            count = len(ids)
        self.engine.check_prompt_len(count, params)
        if not ids:
            raise ValueError("the prompt is empty")
        return text, ids

    async def token_ids(self, ids: list[int], params: SamplingParams) -> Prompt:
        """A prompt given as token ids (checked against the vocabulary on the engine thread)."""
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens :]
        self.engine.check_prompt_len(len(ids), params)
        return None, list(ids)

    async def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """The conversation through the model's chat template."""
        render = self.engine.tokenizer.apply_chat_template
        return await asyncio.to_thread(render, messages, add_generation_prompt)

    async def chat(self, messages: list[dict[str, str]], add_generation_prompt: bool, params: SamplingParams) -> Prompt:
        """A conversation, rendered and tokenized (the template holds its own special tokens)."""
        text = await self.render_chat(messages, add_generation_prompt)
        return await self.text(text, params, add_special_tokens=False)


# --- responses -----------------------------------------------------------------------


class _SSEResponse(StreamingResponse):
    """Server-sent events that abort the request when the client goes away.

    Whatever the ASGI version, a task listens for ``http.disconnect`` beside
    the stream, so a client that leaves while its request waits (no bytes to
    send) is noticed at once; ``on_close`` runs however the response ends.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client is gone
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self._on_close()
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> None:
    """Call ``on_disconnect`` if the client leaves before its (non-streamed) answer."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return



async def _sse_stream(
    header: dict[str, Any],
    include_usage: bool,
    choices: AsyncIterator[list[dict[str, Any]]],
    usage: Callable[[], dict[str, Any]],
) -> AsyncIterator[str]:
    """One streamed response as server-sent events: a chunk per batch of
    choices, then (if asked) a usage chunk, then ``[DONE]``. A failure ends
    this stream only, with an error event."""
    try:
        async for batch in choices:
            body: dict[str, Any] = {**header, "choices": batch}
            if include_usage:
                body["usage"] = None  # OpenAI: null on every chunk but the last
            yield _sse(body)
        if include_usage:
            yield _sse({**header, "choices": [], "usage": usage()})
    except (EngineStepError, EngineDeadError) as e:
        yield _sse(_engine_failure(e).body())
    except Exception as e:  # a bug here fails this stream only, with a message
        logger.exception("streaming failed")
        yield _sse(_server_error(f"internal error: {type(e).__name__}").body())
    yield _sse("[DONE]")

def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class _DeltaTracker:
    """Text and tokens already streamed per choice.

    With stop strings the engine may cut text it has already produced (a stop
    string that spans tokens is found only when complete), so the last
    ``longest stop - 1`` characters are held back until the choice finishes,
    as vLLM does. Tokens (for logprobs) go out with the next chunk that has
    text, or with the last one.
    """

    def __init__(self, params: SamplingParams) -> None:
        stops = params.stop_strings
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent: dict[int, int] = {}
        self.tokens_sent: dict[int, int] = {}
        self.text_offset: dict[int, int] = {}
        self.done: set[int] = set()

    def delta(self, choice: int, c: CompletionOutput) -> tuple[str, bool, int, int] | None:
        """(new text, finished, first new token, end of new tokens) for a choice, or None."""
        if choice in self.done:
            return None
        finished = c.finish_reason is not None
        sent = self.sent.get(choice, 0)
        end = len(c.text) if finished else max(sent, len(c.text) - self.hold)
        text = c.text[sent:end]
        if not text and not finished:
            return None
        self.sent[choice] = end
        first_token = self.tokens_sent.get(choice, 0)
        self.tokens_sent[choice] = len(c.token_ids)
        if finished:
            self.done.add(choice)
        return text, finished, first_token, len(c.token_ids)


# JSON has no -inf; vLLM reports impossible tokens at this logprob instead
_MIN_LOGPROB = -9999.0


def _lp(value: float) -> float:
    return max(value, _MIN_LOGPROB) if value == value else _MIN_LOGPROB  # NaN too


def _completion_logprobs(
    c: CompletionOutput, start: int, end: int, offset: int
) -> tuple[dict[str, Any] | None, int]:
    """OpenAI's completions ``logprobs`` for tokens ``start:end``, and the next text offset.

    ``top_logprobs`` maps each alternative's text to its logprob and, as in
    vLLM, always holds the chosen token.
    """
    if c.logprobs is None:
        return None, offset
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top: list[dict[str, float]] = []
    offsets: list[int] = []
    for token_id, position in zip(c.token_ids[start:end], c.logprobs[start:end]):
        chosen = position[token_id]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(_lp(chosen.logprob))
        ranked = sorted(position.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)
        top.append({(lp.decoded_token or ""): _lp(lp.logprob) for lp in ranked})
        offsets.append(offset)
        offset += len(text)
    body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
    return body, offset


def _chat_logprobs(c: CompletionOutput, start: int, end: int, top_n: int) -> dict[str, Any] | None:
    """OpenAI's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    if c.logprobs is None:
        return None

    def entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, position in zip(c.token_ids[start:end], c.logprobs[start:end]):
        chosen = position[token_id]
        ranked = sorted(
            (lp for lp in position.values() if lp.rank is not None and lp.rank <= top_n), key=lambda lp: lp.rank
        )
        item = entry(chosen.decoded_token or "", chosen.logprob)
        item["top_logprobs"] = [entry(lp.decoded_token or "", lp.logprob) for lp in ranked]
        content.append(item)
    return {"content": content}


@dataclass
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
    """

    model_name: str
    model_path: str = ""
    api_key: str | None = None
    max_waiting: int | None = 1024
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    allowed_hosts: list[str] | None = None
    allowed_origins: list[str] | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if self.max_waiting is not None and (not isinstance(self.max_waiting, int) or self.max_waiting < 1):
            raise ValueError(f"max_waiting must be an integer >= 1 or None, got {self.max_waiting!r}")
        if not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be a positive integer, got {self.max_request_bytes!r}")
        for name in ("allowed_hosts", "allowed_origins"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) and v for v in value)):
                raise ValueError(f"{name} must be a list of non-empty strings or None, got {value!r}")

    @property
    def host_check(self) -> list[str] | None:
        """The extra Host names to allow, or None when no Host check applies."""
        if self.allowed_hosts is not None:
            return self.allowed_hosts
        return [] if is_loopback(self.host) else None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _add_guards(app: FastAPI, settings: ServerSettings) -> None:
    """The middleware every request passes (``server_guards.py``), outermost first:
    Host check, CORS, API key, body size."""
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    if settings.allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    if settings.host_check is not None:
        app.add_middleware(HostCheckMiddleware, allowed_hosts=settings.host_check)


def build_app(async_engine: AsyncEngine, settings: ServerSettings, tokenizer: TokenizerWorker) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the engine thread and the tokenizer process.

    Args:
        async_engine: the engine wrapper (not started yet).
        settings: names, key and limits.
        tokenizer: the tokenizer process; the app closes it when it stops.
    """
    engine = async_engine.engine
    metrics = async_engine.metrics
    max_model_len = engine.config.max_model_len
    prompts = PromptEncoder(engine, tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not async_engine.is_alive:
            async_engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.stop)
            await asyncio.to_thread(tokenizer.close)

    app = FastAPI(title="pagedllm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    _add_guards(app, settings)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return client_gone_response()  # nobody reads it; no traceback either

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = APIError(exc.status_code, str(exc.detail), kind, None)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error in %s", request.url.path)
        err = _server_error(f"internal error: {type(exc).__name__}")
        return JSONResponse(err.body(), status_code=500)

    def check_model(name: str | None) -> None:
        # vLLM's leniency: no model means the served one
        if name is not None and name != settings.model_name:
            raise APIError(
                404, f"The model `{name}` does not exist.", "invalid_request_error", "model_not_found", "model"
            )

    async def run(
        request: Request, sub: Submission, make_response: Callable[[list[RequestOutput]], dict[str, Any]]
    ) -> JSONResponse:
        """Wait for every prompt of a non-streamed request; abort if the client leaves."""
        watcher = asyncio.create_task(_watch_disconnect(request, sub.abort))
        final: dict[int, RequestOutput] = {}
        try:
            async for index, out in sub.outputs():
                if out.finished:
                    final[index] = out
        except (EngineStepError, EngineDeadError) as e:
            raise _engine_failure(e) from e
        finally:
            watcher.cancel()
            sub.abort()  # no-op unless something above failed
        if len(final) < len(sub.streams):  # the client left; nobody reads this
            raise APIError(499, "the client closed the request", "invalid_request_error", "client_closed")
        return JSONResponse(make_response([final[i] for i in range(len(sub.streams))]))

    async def compile_constraint(req: CompletionRequest | ChatCompletionRequest, params: SamplingParams) -> None:
        """Compile the request's structured-output constraint on a worker thread: a bad one is a 400 here.

        The engine thread then finds it in the engine's grammar cache, so a
        long compile never stalls other requests' steps.
        """
        if params.structured_outputs is None:
            return
        try:
            await asyncio.to_thread(async_engine.engine.compile_grammar, params)
        except ValueError as e:
            raise bad_request(str(e), req.constraint_param) from e

    # --- completions -----------------------------------------------------------------
    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        req: CompletionRequest = await read_json(request, CompletionRequest)
        check_model(req.model)
        params = req.to_sampling_params()
        await compile_constraint(req, params)
        try:
            encoded = [
                await (prompts.text(p, params) if isinstance(p, str) else prompts.token_ids(p, params))
                for p in req.prompts()
            ]
        except Exception as e:
            raise _to_api_error(e, "prompt") from e
        rid = f"cmpl-{uuid.uuid4().hex}"
        sub = await async_engine.add_requests(rid, encoded, params)
        created = int(time.time())
        n = params.n

        def choice_finish(c: CompletionOutput) -> dict[str, Any]:
            return {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

        if not req.stream:
            def response(outs: list[RequestOutput]) -> dict[str, Any]:
                choices = [
                    {
                        "index": i * n + c.index, "text": c.text,
                        "logprobs": _completion_logprobs(c, 0, len(c.token_ids), 0)[0], **choice_finish(c),
                    }
                    for i, out in enumerate(outs)
                    for c in out.outputs
                ]
                completion = sum(len(c.token_ids) for out in outs for c in out.outputs)
                return {
                    "id": rid, "object": "text_completion", "created": created, "model": settings.model_name,
                    "choices": choices, "usage": _usage(sum(sub.prompt_token_counts), completion),
                }

            return await run(request, sub, response)

        tokens: dict[int, int] = {}

        async def choices() -> AsyncIterator[list[dict[str, Any]]]:
            tracker = _DeltaTracker(params)
            async for index, out in sub.outputs():
                for c in out.outputs:
                    choice = index * n + c.index
                    tokens[choice] = len(c.token_ids)
                    d = tracker.delta(choice, c)
                    if d is None:
                        continue
                    text, finished, first_token, end = d
                    fin = choice_finish(c) if finished else {"finish_reason": None, "stop_reason": None}
                    logprobs, tracker.text_offset[choice] = _completion_logprobs(
                        c, first_token, end, tracker.text_offset.get(choice, 0)
                    )
                    yield [{"index": choice, "text": text, "logprobs": logprobs, **fin}]

        header = {"id": rid, "object": "text_completion", "created": created, "model": settings.model_name}
        events = _sse_stream(
            header, req.include_usage, choices(),
            lambda: _usage(sum(sub.prompt_token_counts), sum(tokens.values())),
        )
        return _SSEResponse(events, on_close=sub.abort)

    # --- chat completions --------------------------------------------------------------
    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = await read_json(request, ChatCompletionRequest)
        check_model(req.model)
        params = req.to_sampling_params()
        await compile_constraint(req, params)
        try:
            encoded = await prompts.chat(req.template_messages(), req.add_generation_prompt, params)
        except Exception as e:
            raise _to_api_error(e, "messages") from e
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        sub = await async_engine.add_requests(rid, [encoded], params, "messages")
        created = int(time.time())
        top_n = req.top_logprobs or 0

        if not req.stream:
            def response(outs: list[RequestOutput]) -> dict[str, Any]:
                out = outs[0]
                choices = [
                    {
                        "index": c.index,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": _chat_logprobs(c, 0, len(c.token_ids), top_n),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                    for c in out.outputs
                ]
                completion = sum(len(c.token_ids) for c in out.outputs)
                return {
                    "id": rid, "object": "chat.completion", "created": created, "model": settings.model_name,
                    "choices": choices, "usage": _usage(sub.prompt_token_counts[0], completion),
                }

            return await run(request, sub, response)

        tokens: dict[int, int] = {}

        async def choices() -> AsyncIterator[list[dict[str, Any]]]:
            tracker = _DeltaTracker(params)
            first = True
            async for _, out in sub.outputs():
                if first:
                    # as OpenAI: each choice opens with the role, once
                    first = False
                    for c in out.outputs:
                        yield [{
                            "index": c.index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None,
                        }]
                for c in out.outputs:
                    tokens[c.index] = len(c.token_ids)
                    d = tracker.delta(c.index, c)
                    if d is None:
                        continue
                    text, finished, first_token, end = d
                    delta = {"content": text} if text else {}
                    fin = (
                        {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                        if finished else {"finish_reason": None}
                    )
                    logprobs = _chat_logprobs(c, first_token, end, top_n)
                    yield [{"index": c.index, "delta": delta, "logprobs": logprobs, **fin}]

        header = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": settings.model_name}
        events = _sse_stream(
            header, req.include_usage, choices(),
            lambda: _usage(sub.prompt_token_counts[0], sum(tokens.values())),
        )
        return _SSEResponse(events, on_close=sub.abort)

    # --- models, health, metrics ---------------------------------------------------------
    def model_card() -> dict[str, Any]:
        return {
            "id": settings.model_name, "object": "model", "created": settings.created, "owned_by": "pagedllm",
            "root": settings.model_path or settings.model_name, "parent": None, "max_model_len": max_model_len,
        }

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        check_model(model)
        return model_card()

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_alive or async_engine.draining:
            err = APIError(503, "the engine is not running", "server_error", "engine_unavailable")
            return JSONResponse(err.body(), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if metrics is None:
            raise APIError(404, "metrics are disabled", "not_found_error", None)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # --- tokenizer ---------------------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req: TokenizeRequest = await read_json(request, TokenizeRequest)
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
        try:
            if req.messages is not None:
                if not req.messages:
                    raise ValueError("messages must not be empty")
                text = await prompts.render_chat([m.to_template_dict() for m in req.messages], req.add_generation_prompt)
                add_special = bool(req.add_special_tokens)  # the template holds its own
            else:
                text = req.prompt or ""
                add_special = req.add_special_tokens is not False
            check_text("the prompt", text)
            count, ids_json, strs_json = await tokenizer.tokenize_json(text, add_special, req.return_token_strs)
        except Exception as e:
            raise _to_api_error(e, "messages" if req.messages is not None else "prompt") from e
        # the id list is serialised in the tokenizer process: no long JSON encode here
        body = b'{"count": %d, "max_model_len": %d, "tokens": %s, "token_strs": %s}' % (
            count, max_model_len, ids_json, strs_json
        )
        return Response(body, media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req: DetokenizeRequest = await read_json(request, DetokenizeRequest)
        check_model(req.model)
        vocab = engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
        try:
            text = await tokenizer.decode(req.tokens)
        except Exception as e:
            raise _to_api_error(e, "tokens") from e
        return {"prompt": text}

    return app


def default_model_name(model_path: str) -> str:
    """The name a model is served under: its file or folder name."""
    return os.path.basename(os.path.normpath(model_path))


def create_server_app(engine: LLMEngine, settings: ServerSettings, enable_metrics: bool = True) -> FastAPI:
    """An app around ``engine``, with its own metrics registry and engine thread.

    ``app.state.async_engine`` is the engine wrapper (for ``make_uvicorn_server``).
    """
    metrics = ServerMetrics(settings.model_name) if enable_metrics else None
    if metrics is not None:
        metrics.update_from_engine(engine)
    async_engine = AsyncEngine(engine, metrics, settings.max_waiting)
    app = build_app(async_engine, settings, TokenizerWorker(engine.tokenizer.hf))
    app.state.async_engine = async_engine
    return app


# seconds requests in flight get to finish when the server is asked to stop
SHUTDOWN_GRACE_S = 5.0


def make_uvicorn_server(app: FastAPI, settings: ServerSettings) -> Any:
    """A uvicorn server that drains the engine before closing connections.

    uvicorn alone would wait for open streams and then cancel them mid-flight;
    here requests in flight get ``SHUTDOWN_GRACE_S`` to finish, then end with
    an error event (streams) or a 503, and connections close cleanly.
    """
    import uvicorn

    async_engine: AsyncEngine = app.state.async_engine

    class _DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets: list | None = None) -> None:
            await async_engine.drain(SHUTDOWN_GRACE_S)
            await super().shutdown(sockets)

    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level,
        timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S),
    )
    return _DrainingServer(config)


def run_server(engine: LLMEngine, settings: ServerSettings) -> None:
    """Serve until interrupted (SIGINT/SIGTERM)."""
    app = create_server_app(engine, settings)
    logger.info("serving %s on http://%s:%d", settings.model_name, settings.host, settings.port)
    make_uvicorn_server(app, settings).run()
