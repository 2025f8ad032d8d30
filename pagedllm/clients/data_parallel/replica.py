"""One data-parallel replica: an ``LLMEngine`` in a process of its own, fed over a pipe.

The API server starts each replica with ``torch.multiprocessing`` (spawn) and
talks to it through one duplex ``Pipe`` (``replica_client.py`` is the server's
end). Inside, the replica runs the server's own engine thread
(``AsyncEngine``) around its engine; this process's main thread only moves
messages between the pipe and that thread, so a replica steps, fails a bad
request alone and recovers from a failed step exactly as the one-engine
server does. Messages are plain picklable tuples::

    server -> replica
      ("add", call_id, [(request_id, text | None, token_ids), ...], SamplingParams)
      ("abort", [request_id, ...])
      ("stop",)
    replica -> server
      ("heartbeat",)                                 every ``heartbeat_interval`` s, from a thread of its own
      ("ready", pid, PublishedSnapshot | None)       once, when the engine is built
      ("failed_to_start", message)                   instead of ready; the process exits
      ("added", call_id, token_counts | None, exception | None)
      ("outputs", [RequestOutput, ...], [(request_id, error message), ...])   one per engine pass
      ("stats", EngineStats, cached block hashes (array "Q" bytes), PublishedSnapshot | None)

Outputs are batched per engine pass (one message for the whole step). Stats go
at most every ``STATS_INTERVAL_S`` while the engine works and once when it goes
idle; they carry every block hash in the replica's prefix cache, which the
router uses to send a prompt where its prefix is cached. Heartbeats come from
a thread that does nothing else: torch releases the GIL in its kernels, so it
keeps beating while the engine thread is in a step of any length, and stops
only when the whole process does (SIGSTOP, a machine thrashing). The server
kills a replica whose messages stop for its heartbeat timeout
(``replica_client.py``). The replica ignores
SIGINT (a terminal's Ctrl-C reaches the whole process group; the server
decides when replicas stop) and exits when the server's end of the pipe closes,
so a server killed outright leaves no replica behind.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
from array import array
from multiprocessing.connection import Connection
from typing import Any

from pagedllm.c_heap import share_one_arena
from pagedllm.clients.async_engine import AsyncEngine
from pagedllm.clients.kv_publisher import KVSnapshotPublisher
from pagedllm.clients.metrics import ServerMetrics, engine_stats
from pagedllm.config import EngineConfig
from pagedllm.engine.protocol import EngineDeadError
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# least seconds between two stats messages while the engine works
STATS_INTERVAL_S = 0.1
# how often the pipe loop looks at whether the engine thread still runs
POLL_S = 0.5


class _Outbox:
    """The replica's sending end: one lock around the pipe, outputs batched per engine pass."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()
        self.outputs: list[RequestOutput] = []
        self.failures: list[tuple[str, str]] = []

    def send(self, message: tuple) -> None:
        """Send one message; a server that is gone is not an error here (the pipe loop sees it)."""
        with self._lock:
            try:
                self.conn.send(message)
            except (OSError, ValueError):
                pass

    def flush(self, engine: object = None) -> None:
        """Send the pass's outputs and failures as one message (the engine thread, between steps)."""
        if self.outputs or self.failures:
            outputs, failures = self.outputs, self.failures
            self.outputs, self.failures = [], []
            self.send(("outputs", outputs, failures))


class _PipeStream:
    """Stands where the one-engine server keeps a request's asyncio queue: outputs go to the outbox."""

    def __init__(self, request_id: str, outbox: _Outbox) -> None:
        self.request_id = request_id
        self.outbox = outbox

    def put(self, item: RequestOutput | BaseException) -> None:
        """Queue an output or a failure for the pass's message (engine thread)."""
        if isinstance(item, BaseException):
            self.outbox.failures.append((self.request_id, str(item)))
        else:
            self.outbox.outputs.append(item)

    def observe(self, out: RequestOutput, now: float, metrics: ServerMetrics | None) -> None:
        """Latency metrics are the server's to record (it sees when tokens arrive)."""


class _Reporter:
    """Sends stats, cached block hashes and /kv snapshots, rate-limited (engine thread)."""

    def __init__(self, outbox: _Outbox, publisher: KVSnapshotPublisher | None) -> None:
        self.outbox = outbox
        self.publisher = publisher
        self._last = float("-inf")
        self._idle_reported = False

    def maybe_report(self, engine: Any) -> None:
        """Report if ``STATS_INTERVAL_S`` passed, or once when the engine goes idle."""
        idle = not engine.has_unfinished_requests()
        now = time.monotonic()
        published = self.publisher is not None and self.publisher.maybe_publish(engine)
        if idle and self._idle_reported and not published:
            return
        if not idle and now - self._last < STATS_INTERVAL_S and not published:
            self._idle_reported = False
            return
        self._last = now
        self._idle_reported = idle
        hashes = getattr(engine.block_manager, "hash_to_block", {})
        kv = self.publisher.latest if published and self.publisher is not None else None
        self.outbox.send(("stats", engine_stats(engine), array("Q", hashes).tobytes(), kv))


def _picklable(e: BaseException) -> BaseException:
    """``e`` if it survives the pipe, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def _add(client: AsyncEngine, outbox: _Outbox, call_id: int, items: list, params: SamplingParams) -> None:
    """Hand an ``add`` to the engine thread; the answer goes back when it has run."""
    if params.structured_outputs is not None:
        try:  # compiled here, off the engine thread; the add then finds it in the cache
            client.engine.compile_grammar(params)
        except ValueError:
            pass  # the add raises it again, and that answer goes back
    streams = [_PipeStream(rid, outbox) for rid, _, _ in items]
    prompts = [(text, ids) for _, text, ids in items]
    try:
        fut = client.submit_add(streams, prompts, params)
    except EngineDeadError as e:
        outbox.send(("added", call_id, None, e))
        return

    def answer(f: Any) -> None:
        err = f.exception()
        outbox.send(("added", call_id, None if err else f.result(), None if err is None else _picklable(err)))

    fut.add_done_callback(answer)


def _beat(outbox: _Outbox, interval: float, done: threading.Event) -> None:
    """Send a heartbeat every ``interval`` seconds until ``done`` is set (its own thread)."""
    while not done.wait(interval):
        outbox.send(("heartbeat",))


def _serve(conn: Connection, client: AsyncEngine, outbox: _Outbox) -> None:
    """Move messages from the pipe to the engine thread until told to stop or the server is gone."""
    while client.is_alive:
        try:
            if not conn.poll(POLL_S):
                continue
            message = conn.recv()
        except (EOFError, OSError):
            return  # the server's end closed: it is gone
        kind = message[0]
        if kind == "add":
            _add(client, outbox, *message[1:])
        elif kind == "abort":
            client.abort(message[1])
        elif kind == "stop":
            return
        else:
            logger.error("replica: unknown message %r", kind)


def run_replica(
    index: int, config: EngineConfig, conn: Connection, cpus: list[int] | None, kv_page: bool,
    heartbeat_interval: float,
) -> None:
    """The replica process's entry point: build the engine, say ready, serve the pipe, exit.

    Args:
        index: the replica's number (for logs).
        config: the engine configuration (``num_threads`` already this replica's share).
        conn: this process's end of the pipe.
        cpus: the cores to pin this process to, or None.
        kv_page: publish /kv snapshots.
        heartbeat_interval: seconds between two heartbeats once the engine is ready.
    """
    share_one_arena()  # before any thread allocates: the engine thread's steps reuse the heap (pagedllm/c_heap.py)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s replica {index} %(name)s: %(message)s")
    if cpus:
        os.sched_setaffinity(0, cpus)
    from pagedllm.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(config)
    except BaseException as e:
        conn.send(("failed_to_start", f"{type(e).__name__}: {e}"))
        sys.exit(1)
    outbox = _Outbox(conn)
    publisher = KVSnapshotPublisher() if kv_page else None
    first = publisher.publish(engine) if publisher is not None else None
    client = AsyncEngine(engine)
    reporter = _Reporter(outbox, publisher)
    client.between_steps += [outbox.flush, reporter.maybe_report]
    client.start()
    outbox.send(("ready", os.getpid(), first))
    done = threading.Event()
    threading.Thread(target=_beat, args=(outbox, heartbeat_interval, done), name="pagedllm-heartbeat",
                     daemon=True).start()
    _serve(conn, client, outbox)
    done.set()
    crashed = client.crash is not None
    client.stop()
    sys.exit(1 if crashed else 0)
