"""``pagedllm serve --data-parallel-size N``: N engine processes behind one API server.

``DataParallelEngine`` stands where the one-engine server's ``AsyncEngine``
stands: both implement ``engine/protocol.py``'s ``EngineClient``
(``add_requests``, ``abort``, ``drain``, ``is_alive``, ``engine`` for the
configuration and tokenizer), so the routes do not know how many engines
serve them. An engine client, not server code: it imports nothing of
``entrypoints/``, and raises the protocol's errors, which the server maps::

    handlers --add_requests--> PrefixRouter (prompt block hashes, loads) --> ReplicaClient k
                                                                               | pipe
       ^                                                                       v
       +-- asyncio.Queue <-- reader thread k <-- outputs / stats -- replica process k (LLMEngine)

The server process holds no model: ``ServingFrontend`` has the
configuration, the tokenizer (chat templates, prompt checks) and a grammar
compiler, so a bad schema is a 400 before anything is routed.

A replica that sends nothing, heartbeats included, for ``heartbeat_timeout``
seconds is marked down (``replica_up`` 0, ``/health`` says so), killed and
started again; its requests that had no output yet are routed again here
(``_on_lost``), the others fail (``replica_client.py`` says why).

The package: ``client.py`` (this module), ``prefix_router.py`` (which replica
gets a request), ``replica_client.py`` (this process's end of a replica),
``replica.py`` (the replica process), ``metrics.py`` (per-replica Prometheus figures).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from typing import Any

import torch

from pagedllm.clients.async_engine import Submission, _RequestStream, open_submission
from pagedllm.clients.data_parallel.metrics import ReplicaMetrics
from pagedllm.clients.data_parallel.prefix_router import PrefixRouter
from pagedllm.clients.data_parallel.replica_client import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    LostRequests,
    ReplicaClient,
    ReplicaEvents,
)
from pagedllm.clients.metrics import EngineStats, ServerMetrics
from pagedllm.config import EngineConfig
from pagedllm.device_memory import available_memory_bytes
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.protocol import EngineDeadError, EngineStepError, Prompt
from pagedllm.loader import load_model_config, model_file_bytes
from pagedllm.loader.generation_defaults import load_generation_defaults
from pagedllm.loader.tokenizer import Tokenizer
from pagedllm.resolved_config import replica_kv_budget
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


class ServingFrontend:
    """What the handlers read of an engine, without the model: configuration, tokenizer, checks, grammars.

    ``check_prompt_len`` and ``compile_grammar`` are ``LLMEngine``'s own
    methods, which read only the configuration and the grammar compiler.

    Args:
        config: the replicas' engine configuration.
    """

    check_prompt_len = LLMEngine.check_prompt_len
    compile_grammar = LLMEngine.compile_grammar

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = load_model_config(config.model)
        self.generation_defaults = load_generation_defaults(config.model, config.generation_config)
        self.tokenizer = Tokenizer(config.tokenizer or config.model, self.model_config.eos_token_ids)
        self.grammar_compiler = GrammarCompiler(
            self.tokenizer, self.model_config.vocab_size, sorted(self.tokenizer.eos_token_ids),
            config.grammar_limits,
        )


def plan_cores(num_replicas: int, num_threads: int | None) -> tuple[int | None, list[list[int] | None]]:
    """Threads per replica and the cores each is pinned to.

    Without ``num_threads`` each replica gets an equal share of this
    process's cores (at least one) and is pinned to its share; with it, the
    replicas are pinned only when ``num_replicas * num_threads`` cores exist.
    """
    if num_replicas < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {num_replicas}")
    cpus = sorted(os.sched_getaffinity(0))
    per = num_threads if num_threads is not None else max(1, len(cpus) // num_replicas)
    if per * num_replicas > len(cpus):
        return per, [None] * num_replicas
    return per, [cpus[i * per : (i + 1) * per] for i in range(num_replicas)]


class DataParallelEngine:
    """N replica processes behind the handlers' engine interface.

    Args:
        config: the engine configuration every replica builds its engine from.
        num_replicas: N (>= 1).
        metrics: where to record statistics, or None.
        max_waiting: most accepted requests still waiting for their first
            token over all replicas; past it ``add_requests`` raises a 429.
        kv_page: whether replicas publish /kv snapshots.
        heartbeat_timeout: seconds a replica may send nothing (heartbeats
            come every ``min(1, timeout / 4)`` s) before it is killed and replaced.
    """

    def __init__(
        self, config: EngineConfig, num_replicas: int, metrics: ServerMetrics | None = None,
        max_waiting: int | None = None, kv_page: bool = True,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
    ) -> None:
        threads, cores = plan_cores(num_replicas, config.num_threads)
        self.engine = ServingFrontend(config)
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.num_waiting = 0  # event-loop side only
        self.draining = False
        self.router = PrefixRouter(num_replicas, config.block_size, config.prefix_caching)
        self.replica_metrics = ReplicaMetrics(metrics, num_replicas) if metrics is not None else None
        # the front end applies the model's sampling defaults before a request reaches a replica: the replicas
        # need not read (nor log) them again
        replica_config = dataclasses.replace(config, num_threads=threads, generation_config="vllm")
        # a default KV pool: each replica's share of the machine's, not the whole share each (resolved_config.py)
        budget = replica_kv_budget(config, num_replicas, available_memory_bytes(torch.device(config.device)),
                                   model_file_bytes(config.model))
        if budget is not None:
            replica_config = dataclasses.replace(replica_config, kv_cache_memory_bytes=budget)
        events = ReplicaEvents(self._on_stats, self._on_up, self._on_unresponsive, self._on_lost)
        self.replicas = [
            ReplicaClient(i, replica_config, cores[i], kv_page, metrics, events, heartbeat_timeout)
            for i in range(num_replicas)
        ]
        if self.replica_metrics is not None:
            for gauge, replica in zip(self.replica_metrics.in_flight, self.replicas):
                gauge.set_function(lambda r=replica: r.num_unfinished)

    # --- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        """Start every replica (their engines load side by side); raises if one does not start."""
        errors: list[BaseException] = []

        def start(replica: ReplicaClient) -> None:
            try:
                replica.start()
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=start, args=(r,)) for r in self.replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.stop()
            raise errors[0]

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every replica process; requests in flight get an error."""
        threads = [threading.Thread(target=r.stop) for r in self.replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    @property
    def is_alive(self) -> bool:
        """At least one replica serves (the others may be restarting)."""
        return any(r.alive and not r.stopping for r in self.replicas)

    def health_report(self) -> dict[str, Any]:
        """``/health``'s body: ``ok`` when every replica serves, ``degraded`` when some do, each one's state."""
        replicas = []
        for r in self.replicas:
            state = "stopping" if r.stopping else "up" if r.alive else "restarting"
            replicas.append({
                "replica": r.index, "state": state, "pid": r.pid, "restarts": r.restarts,
                "heartbeat_timeouts": r.num_unresponsive, "last_failure": r.last_failure,
                "requests_in_flight": r.num_unfinished,
            })
        num_up = sum(1 for r in replicas if r["state"] == "up")
        status = "ok" if num_up == len(replicas) else "degraded" if num_up else "down"
        return {"status": status, "replicas_up": num_up, "replicas": replicas}

    @property
    def has_work(self) -> bool:
        """Requests in flight on any replica."""
        return any(r.num_unfinished for r in self.replicas)

    async def drain(self, timeout: float) -> None:
        """Refuse new requests, give those in flight ``timeout`` seconds, then stop the replicas."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.has_work and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self.stop)

    # --- replica callbacks (reader threads) -------------------------------------------
    def _on_stats(self, index: int, stats: EngineStats) -> None:
        """A replica reported: its cached hashes go to the router, its figures to the metrics."""
        self.router.report(index, self.replicas[index].cached_hashes)
        if self.replica_metrics is not None:
            self.replica_metrics.update(index, stats)

    def _on_up(self, index: int, up: bool, restarted: bool) -> None:
        """A replica started (again) or died: a dead one's cache is forgotten."""
        if not up:
            self.router.forget(index)
        if self.replica_metrics is not None:
            self.replica_metrics.set_up(index, up)
            if restarted:
                self.replica_metrics.restarted(index)

    def _on_unresponsive(self, index: int) -> None:
        """A replica missed its heartbeats and is being killed."""
        if self.replica_metrics is not None:
            self.replica_metrics.unresponsive(index)

    def _on_lost(self, index: int, lost: list[LostRequests]) -> None:
        """Route again, to the replicas that serve, the requests a stuck replica gave no output (its reader thread)."""
        num_moved = 0
        for item in lost:
            if item.answer is not None and item.answer.done():
                continue  # its caller went away (cancelled) while the replica was stuck
            try:
                hashes = [self.router.prompt_hashes(ids) for _, ids in item.prompts]
                target = self.router.choose(hashes, self.loads())
                self.router.record(target, hashes)
                fut = self.replicas[target].add(item.streams, item.prompts, item.params, item.moves + 1)
            except (ValueError, EngineDeadError) as e:
                _fail_lost(item, EngineDeadError(
                    f"data-parallel replica {index} stopped answering and no other replica could take "
                    f"this request: {e}"))
                continue
            fut.add_done_callback(lambda f, item=item: _settle_moved(item, f))
            num_moved += len(item.streams)
        if num_moved:
            logger.warning("moved %d requests that had no output yet from stuck replica %d", num_moved, index)

    # --- requests (event loop) --------------------------------------------------------
    def abort(self, request_ids: list[str]) -> None:
        """Abort requests wherever they run (fire and forget)."""
        for replica in self.replicas:
            replica.abort(request_ids)

    def release_waiting(self, stream: _RequestStream) -> None:
        """The request has left the waiting count (first output, error or abort)."""
        if stream.waiting:
            stream.waiting = False
            self.num_waiting -= 1

    def loads(self) -> list[int | None]:
        """Per replica its unfinished requests; None for one that does not serve now."""
        return [r.num_unfinished if r.alive else None for r in self.replicas]

    async def add_requests(self, request_id: str, prompts: list[Prompt], params: SamplingParams) -> Submission:
        """Route the request (all its prompts, all their samples) to one replica and queue it there.

        Errors as ``AsyncEngine.add_requests``; EngineDeadError (a 503) when no replica serves.
        """
        sub = open_submission(self, request_id, len(prompts), params)
        streams = sub.streams
        hashes = [self.router.prompt_hashes(ids) for _, ids in prompts]
        try:
            fut = self._route(streams, prompts, params, hashes)
            counts = await asyncio.wrap_future(fut)
        except BaseException as e:
            for s in streams:
                self.release_waiting(s)
            if isinstance(e, asyncio.CancelledError):
                self.abort([s.request_id for s in streams])  # the add may have run already
            raise
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(sum(counts))
        sub.prompt_token_counts = counts
        return sub

    def _route(
        self, streams: list[_RequestStream], prompts: list[Prompt], params: SamplingParams, hashes: list[list[int]]
    ) -> Any:
        """Send the request to the router's choice; a replica found down just then is skipped (EngineDeadError
        once none serves)."""
        for _ in range(len(self.replicas)):
            try:
                index = self.router.choose(hashes, self.loads())
            except ValueError as e:
                raise EngineDeadError(str(e)) from e
            try:
                fut = self.replicas[index].add(streams, prompts, params)
            except EngineDeadError:
                continue  # declared stuck (or died) between the choice and the add: its load reads None now
            self.router.record(index, hashes)
            return fut
        raise EngineDeadError("no data-parallel replica is serving")


def _fail_lost(item: LostRequests, err: BaseException) -> None:
    """Moved requests that could not run anywhere: their add's caller, or their streams, get ``err``."""
    if item.answer is not None:
        if not item.answer.done():  # a caller that went away cancelled it
            item.answer.set_exception(err)
    else:
        for stream in item.streams:
            stream.put(EngineStepError(str(err)))


def _settle_moved(item: LostRequests, fut: Any) -> None:
    """The new replica answered a moved add: pass it on to the caller that still waits for it."""
    err = fut.exception()
    if item.answer is not None:
        if item.answer.done():
            return  # its caller went away (cancelled); the abort that came with it reaches the new replica
        if err is None:
            item.answer.set_result(fut.result())
        else:
            item.answer.set_exception(err)
    elif err is not None:
        for stream in item.streams:
            stream.put(EngineStepError(f"the request could not be moved off a stuck replica: {err}"))
