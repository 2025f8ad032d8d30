"""The KV snapshot the engine thread publishes between steps, for the ``/kv`` page.

The engine thread calls ``maybe_publish`` after each pass of its loop (where
it updates the metrics). At most every ``min_interval`` seconds it builds the
snapshot (``engine/kv_snapshot.py``), serialises it to JSON bytes and swaps
them into ``latest`` in one assignment. Handlers on the event loop only read
that attribute: they never touch the engine, never wait for a step, and a
step never waits for a reader::

    engine thread:  step | publish? | step | step | publish? | ...
                              |                        |
                              v                        v
    latest:         (id 7, b'{...}')  --------->  (id 8, b'{...}')   <- /kv/state, /kv/events read it

A snapshot is also published, past the rate limit, when the engine goes
idle, so the page never keeps showing blocks that were freed by the last step.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, NamedTuple

from pagedllm.engine.kv_snapshot import build_kv_snapshot

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

# at most this many snapshots a second: the page is for eyes, not for profiling
DEFAULT_MIN_INTERVAL_S = 0.25


class PublishedSnapshot(NamedTuple):
    """One published snapshot: its number (1, 2, ...) and its JSON body (``snapshot_id`` inside)."""

    snapshot_id: int
    body: bytes


class KVSnapshotPublisher:
    """Builds KV snapshots on the engine thread, rate-limited, for readers on other threads.

    Args:
        min_interval: least seconds between two snapshots while the engine works.
    """

    def __init__(self, min_interval: float = DEFAULT_MIN_INTERVAL_S) -> None:
        if min_interval < 0:
            raise ValueError(f"min_interval must be >= 0, got {min_interval}")
        self.min_interval = min_interval
        self.latest: PublishedSnapshot | None = None
        self.num_published = 0
        self._last = float("-inf")
        self._dirty = True
        self.failed = False  # a snapshot raised: the page stops updating, serving goes on

    def maybe_publish(self, engine: LLMEngine) -> bool:
        """Publish a new snapshot if ``min_interval`` passed or the engine just went idle.

        Call only from the thread that steps ``engine``. Returns whether it
        published. A snapshot that raises is logged once and publishing
        stops: a bug in the page must not stop the engine thread.
        """
        if self.failed:
            return False
        now = time.monotonic()
        idle = not engine.has_unfinished_requests()
        if now - self._last < self.min_interval and not (idle and self._dirty):
            self._dirty = True
            return False
        if idle and not self._dirty:
            return False  # nothing ran since the idle snapshot
        try:
            self.publish(engine, now)
        except Exception:
            logger.exception("building the /kv snapshot failed; the page stops updating")
            self.failed = True
            return False
        self._dirty = not idle
        return True

    def publish(self, engine: LLMEngine, now: float | None = None) -> PublishedSnapshot:
        """Build and swap in a snapshot now (the engine's thread, or before it starts)."""
        runner = engine.model_runner
        layout = getattr(runner, "kv_layout", None)
        snap = build_kv_snapshot(engine.scheduler, runner.kv_bytes_per_block, runner.kv_cache_bytes,
                                 getattr(runner, "state_bytes_per_slot", 0),
                                 None if layout is None else [g.layers for g in layout.groups])
        snapshot_id = self.num_published + 1
        snap = {"snapshot_id": snapshot_id, "time": time.time(), **snap}
        published = PublishedSnapshot(snapshot_id, json.dumps(snap, separators=(",", ":")).encode())
        self.latest = published  # one reference swap: readers see the old or the new, whole
        self.num_published = snapshot_id
        self._last = time.monotonic() if now is None else now
        return published
