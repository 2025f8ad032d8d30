"""A picture of the KV block pool as plain data: who holds which block, and what is wasted.

Built from the scheduler and its block manager (no torch, no engine), for
the server's live ``/kv`` page and its ``/kv/state`` JSON (the page maps a
token to its slot as ``block_table.slot_for`` does)::

    block_states  "hhsscff..."   one letter per physical block:
                                 f free, c free but holding a cached prefix,
                                 h held by one sequence, s shared (ref count > 1)
    ref_counts    [1, 1, 3, 3, 0, 0, ...]
    requests      [{id, status, sequences: [{block_table, num_tokens, ...}]}]
    counters      used / cached / free blocks, hit rate, preemptions, copies, waste
    memory        bytes per block, the pool's reserved bytes, its resident blocks and bytes
    state         a hybrid model's state slots (used / total) and prefix snapshots (kept / slots, taken so
                  far); null for a model without state layers (docs/hybrid-models.md)

Waste is what the chapter counts against paging: slots held but not yet
written. Between steps a sequence's K/V fills every slot of its blocks but
the tail of its last one, so that tail is all there is. A shared block is
counted once, filled as far as its furthest holder computed.
"""

from __future__ import annotations

from typing import Any

from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence, SequenceStatus

FREE, CACHED, HELD, SHARED = "f", "c", "h", "s"
# the one-letter codes of ``block_states``, for the page's legend and the JSON's readers
STATE_NAMES = {FREE: "free", CACHED: "cached", HELD: "held", SHARED: "shared"}


def block_states(bm: BlockManager) -> str:
    """One letter per physical block: f free, c cached prefix (ref 0), h held (ref 1), s shared (ref > 1)."""
    out = []
    for ref, h in zip(bm.ref_counts, bm.block_hash):
        if ref == 0:
            out.append(FREE if h is None else CACHED)
        else:
            out.append(HELD if ref == 1 else SHARED)
    return "".join(out)


def written_slots(seqs: list[Sequence], block_size: int) -> dict[int, int]:
    """Physical block -> slots written in it (K/V computed), the furthest holder's count."""
    written: dict[int, int] = {}
    for seq in seqs:
        for i, block in enumerate(seq.block_table):
            filled = min(block_size, max(0, seq.num_computed_tokens - i * block_size))
            if filled > written.get(block, -1):
                written[block] = filled
    return written


# fill_levels: a free block, else how many of its slots are written, as one base-36 digit
FREE_FILL = "."


def fill_levels(ref_counts: list[int], block_size: int, seqs: list[Sequence]) -> str:
    """One character per block: ``.`` free, else its written slots in base 36 (``0`` reserved, empty).

    Works on any pool with reference counts (the block manager, the
    contiguous allocator); the memory report replays these over time.
    """
    if block_size > 35:
        raise ValueError(f"fill levels are one base-36 digit: block_size must be <= 35, got {block_size}")
    written = written_slots([s for s in seqs if s.block_table], block_size)
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    return "".join(
        FREE_FILL if ref == 0 else digits[written.get(b, block_size)] for b, ref in enumerate(ref_counts)
    )


def _request_status(seqs: list[Sequence]) -> str:
    if any(s.status == SequenceStatus.RUNNING for s in seqs):
        return "running"
    # a preempted sequence waits again from scratch: its blocks were freed
    return "preempted" if any(s.num_preemptions for s in seqs) else "waiting"


def _sequence(seq: Sequence) -> dict[str, Any]:
    return {
        "seq_id": seq.seq_id,
        "index": seq.index,
        "status": seq.status.value,
        "num_tokens": len(seq),
        "num_prompt_tokens": seq.num_prompt_tokens,
        "num_computed_tokens": seq.num_computed_tokens,
        "num_cached_tokens": seq.num_cached_tokens,
        "num_preemptions": seq.num_preemptions,
        "block_table": list(seq.block_table),
    }


def _requests(scheduler: Scheduler) -> list[dict[str, Any]]:
    """Running requests first (oldest first), then the waiting queue in its order."""
    groups: dict[str, list[Sequence]] = {}
    running = sorted(scheduler.running, key=lambda s: (s.arrival, s.seq_id))
    for seq in [*running, *scheduler.waiting]:
        groups.setdefault(seq.request_id, []).append(seq)
    return [
        {"id": rid, "status": _request_status(seqs), "sequences": [_sequence(s) for s in seqs]}
        for rid, seqs in groups.items()
    ]


def kv_memory(bm: BlockManager, bytes_per_block: int, reserved_bytes: int) -> dict[str, int]:
    """The pool's bytes: reserved (address space) and resident (blocks written and not given back).

    Resident is the bookkeeping's count, as ``/metrics`` reports it: blocks
    handed out since their pages were last given back to the OS
    (``BlockManager.num_touched_blocks``), an upper bound on what the OS holds.
    An allocator that keeps no such count gives its held blocks.
    """
    resident_blocks = getattr(bm, "num_touched_blocks", bm.num_used_blocks)
    return {
        "bytes_per_block": bytes_per_block,
        "reserved_bytes": reserved_bytes,
        "resident_blocks": resident_blocks,
        "resident_bytes": resident_blocks * bytes_per_block,
    }


def state_counters(bm: BlockManager) -> dict[str, int] | None:
    """A hybrid model's state slots and snapshots (``engine/state_slots.py``, ``state_snapshots.py``); None
    without state layers."""
    slots = getattr(bm, "state_slots", None)
    if slots is None:
        return None
    snapshots = bm.snapshots
    return {
        "num_slots": slots.num_slots,
        "used_slots": slots.num_used,
        "num_snapshot_slots": 0 if snapshots is None else snapshots.num_slots,
        "snapshots": 0 if snapshots is None else len(snapshots),
        "snapshots_taken": 0 if snapshots is None else snapshots.num_taken,
    }


def build_kv_snapshot(
    scheduler: Scheduler, bytes_per_block: int | None = None, reserved_bytes: int | None = None
) -> dict[str, Any]:
    """The pool, the requests in the scheduler's queues and the counters, as JSON-ready data.

    Call it between steps, on the thread that owns the scheduler: it reads
    live lists and copies what it keeps. ``bytes_per_block`` and
    ``reserved_bytes`` (the model runner's) fill ``memory``; without them it is None.
    """
    bm = scheduler.block_manager
    states = block_states(bm)
    held_seqs = [s for s in scheduler.running if s.block_table]
    written = written_slots(held_seqs, bm.block_size)
    held_blocks = [b for b, ref in enumerate(bm.ref_counts) if ref > 0]
    # a held block no queued sequence lists (a beam between its forks) counts as written
    waste = sum(bm.block_size - written.get(b, bm.block_size) for b in held_blocks)
    queries, hits = bm.num_prefix_queries, bm.num_prefix_hits
    return {
        "num_blocks": bm.num_blocks,
        "block_size": bm.block_size,
        "block_states": states,
        "ref_counts": list(bm.ref_counts),
        "requests": _requests(scheduler),
        "counters": {
            "used_blocks": len(held_blocks),
            "cached_blocks": states.count(CACHED),
            "free_blocks": states.count(FREE),
            "shared_blocks": states.count(SHARED),
            "held_slots": len(held_blocks) * bm.block_size,
            "waste_slots": waste,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else None,
            "preemptions": scheduler.num_preemptions,
            "cow_copies": bm.num_cow_copies,
            "num_running_seqs": len(scheduler.running),
            "num_waiting_seqs": len(scheduler.waiting),
        },
        "memory": None if bytes_per_block is None else kv_memory(bm, bytes_per_block, reserved_bytes or 0),
        "state": state_counters(bm),
    }
