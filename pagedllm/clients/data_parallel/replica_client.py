"""The API server's end of one data-parallel replica: its process, its pipe, its requests in flight.

``ReplicaClient`` starts the replica process (``replica.py``) with
``torch.multiprocessing``'s spawn context, sends it requests and aborts, and
runs one reader thread that hands each arriving output to its request's
stream (the same ``_RequestStream`` the one-engine server uses), resolves
adds, and keeps the replica's latest figures, cached block hashes and /kv
snapshot. When the process dies (the pipe reads end-of-file) every request in
flight on it gets an ``EngineStepError`` (a 500, or an error event in a
stream), the others replicas are untouched, and the reader thread starts the
process again, waiting longer after each start that fails.

A replica that stops answering (no message, heartbeats included, for
``heartbeat_timeout`` seconds: a SIGSTOPped or thrashing process) is marked
down at once, so nothing new is routed to it, and killed with SIGKILL; its
end-of-file then takes the path above, with one difference: its requests
that have had no output yet are handed back (``on_lost``) to run on another
replica, since their client has seen nothing and cannot tell. Those that
streamed tokens fail: they cannot resume elsewhere without the client seeing
a seam. Requests of a replica that crashed do not move, whatever their
state: the crash may be theirs (a request that kills an engine in its
prefill has had no output either), and moving it would take a healthy
replica down with it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from array import array
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch.multiprocessing as tmp

from pagedllm.clients.async_engine import StreamSink
from pagedllm.clients.data_parallel.replica import run_replica
from pagedllm.clients.kv_publisher import PublishedSnapshot
from pagedllm.clients.metrics import EngineStats, ServerMetrics
from pagedllm.config import EngineConfig
from pagedllm.engine.protocol import EngineDeadError, EngineStepError, Prompt
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# seconds a replica gets to exit after "stop" before it is terminated, then killed
STOP_TIMEOUT_S = 10.0
# waits before restarting a replica that keeps dying: 1 s, doubling, at most this
MAX_RESTART_BACKOFF_S = 30.0
# default seconds without any message from a replica before it is declared stuck and killed
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
# smallest timeout accepted: the replica's GIL-held moments (scheduling, pickling) and a loaded
# machine's scheduling delays must not look like a stopped process
MIN_HEARTBEAT_TIMEOUT_S = 1.0
# a replica beats (and the server checks) at least this often, and four times per timeout
MAX_HEARTBEAT_INTERVAL_S = 1.0
# how many stuck replicas one request may be moved away from before it fails instead
MAX_MOVES = 1


def heartbeat_interval(timeout: float) -> float:
    """Seconds between two heartbeats (and two checks) for a heartbeat timeout of ``timeout``."""
    return min(MAX_HEARTBEAT_INTERVAL_S, timeout / 4)


def check_heartbeat_timeout(timeout: float) -> float:
    """``timeout`` if it is a usable heartbeat timeout (seconds), else ValueError."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
        MIN_HEARTBEAT_TIMEOUT_S <= timeout < float("inf")
    ):
        raise ValueError(
            f"replica heartbeat timeout must be a number of seconds >= {MIN_HEARTBEAT_TIMEOUT_S:g}, got {timeout!r}"
        )
    return float(timeout)


class ReplicaStartError(RuntimeError):
    """A replica process exited before its engine was ready."""


@dataclasses.dataclass
class LostRequests:
    """Engine requests of a stuck replica that had no output yet: they may run on another replica.

    ``answer`` is the add's future when the replica never answered the add
    (whoever moves them resolves it); None once the add was answered.
    ``moves`` counts the replicas they were already moved away from.
    """

    streams: list[StreamSink]
    prompts: list[Prompt]
    params: SamplingParams
    moves: int
    answer: concurrent.futures.Future | None


@dataclasses.dataclass
class ReplicaEvents:
    """What a ``ReplicaClient`` tells its owner (all called from the replica's own threads).

    Args:
        on_stats: the index and the replica's figures, counters continued across restarts.
        on_up: the index, whether the replica now serves, and whether that is after a restart.
        on_unresponsive: the index of a replica that missed its heartbeats (it is being killed).
        on_lost: the index and the requests of a stuck replica that may run elsewhere.
    """

    on_stats: Callable[[int, EngineStats], None]
    on_up: Callable[[int, bool, bool], None]
    on_unresponsive: Callable[[int], None]
    on_lost: Callable[[int, list[LostRequests]], None]


class ReplicaClient:
    """One replica process and the requests the server has on it.

    Args:
        index: the replica's number (0, 1, ...).
        config: the engine configuration its process builds its engine from.
        cpus: the cores to pin the process to, or None.
        kv_page: whether the replica publishes /kv snapshots.
        metrics: the server metrics the request latencies go to, or None.
        events: the owner's callbacks.
        heartbeat_timeout: seconds without a message before the replica is
            declared stuck and killed (``check_heartbeat_timeout``).
    """

    def __init__(
        self, index: int, config: EngineConfig, cpus: list[int] | None, kv_page: bool,
        metrics: ServerMetrics | None, events: ReplicaEvents,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
    ) -> None:
        self.index = index
        self.config = config
        self.cpus = cpus
        self.kv_page = kv_page
        self.metrics = metrics
        self.events = events
        self.on_stats = events.on_stats
        self.on_up = events.on_up
        self.heartbeat_timeout = check_heartbeat_timeout(heartbeat_timeout)
        self.streams: dict[str, StreamSink] = {}
        # per request not yet answered by any output: its prompt, parameters and moves so far
        self._unstarted: dict[str, tuple[Prompt, SamplingParams, int]] = {}
        self.alive = False
        self.stopping = False
        self.pid: int | None = None
        self.restarts = 0
        self.cached_hashes: frozenset[int] = frozenset()
        self.latest: PublishedSnapshot | None = None  # the /kv page reads it, as a publisher's
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._calls: dict[int, list[str]] = {}  # a pending add's request ids
        self.unresponsive_s: float | None = None  # set while a stuck process is being replaced
        self.num_unresponsive = 0
        self.last_failure: str | None = None  # why the process last died, for /health
        self._last_heard = time.monotonic()
        self._stopped = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._call_ids = itertools.count()
        self._lock = threading.Lock()  # streams, pending, alive and the pipe's sending side
        self._ctx = tmp.get_context("spawn")
        self._process: Any = None
        self._conn: Connection | None = None
        self._reader: threading.Thread | None = None
        self._carry = EngineStats()  # counters of earlier processes of this replica
        self._last = EngineStats()

    # --- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        """Start the process and wait until its engine is built; ReplicaStartError if it is not."""
        self._spawn()
        self._reader = threading.Thread(target=self._read_loop, name=f"pagedllm-replica-{self.index}", daemon=True)
        self._reader.start()
        self._watchdog = threading.Thread(target=self._watch_loop, name=f"pagedllm-watchdog-{self.index}",
                                          daemon=True)
        self._watchdog.start()

    def _spawn(self, restart: bool = False) -> None:
        """Start a process and wait for its engine; ReplicaStartError if it exits first."""
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=run_replica,
            args=(self.index, self.config, child, self.cpus, self.kv_page, heartbeat_interval(self.heartbeat_timeout)),
            name=f"pagedllm-replica-{self.index}",
        )
        process.start()
        child.close()  # only the child holds that end now: its death is our end-of-file
        self._process = process
        try:
            message = parent.recv()
        except (EOFError, OSError):
            message = ("failed_to_start", f"the process exited with code {process.join(5) or process.exitcode}")
        if message[0] != "ready":
            parent.close()
            process.join(STOP_TIMEOUT_S)
            raise ReplicaStartError(f"data-parallel replica {self.index} did not start: {message[1]}")
        _, self.pid, self.latest = message
        with self._lock:
            self._conn = parent
            self._last_heard = time.monotonic()
            self.alive = not self.stopping
        logger.info("data-parallel replica %d started (pid %d, cores %s)", self.index, self.pid, self.cpus or "any")
        if restart:
            self.restarts += 1
        self.on_up(self.index, True, restart)

    def _send_stop(self) -> None:
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.send(("stop",))
                except (OSError, ValueError):
                    pass

    def stop(self) -> None:
        """Stop the process (asked, then terminated, then killed); requests in flight get an error."""
        with self._lock:
            self.stopping = True
        self._stopped.set()
        self._send_stop()
        for _ in range(2):  # a restart may be under way: it sees `stopping` and ends
            process = self._process
            if process is not None:
                process.join(STOP_TIMEOUT_S)
                if process.is_alive():
                    process.terminate()
                    process.join(5)
                if process.is_alive():
                    process.kill()
                    process.join(5)
            if self._reader is not None:
                self._reader.join(STOP_TIMEOUT_S)

    # --- requests (event loop) ------------------------------------------------------
    def add(
        self, streams: list[StreamSink], prompts: list[Prompt], params: SamplingParams, moves: int = 0,
    ) -> concurrent.futures.Future[list[int]]:
        """Send one engine request per stream (all or none); the future gives the prompts' token counts.

        ``moves``: how many stuck replicas these requests were moved away from already.
        """
        fut: concurrent.futures.Future[list[int]] = concurrent.futures.Future()
        items = [(s.request_id, text, ids) for s, (text, ids) in zip(streams, prompts)]
        with self._lock:
            if not self.alive or self._conn is None:
                raise EngineDeadError(f"data-parallel replica {self.index} is not running")
            call_id = next(self._call_ids)
            self._pending[call_id] = fut
            self._calls[call_id] = [s.request_id for s in streams]
            for s, prompt in zip(streams, prompts):
                self.streams[s.request_id] = s
                self._unstarted[s.request_id] = (prompt, params, moves)
            try:
                self._conn.send(("add", call_id, items, params))
            except (OSError, ValueError) as e:
                self._pending.pop(call_id, None)
                self._calls.pop(call_id, None)
                for s in streams:
                    self.streams.pop(s.request_id, None)
                    self._unstarted.pop(s.request_id, None)
                raise EngineDeadError(f"data-parallel replica {self.index} is not running: {e}") from e
        return fut

    def abort(self, request_ids: list[str]) -> None:
        """Abort those of ``request_ids`` that run here (fire and forget)."""
        with self._lock:
            mine = [rid for rid in request_ids if self.streams.pop(rid, None) is not None]
            for rid in mine:
                self._unstarted.pop(rid, None)
            if mine and self.alive and self._conn is not None:
                try:
                    self._conn.send(("abort", mine))
                except (OSError, ValueError):
                    pass  # the process is gone; the reader thread fails what was left

    @property
    def num_unfinished(self) -> int:
        """Engine requests in flight here (the router's load figure)."""
        return len(self.streams)

    # --- the reader thread ----------------------------------------------------------
    def _read_loop(self) -> None:
        """Handle the replica's messages until it is stopped; restart it when it dies."""
        while True:
            conn = self._conn
            try:
                message = conn.recv() if conn is not None else None
            except (EOFError, OSError):
                message = None
            self._last_heard = time.monotonic()
            if message is None:
                if not self._replace_dead_process():
                    return
                continue
            try:
                self._dispatch(message)
            except Exception:
                logger.exception("replica %d: a message could not be handled", self.index)

    def _dispatch(self, message: tuple) -> None:
        """One message from the replica: outputs, an add's answer, or stats."""
        kind = message[0]
        if kind == "outputs":
            self._deliver(message[1], message[2])
        elif kind == "added":
            _, call_id, counts, err = message
            with self._lock:
                fut = self._pending.pop(call_id, None)
                rids = self._calls.pop(call_id, [])
                if err is not None:  # refused: none of its requests will have an output
                    for rid in rids:
                        self.streams.pop(rid, None)
                        self._unstarted.pop(rid, None)
            if fut is None or fut.done():
                pass  # its caller went away (cancelled the future) and aborted
            elif err is not None:
                fut.set_exception(err)
            else:
                fut.set_result(counts)
        elif kind == "stats":
            _, stats, hashes, kv = message
            self.cached_hashes = frozenset(array("Q", hashes))
            if kv is not None:
                self.latest = kv
            self._last = stats
            self.on_stats(self.index, self._carry + stats)
        elif kind != "heartbeat":
            logger.error("replica %d sent an unknown message %r", self.index, kind)

    def _deliver(self, outputs: list, failures: list[tuple[str, str]]) -> None:
        """Hand one engine pass's outputs and failures to their requests' streams."""
        now = time.monotonic()
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            self._unstarted.pop(out.request_id, None)
            stream.observe(out, now, self.metrics)
            if out.finished:
                self.streams.pop(out.request_id, None)
            stream.put(out)
        for rid, error in failures:
            self._unstarted.pop(rid, None)
            stream = self.streams.pop(rid, None)
            if stream is not None:
                # the replica's engine thread already wrote the whole message (AsyncEngine's prefix included)
                stream.put(EngineStepError(error))

    def _watch_loop(self) -> None:
        """Kill the process once it has sent nothing, heartbeats included, for ``heartbeat_timeout`` seconds."""
        while not self._stopped.wait(heartbeat_interval(self.heartbeat_timeout)):
            silent = time.monotonic() - self._last_heard
            if silent <= self.heartbeat_timeout:
                continue
            with self._lock:
                if not self.alive or self.stopping:
                    continue  # starting, restarting or stopping: not beating yet, or no longer
                self.alive = False  # nothing new is routed here from now on
                self.unresponsive_s = silent
                self.last_failure = f"sent nothing for {silent:.1f} s (heartbeat timeout {self.heartbeat_timeout:g} s)"
                process = self._process
            self.num_unresponsive += 1
            logger.error("data-parallel replica %d (pid %s) sent nothing for %.1f s (heartbeat timeout %g s); "
                         "killing it", self.index, self.pid, silent, self.heartbeat_timeout)
            self.events.on_unresponsive(self.index)
            self.on_up(self.index, False, False)
            if process is not None:
                process.kill()  # SIGKILL ends a stopped process too; the reader then reads end-of-file

    def _replace_dead_process(self) -> bool:
        """Fail what ran on the dead process (a stuck one's unstarted requests move) and start a new one.

        False when the replica is stopping.
        """
        with self._lock:
            self.alive = False
            streams, self.streams = self.streams, {}
            pending, self._pending = self._pending, {}
            calls, self._calls = self._calls, {}
            unstarted, self._unstarted = self._unstarted, {}
            if self._conn is not None:
                self._conn.close()
            self._conn = None
        silent, self.unresponsive_s = self.unresponsive_s, None
        self.on_up(self.index, False, False)
        self.cached_hashes = frozenset()
        process = self._process
        if process is not None:
            process.join(5)
        code = process.exitcode if process is not None else None
        self._carry = self._carry + self._last.counters_only()
        self._last = EngineStats()
        self.on_stats(self.index, self._carry)
        if silent is not None:
            self.last_failure = f"sent nothing for {silent:.1f} s (heartbeat timeout {self.heartbeat_timeout:g} s)"
            err = EngineStepError(
                f"data-parallel replica {self.index} stopped answering ({self.last_failure}) and was killed "
                "while this request ran"
            )
        else:
            self.last_failure = f"exited with code {code}"
            err = EngineStepError(
                f"data-parallel replica {self.index} stopped (exit code {code}) while this request ran"
            )
        if not self.stopping:
            logger.error("data-parallel replica %d (pid %s) %s; restarting it", self.index, self.pid,
                         self.last_failure)
        lost = _take_lost(streams, pending, calls, unstarted) if silent is not None and not self.stopping else []
        for stream in streams.values():
            stream.put(err)
        for fut in pending.values():
            if not fut.done():  # a caller that went away cancelled it
                fut.set_exception(err)
        if lost:
            self.events.on_lost(self.index, lost)
        return self._restart()

    def _restart(self) -> bool:
        """Start the process again, waiting longer after each failed start; False once stopping."""
        backoff = 1.0
        while not self.stopping:
            try:
                self._spawn(restart=True)
                if self.stopping:  # stop() came while the engine loaded
                    self._send_stop()
                return True
            except ReplicaStartError as e:
                logger.error("%s; retrying in %.0f s", e, backoff)
                time.sleep(backoff)
                backoff = min(2 * backoff, MAX_RESTART_BACKOFF_S)
        return False


def _take_lost(
    streams: dict[str, StreamSink], pending: dict[int, concurrent.futures.Future], calls: dict[int, list[str]],
    unstarted: dict[str, tuple[Prompt, SamplingParams, int]],
) -> list[LostRequests]:
    """Take out of ``streams`` and ``pending`` the requests a stuck replica gave no output yet.

    An add the replica never answered moves whole (its future is resolved
    by the move); an answered one moves request by request. A request
    moves at most ``MAX_MOVES`` times: the one that follows it could be stuck by it.
    """
    lost = []
    for call_id, rids in calls.items():
        if call_id not in pending or not all(rid in streams and rid in unstarted for rid in rids):
            continue  # aborted meanwhile, or partly answered: it fails
        entries = [unstarted[rid] for rid in rids]
        if not entries or entries[0][2] >= MAX_MOVES:
            continue
        lost.append(LostRequests([streams.pop(rid) for rid in rids], [e[0] for e in entries], entries[0][1],
                                 entries[0][2], pending.pop(call_id)))
    unanswered = {rid for call_id, rids in calls.items() if call_id in pending for rid in rids}
    for rid in [rid for rid in streams if rid not in unanswered and rid in unstarted and unstarted[rid][2] < MAX_MOVES]:
        prompt, params, moves = unstarted[rid]
        lost.append(LostRequests([streams.pop(rid)], [prompt], params, moves, None))
    return lost
