"""The KV snapshot (``/kv/state``) of a windowed and of a hybrid model's pool: every cache group, the state slots,
the snapshots and the checkpoints, with exact ids (no torch).

Expectations are worked out by hand from the rules of docs/design/kv-cache-groups.md and
docs/hybrid-models.md: a new logical block takes one block in every group (group 0's first, lowest id
first); a window group of ``W`` gives back, before a step, each block whose keys all lie before
``num_computed_tokens - W + 1``; a hybrid model's sequence holds one state slot (ids 0..), snapshots
come after the running slots and checkpoints after the snapshots.
"""

from __future__ import annotations

import json

from pagedllm.engine.block_manager import HOLE, BlockManager
from pagedllm.engine.kv_snapshot import build_kv_snapshot
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence, SequenceStatus
from pagedllm.kv_groups import kv_cache_layout

BS = 4
W = 8


def run_step(sched: Scheduler) -> None:
    """Plan and 'run' one step: the scheduled tokens are computed, their snapshots written."""
    out = sched.schedule()
    sched.block_manager.confirm_published()
    sched.update(out)


def gemma3_like() -> tuple[BlockManager, list[tuple[int, ...]]]:
    """Gemma 3's tiny test pattern (tests/conftest.py): window, full, window, window, full; a window of 8."""
    layout = kv_cache_layout([W, None, W, W, None])
    return BlockManager(16, BS, group_windows=layout.windows), [g.layers for g in layout.groups]


def test_a_window_model_shows_every_group_its_blocks_and_its_holes() -> None:
    bm, layers = gemma3_like()
    # 2 full layers: 2 rows a block; the 3 window layers make 2 groups, the last with a padded row
    assert layers == [(1, 4), (0, 2), (3,)] and bm.group_windows == (None, W, W)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    seq = Sequence(list(range(18)), BS, request_id="w18")
    sched.add(seq)
    run_step(sched)  # the whole prompt: 5 logical blocks in each of the 3 groups
    seq.append_token(99)
    snap = build_kv_snapshot(sched, group_layers=layers)
    assert snap["block_groups"] == [0] * 5 + [1] * 5 + [2] * 5 + [-1]
    s = snap["requests"][0]["sequences"][0]
    assert s["block_table"] == [0, 1, 2, 3, 4] and s["group_tables"] == [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]
    assert [(g["kind"], g["window"], g["layers"], g["used_blocks"], g["hole_entries"]) for g in snap["kv_groups"]] == [
        ("full", None, [1, 4], 5, 0), ("window", W, [0, 2], 5, 0), ("window", W, [3], 5, 0)]
    # the decode of token 18 reads keys 11..18: blocks 0 and 1 (keys 0..7) leave both windows
    run_step(sched)
    snap = build_kv_snapshot(sched, group_layers=layers)
    s = snap["requests"][0]["sequences"][0]
    assert s["group_tables"] == [[HOLE, HOLE, 7, 8, 9], [HOLE, HOLE, 12, 13, 14]]
    # the prompt's 4 full blocks were published: the 2 given back per window group stay cached
    assert [(g["used_blocks"], g["shared_blocks"], g["cached_blocks"], g["hole_entries"], g["released_blocks"])
            for g in snap["kv_groups"]] == [(5, 0, 0, 0, 0), (3, 0, 2, 2, 2), (3, 0, 2, 2, 2)]
    assert snap["block_states"] == "hhhhh" + "cchhh" + "cchhh" + "f"
    assert snap["block_groups"] == [0] * 5 + [1] * 5 + [2] * 5 + [-1]
    c = snap["counters"]
    assert (c["used_blocks"], c["cached_blocks"], c["free_blocks"], c["window_released_blocks"]) == (11, 4, 1, 4)
    assert snap["state"] is None
    # finished: its blocks go back; the full blocks keep their groups as cached prefixes, the partial ones free
    sched.finish(seq, SequenceStatus.FINISHED_STOPPED)
    snap = build_kv_snapshot(sched, group_layers=layers)
    assert [(g["used_blocks"], g["cached_blocks"], g["hole_entries"]) for g in snap["kv_groups"]] == [
        (0, 4, 0), (0, 4, 0), (0, 4, 0)]
    assert snap["block_groups"] == [0] * 4 + [-1] + [1] * 4 + [-1] + [2] * 4 + [-1, -1]


def test_a_one_group_model_has_one_full_group_of_every_block() -> None:
    bm = BlockManager(8, BS)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    sched.add(Sequence(list(range(6)), BS, request_id="one"))
    run_step(sched)
    snap = build_kv_snapshot(sched)
    assert snap["block_groups"] == [0, 0] + [-1] * 6
    assert snap["kv_groups"] == [{"group": 0, "kind": "full", "window": None, "layers": [], "used_blocks": 2,
                                  "shared_blocks": 0, "cached_blocks": 0, "hole_entries": 0, "released_blocks": 0}]


def test_a_hybrid_model_shows_its_state_slots_snapshots_and_checkpoints() -> None:
    # slots: 0-1 running, 2-3 snapshots, 4-5 checkpoints
    bm = BlockManager(32, BS, num_state_slots=2, num_snapshot_slots=2, num_checkpoint_slots=2)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    a = Sequence(list(range(10)), BS, request_id="a")
    sched.add(a)
    run_step(sched)  # a's chunk ends at its snapshot point, 8 tokens: the state after blocks 0, 1 into slot 2
    assert a.num_computed_tokens == 8
    b = Sequence(list(range(8)) + [50, 51, 52], BS, request_id="b")
    sched.add(b)
    run_step(sched)  # b hits a's 8 tokens, its state copied from snapshot slot 2 into its own slot 1
    assert b.num_cached_tokens == 8
    snap = build_kv_snapshot(sched, state_bytes_per_slot=1000)
    st = snap["state"]
    assert (st["num_slots"], st["used_slots"], st["free_slots"], st["bytes_per_slot"]) == (2, 2, 0, 1000)
    assert st["slot_holders"] == [{"slot": 0, "seq_id": a.seq_id, "request_id": "a"},
                                  {"slot": 1, "seq_id": b.seq_id, "request_id": "b"}]
    assert (st["num_snapshot_slots"], st["snapshots"], st["snapshots_taken"], st["snapshot_bytes"]) == (2, 1, 1, 1000)
    assert st["snapshot_lru"] == [2]
    assert (st["num_checkpoint_slots"], st["used_checkpoint_slots"], st["checkpoints"]) == (2, 0, [])
    seqs = {s["seq_id"]: s for r in snap["requests"] for s in r["sequences"]}
    assert (seqs[a.seq_id]["state_slot"], seqs[b.seq_id]["state_slot"]) == (0, 1)
    # a verify step of a's decode: its state after its 10 tokens checkpointed into the first checkpoint slot
    a.append_token(7)
    bm.checkpoint_state(a)
    snap = build_kv_snapshot(sched, state_bytes_per_slot=1000)
    assert snap["state"]["checkpoints"] == [{"slot": 4, "seq_id": a.seq_id, "num_tokens": 10}]
    assert snap["state"]["used_checkpoint_slots"] == 1
    seqs = {s["seq_id"]: s for r in snap["requests"] for s in r["sequences"]}
    assert seqs[a.seq_id]["state_checkpoint"] == {"slot": 4, "num_tokens": 10}
    assert seqs[b.seq_id]["state_checkpoint"] is None
    # one group, full attention: a's 3 blocks and b's one past the 2 it shares with a; state slots hold none
    assert [(g["kind"], g["used_blocks"], g["shared_blocks"]) for g in snap["kv_groups"]] == [("full", 3 + 1, 2)]
    assert json.loads(json.dumps(snap)) == snap


def test_a_model_without_state_has_no_state_object() -> None:
    sched = Scheduler(BlockManager(4, BS), max_num_seqs=1, max_num_batched_tokens=16)
    assert build_kv_snapshot(sched)["state"] is None
