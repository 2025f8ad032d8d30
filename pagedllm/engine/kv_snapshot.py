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
    block_groups  [0, 0, 1, -1, ...] the KV cache group a held or cached block belongs to, -1 free
    kv_groups     per group: its kind (full / window W), layers, blocks held / shared / cached, the holes
                  in its tables and the blocks it gave back (kv_groups.py)
    state         a hybrid model's state slots (used / free / total, which sequence holds which), prefix
                  snapshots (kept / slots, bytes, least recently used first) and speculative decoding's
                  checkpoint slots; null for a model without state layers (docs/hybrid-models.md)

Waste is what the chapter counts against paging: slots held but not yet
written. Between steps a sequence's K/V fills every slot of its blocks but
the tail of its last one, so that tail is all there is. A shared block is
counted once, filled as far as its furthest holder computed.
"""

from __future__ import annotations

from typing import Any

from pagedllm.engine.block_manager import HOLE, BlockManager
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
        for table in (seq.block_table, *seq.group_tables):  # every KV cache group's
            for i, block in enumerate(table):
                filled = min(block_size, max(0, seq.num_computed_tokens - i * block_size))
                if block != HOLE and filled > written.get(block, -1):
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


def block_groups(bm: BlockManager, states: str) -> list[int]:
    """Per physical block, the KV cache group it is held by or cached for; -1 for a block holding nothing.

    A block belongs to the group it was last handed out to (``BlockManager.block_group``): a cached block
    keeps it, as its prefix-cache key is salted with the group. An allocator without groups: group 0.
    """
    owner = getattr(bm, "block_group", None)
    return [-1 if st == FREE else (0 if owner is None else owner[b]) for b, st in enumerate(states)]


def kv_group_rows(
    bm: BlockManager, states: str, groups: list[int], seqs: list[Sequence],
    layers: list[tuple[int, ...]] | None = None,
) -> list[dict[str, Any]]:
    """Each KV cache group: kind, window, layers, blocks held / shared / cached, holes, blocks given back.

    ``groups`` is ``block_groups``'s list; ``seqs`` the queued sequences (their holes are counted);
    ``layers`` each group's model layers (the runner's ``KVCacheLayout``), [] where unknown.
    """
    windows = getattr(bm, "group_windows", (None,))
    released = getattr(bm, "window_released_per_group", [0] * len(windows))
    rows = []
    for g, window in enumerate(windows):
        mine = [st for st, owner in zip(states, groups) if owner == g]
        rows.append({
            "group": g,
            "kind": "full" if window is None else "window",
            "window": window,
            "layers": list(layers[g]) if layers is not None else [],
            "used_blocks": mine.count(HELD) + mine.count(SHARED),
            "shared_blocks": mine.count(SHARED),
            "cached_blocks": mine.count(CACHED),
            "hole_entries": sum(t.count(HOLE) for s in seqs for t in _tables(s)[g : g + 1]),
            "released_blocks": released[g],
        })
    return rows


def _tables(seq: Sequence) -> list[list[int]]:
    """Every KV cache group's table of ``seq``, group 0 first."""
    return [seq.block_table, *seq.group_tables]


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
        "group_tables": [list(t) for t in seq.group_tables],
        "state_slot": seq.state_slot,
        "state_checkpoint": None if seq.state_checkpoint is None else
        {"slot": seq.state_checkpoint[0], "num_tokens": seq.state_checkpoint[1]},
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


def state_counters(bm: BlockManager, seqs: list[Sequence], bytes_per_slot: int = 0) -> dict[str, Any] | None:
    """A hybrid model's state slots, snapshots and checkpoints (``engine/state_slots.py``,
    ``state_snapshots.py``); None without state layers. ``seqs``: the queued sequences (who holds which
    slot); ``bytes_per_slot``: one sequence's state over all state layers (the runner's), 0 where unknown."""
    slots = getattr(bm, "state_slots", None)
    if slots is None:
        return None
    holders = {s.state_slot: s for s in seqs if s.state_slot is not None}
    snapshots, checkpoints = bm.snapshots, bm.checkpoints
    num_snapshots = 0 if snapshots is None else len(snapshots)
    return {
        "bytes_per_slot": bytes_per_slot,
        "num_slots": slots.num_slots,
        "used_slots": slots.num_used,
        "free_slots": slots.num_free,
        "slot_holders": [
            {"slot": slot, "seq_id": holders[slot].seq_id if slot in holders else None,
             "request_id": holders[slot].request_id if slot in holders else None}
            for slot in slots.held_slots
        ],
        "num_snapshot_slots": 0 if snapshots is None else snapshots.num_slots,
        "snapshots": num_snapshots,
        "snapshots_taken": 0 if snapshots is None else snapshots.num_taken,
        "snapshot_bytes": num_snapshots * bytes_per_slot,
        "snapshot_lru": [] if snapshots is None else snapshots.lru_slots,
        "num_checkpoint_slots": 0 if checkpoints is None else checkpoints.num_slots,
        "used_checkpoint_slots": 0 if checkpoints is None else checkpoints.num_used,
        "checkpoints": [
            {"slot": s.state_checkpoint[0], "seq_id": s.seq_id, "num_tokens": s.state_checkpoint[1]}
            for s in sorted(seqs, key=lambda s: s.state_checkpoint[0] if s.state_checkpoint else -1)
            if s.state_checkpoint is not None
        ],
    }


def build_kv_snapshot(
    scheduler: Scheduler, bytes_per_block: int | None = None, reserved_bytes: int | None = None,
    state_bytes_per_slot: int = 0, group_layers: list[tuple[int, ...]] | None = None,
) -> dict[str, Any]:
    """The pool, the requests in the scheduler's queues and the counters, as JSON-ready data.

    Call it between steps, on the thread that owns the scheduler: it reads
    live lists and copies what it keeps. ``bytes_per_block`` and
    ``reserved_bytes`` (the model runner's) fill ``memory``; without them it is None.
    ``state_bytes_per_slot`` (a hybrid model's, the runner's) sizes the state slots and snapshots;
    ``group_layers`` (the runner's ``KVCacheLayout``) names each KV cache group's layers.
    """
    bm = scheduler.block_manager
    states = block_states(bm)
    owners = block_groups(bm, states)
    queued = [*scheduler.running, *scheduler.waiting]
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
            "window_released_blocks": getattr(bm, "num_window_released", 0),
        },
        "block_groups": owners,
        "kv_groups": kv_group_rows(bm, states, owners, queued, group_layers),
        "memory": None if bytes_per_block is None else kv_memory(bm, bytes_per_block, reserved_bytes or 0),
        "state": state_counters(bm, queued, state_bytes_per_slot),
    }
