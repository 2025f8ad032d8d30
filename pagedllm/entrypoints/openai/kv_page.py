"""The live KV-cache page: ``GET /kv`` (HTML), ``GET /kv/state`` (JSON), ``GET /kv/events`` (SSE).

Every route serves what ``KVSnapshotPublisher`` last published: bytes built
on the engine thread between steps. No handler touches the engine.

Auth: the same as ``/metrics``, open without the API key (``guards.OPEN_ROUTES``).
A browser opening ``/kv`` by its address sends no ``Authorization`` header,
and ``EventSource`` cannot send one at all; the page shows block ids, request
ids and token counts, never token ids or text. A server that must not show
them runs with ``--no-kv-page``: the routes are then not there (404).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Sequence
from importlib import resources
from typing import Protocol

from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel, Field
from sse_starlette import EventSourceResponse, ServerSentEvent

from pagedllm.clients.kv_publisher import PublishedSnapshot
from pagedllm.entrypoints.openai.protocol import APIError, ErrorResponse

# what /kv/state may answer besides the snapshot, for /openapi.json
_KV_STATE_ERRORS = {
    400: {"model": ErrorResponse, "description": "``replica`` is not a data-parallel replica of this server"},
    503: {"model": ErrorResponse, "description": "That replica has not published a snapshot yet"},
}

KV_ROUTES = ("/kv", "/kv/state", "/kv/events")

# how often an event stream looks for a newer snapshot (the publisher sends at most 4 a second)
POLL_S = 0.05
# keep-alive comments on an idle stream, so proxies do not cut it
PING_S = 15


class KVCheckpoint(BaseModel):
    """A state checkpoint slot: the state after ``num_tokens`` tokens, kept for a verify step's rollback."""

    slot: int
    num_tokens: int


class KVSequence(BaseModel):
    """One sequence of a request: its block table in logical order and its progress."""

    seq_id: int
    index: int = Field(description="which of the request's n samples (or beams) this is")
    status: str = Field(description="running or waiting")
    num_tokens: int = Field(description="prompt plus generated tokens")
    num_prompt_tokens: int
    num_computed_tokens: int = Field(description="tokens whose K/V is in the cache")
    num_cached_tokens: int = Field(description="prompt tokens found in the prefix cache at admission")
    num_preemptions: int
    block_table: list[int] = Field(description="logical block i -> physical block id; empty while waiting")
    group_tables: list[list[int]] = Field(
        default=[], description="the other KV cache groups' tables (KV group 1 on), -1 where a window group gave "
                                "a block back; empty for a model with one group")
    state_slot: int | None = Field(default=None, description="a hybrid model's state slot; null: none held")
    state_checkpoint: KVCheckpoint | None = Field(
        default=None, description="the speculative decoding checkpoint a verify step holds; null: none")


class KVRequest(BaseModel):
    """A request in the scheduler's queues (running ones first)."""

    id: str
    status: str = Field(description="running, waiting, or preempted (waiting again after losing its blocks)")
    sequences: list[KVSequence]


class KVCounters(BaseModel):
    """Pool totals; waste is slots held but not yet written (the unfilled tail of last blocks)."""

    used_blocks: int
    cached_blocks: int = Field(description="free blocks that still hold a cached prefix")
    free_blocks: int = Field(description="free blocks holding nothing")
    shared_blocks: int = Field(description="blocks with a reference count above 1")
    held_slots: int
    waste_slots: int
    prefix_cache_queries: int = Field(description="prompt tokens looked up in the prefix cache")
    prefix_cache_hits: int
    prefix_cache_hit_rate: float | None = Field(description="hits / queries; null before any query")
    preemptions: int
    cow_copies: int = Field(description="copy-on-write block copies so far")
    num_running_seqs: int
    num_waiting_seqs: int
    window_released_blocks: int = Field(
        default=0, description="blocks sliding-window KV cache groups gave back as they left every window")


class KVMemory(BaseModel):
    """The pool's bytes in this process: reserved address space, and what the OS backs with memory."""

    bytes_per_block: int = Field(description="one block across all layers, K and V (a rank's share under TP)")
    reserved_bytes: int = Field(description="the pool's address space, as pagedllm:kv_cache_reserved_bytes")
    resident_blocks: int = Field(
        description="blocks written since their pages were last given back to the OS (held, cached, or freed "
        "while requests still run; an idle server keeps only its cached prefixes)"
    )
    resident_bytes: int = Field(description="resident_blocks * bytes_per_block, as pagedllm:kv_cache_resident_bytes")


class KVGroup(BaseModel):
    """One KV cache group (kv_groups.py): layers sharing a block table per sequence, blocks from the one pool."""

    group: int = Field(default=0, description="the group's index: its table is block_table (0) or group_tables[g-1]")
    kind: str = Field(default="full", description="full (attention over every token) or window")
    window: int | None = Field(description="the group's sliding window in tokens; null: full attention")
    layers: list[int] = Field(default=[], description="the model layers whose K/V the group holds")
    used_blocks: int = Field(description="blocks the group's tables hold now")
    shared_blocks: int = Field(default=0, description="of those, blocks with a reference count above 1")
    cached_blocks: int = Field(default=0, description="free blocks still holding a cached prefix of this group")
    hole_entries: int = Field(default=0, description="-1 entries in the queued sequences' tables of this group "
                                                     "(blocks given back as they left the window)")
    released_blocks: int = Field(default=0, description="blocks this window group gave back so far")


class KVSlotHolder(BaseModel):
    """A held state slot and the sequence holding it."""

    slot: int
    seq_id: int | None = Field(description="null: a sequence not in the queues (a beam between its forks)")
    request_id: str | None


class KVCheckpointHolder(BaseModel):
    """A held checkpoint slot: whose, and after how many of its tokens."""

    slot: int
    seq_id: int
    num_tokens: int


class KVStateSlots(BaseModel):
    """A hybrid model's per-sequence state slots, the state snapshots of cached prefixes and speculative
    decoding's checkpoints (docs/hybrid-models.md); slots of all three are rows of the same state tensors."""

    bytes_per_slot: int = Field(default=0, description="one sequence's state over every state layer")
    num_slots: int = Field(description="state slots, one per sequence that may run")
    used_slots: int = Field(description="slots held by running sequences")
    free_slots: int = Field(default=0, description="slots no sequence holds")
    slot_holders: list[KVSlotHolder] = Field(default=[], description="the held slots, lowest first")
    num_snapshot_slots: int = Field(description="slots for state snapshots of cached prefixes")
    snapshots: int = Field(description="snapshots kept now")
    snapshots_taken: int = Field(description="snapshots taken so far")
    snapshot_bytes: int = Field(default=0, description="snapshots * bytes_per_slot")
    snapshot_lru: list[int] = Field(default=[], description="the snapshots' slots, least recently used (the next "
                                                            "one dropped) first; those of the step being run not yet")
    num_checkpoint_slots: int = Field(default=0, description="speculative decoding's checkpoint slots")
    used_checkpoint_slots: int = Field(default=0)
    checkpoints: list[KVCheckpointHolder] = Field(default=[], description="the held checkpoint slots")


class KVState(BaseModel):
    """The KV block pool as the engine thread last published it (at most 4 times a second)."""

    snapshot_id: int = Field(description="1, 2, ... in publishing order")
    time: float = Field(description="Unix time of the snapshot")
    num_blocks: int
    block_size: int = Field(description="token slots per block; slot = block * block_size + offset")
    block_states: str = Field(
        description="one letter per physical block: f free, c free with a cached prefix, h held, s shared"
    )
    ref_counts: list[int] = Field(description="reference count per physical block")
    requests: list[KVRequest]
    counters: KVCounters
    memory: KVMemory
    block_groups: list[int] = Field(
        default=[], description="per physical block, the KV cache group holding it or cached for it; -1 free")
    kv_groups: list[KVGroup] = Field(default=[], description="each KV cache group's kind, layers and blocks")
    state: KVStateSlots | None = Field(default=None, description="null for a model without state layers")


def page_html() -> bytes:
    """The page, shipped as package data (``static/kv.html``): no CDN, no build step."""
    return resources.files("pagedllm.entrypoints.openai").joinpath("static/kv.html").read_bytes()


async def snapshot_events(publisher: SnapshotSource) -> AsyncIterator[ServerSentEvent]:
    """Each newly published snapshot as one ``data:`` event, the current one first."""
    sent = 0
    while True:
        latest = publisher.latest
        if latest is not None and latest.snapshot_id != sent:
            sent = latest.snapshot_id
            yield ServerSentEvent(latest.body.decode(), id=str(sent))
        await asyncio.sleep(POLL_S)


class SnapshotSource(Protocol):
    """Anything with the latest published snapshot: a ``KVSnapshotPublisher``, or a data-parallel
    replica's client (which keeps the last snapshot its replica sent)."""

    latest: PublishedSnapshot | None


def add_kv_routes(app: FastAPI, publisher: SnapshotSource | Sequence[SnapshotSource]) -> None:
    """Register the page, its JSON and its event stream.

    With several sources (data-parallel replicas) ``/kv/state`` and
    ``/kv/events`` take ``?replica=i`` (default 0), and so does the page
    (``/kv?replica=1``), which passes it on.
    """
    html = page_html()
    sources = list(publisher) if isinstance(publisher, Sequence) else [publisher]
    # the bounds are FastAPI's check and /openapi.json's: a replica out of range is a 400 naming it
    last_replica = len(sources) - 1

    def pick(replica: int, request: Request) -> SnapshotSource:
        # an integer as the schema says one: FastAPI alone reads "0.0" as 0
        raw = request.query_params.get("replica")
        if raw is not None and not re.fullmatch(r"-?[0-9]+", raw):
            raise APIError(400, f"replica must be a decimal integer, got {raw!r}", "invalid_request_error",
                           "invalid_type", "replica")
        return sources[replica]

    @app.get("/kv", response_class=HTMLResponse)
    async def kv_page() -> Response:
        """The live KV-cache page: the block pool as a grid, the requests, their block tables."""
        return Response(html, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})

    @app.get("/kv/state", response_model=KVState, responses=_KV_STATE_ERRORS)
    # Query() as a default: its bound is this app's replica count, unknown to a module-level alias
    async def kv_state(
        request: Request,
        replica: int = Query(0, ge=0, le=last_replica, description="a data-parallel replica"),  # noqa: B008
    ) -> Response:
        """The latest KV snapshot as JSON: every block's state and ref count, the requests'
        block tables, the counters. ``GET /kv/events`` streams the same objects as
        server-sent events, one per new snapshot. ``replica`` picks a data-parallel replica."""
        latest = pick(replica, request).latest
        if latest is None:  # published before the app starts; here only if that failed
            if len(sources) > 1:
                raise APIError(503, f"replica {replica} has not published a snapshot yet", "server_error", None)
            raise RuntimeError("no KV snapshot was published")
        return Response(latest.body, media_type="application/json", headers={"Cache-Control": "no-cache"})

    # not in /openapi.json: an endless stream that schema-driven clients would wait on forever
    @app.get("/kv/events", include_in_schema=False)
    async def kv_events(
        request: Request, replica: int = Query(0, ge=0, le=last_replica),  # noqa: B008
    ) -> EventSourceResponse:
        """Server-sent events: each new KV snapshot (``/kv/state``'s object) as one event."""
        return EventSourceResponse(snapshot_events(pick(replica, request)), ping=PING_S, headers={"Cache-Control": "no-cache"})
