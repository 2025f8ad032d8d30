"""A hybrid model's disk hits in the block manager (no torch): states on disk beside the K/V blocks.

Exact counts on tiny pools, from the rules (the block manager's docstring,
docs/hybrid-models.md): a state snapshot confirmed by its step is handed out
for the state store (``take_state_saves``), keyed by the hash of the block it
follows; a lookup counts RAM and disk blocks and is cut to the longest prefix
whose last block has a state in RAM or on disk; the state file is read and
checked at admission and handed to the runner for the sequence's slot
(``take_state_loads``); a bad one shortens the hit to the next state back.
The stores are real ``DiskBlockStore``s on a temporary folder.
"""

from __future__ import annotations

from pathlib import Path

from pagedllm.engine.block_manager import BlockManager, extend_block_hashes
from pagedllm.engine.sequence import Sequence
from pagedllm.kv_disk.store import DiskBlockStore

BS = 4
KV_BYTES = 48
STATE_BYTES = 24
PROMPT = list(range(100, 113))  # 13 tokens: its state is snapshotted after 12 (3 full blocks)


def _stores(root: Path) -> tuple[DiskBlockStore, DiskBlockStore]:
    return (DiskBlockStore(root, {"model": "m"}, KV_BYTES),
            DiskBlockStore(root, {"model": "m", "state": [[3, 2]]}, STATE_BYTES))


def _manager(root: Path) -> tuple[BlockManager, DiskBlockStore, DiskBlockStore]:
    kv, state = _stores(root)
    return BlockManager(32, BS, True, disk=kv, num_state_slots=2, num_snapshot_slots=2, state_disk=state), kv, state


def _chain(ids: list[int], num_blocks: int) -> list[int]:
    return extend_block_hashes([], (ids[i : i + BS] for i in range(0, num_blocks * BS, BS)))


def _write_first_prompt(root: Path) -> None:
    """An engine's bookkeeping for PROMPT computed whole: its 3 blocks and the state after them to disk."""
    bm, kv, state = _manager(root)
    seq = Sequence(PROMPT, BS)
    assert bm.allocate(seq)
    assert seq.state_snapshot_points == [12] and bm.next_snapshot_point(seq) == 12
    bm.cache_full_blocks(seq, 12)
    bm.snapshot_state(seq, 12)
    assert bm.take_state_saves() == []  # nothing until the step has run
    bm.confirm_published()
    saves = bm.take_saves()
    assert sorted(h for _, h, _ in saves) == sorted(_chain(PROMPT, 3))
    states = bm.take_state_saves()
    assert states == [(2, _chain(PROMPT, 3)[-1], tuple(PROMPT[8:12]))]  # snapshot slot 2: after the 2 running
    for block, h, tokens in saves:
        kv.write(h, tokens, bytes([block]) * KV_BYTES)
    for slot, h, tokens in states:
        state.write(h, tokens, bytes([slot]) * STATE_BYTES)
    bm.free(seq)
    kv.close()
    state.close()


def test_a_fresh_manager_hits_the_blocks_and_state_on_disk(tmp_path: Path) -> None:
    _write_first_prompt(tmp_path)
    bm, kv, state = _manager(tmp_path)
    turn = Sequence(PROMPT[:12] + [7, 8, 9, 10, 11], BS)
    assert bm.num_cached_prefix_tokens(turn) == 12 and bm.can_allocate(turn)
    assert bm.allocate(turn)
    assert turn.num_computed_tokens == turn.num_cached_tokens == 12
    assert [len(p) for _, p in bm.take_loads()] == [KV_BYTES] * 3
    assert bm.take_state_loads() == [(turn.state_slot, bytes([2]) * STATE_BYTES)]
    assert bm.take_state_copies() == ([], [])  # no snapshot in RAM to copy from
    assert (kv.num_hits, state.num_hits) == (3, 1)
    assert turn.state_snapshot_points == [16]  # its own last full block, past the hit
    bm.free(turn)
    assert bm.num_free_blocks == bm.num_blocks and bm.state_slots.num_used == 0


def test_the_hit_ends_at_the_last_block_with_a_state(tmp_path: Path) -> None:
    _write_first_prompt(tmp_path)
    kv, state = _stores(tmp_path)
    chain = _chain(PROMPT, 3)
    state.path(chain[2]).unlink()
    bm = BlockManager(32, BS, True, disk=kv, num_state_slots=2, num_snapshot_slots=2, state_disk=state)
    assert bm.num_cached_prefix_tokens(Sequence(PROMPT, BS)) == 0  # K/V on disk, no state at any boundary
    state.write(chain[0], tuple(PROMPT[:4]), b"\x05" * STATE_BYTES)  # a state after the first block only
    state.flush()
    seq = Sequence(PROMPT, BS)
    assert bm.num_cached_prefix_tokens(seq) == 4
    assert bm.allocate(seq) and seq.num_computed_tokens == 4
    assert len(bm.take_loads()) == 1 and bm.take_state_loads() == [(seq.state_slot, b"\x05" * STATE_BYTES)]


def test_a_corrupt_state_file_shortens_the_hit(tmp_path: Path) -> None:
    _write_first_prompt(tmp_path)
    kv, state = _stores(tmp_path)
    chain = _chain(PROMPT, 3)
    state.write(chain[1], tuple(PROMPT[4:8]), b"\x06" * STATE_BYTES)  # a state after 2 blocks too
    state.flush()
    raw = bytearray(state.path(chain[2]).read_bytes())
    raw[-20] ^= 1
    state.path(chain[2]).write_bytes(bytes(raw))
    bm = BlockManager(32, BS, True, disk=kv, num_state_slots=2, num_snapshot_slots=2, state_disk=state)
    seq = Sequence(PROMPT, BS)
    assert bm.num_cached_prefix_tokens(seq) == 12  # the file exists: its contents are checked when read
    assert bm.allocate(seq) and seq.num_computed_tokens == 8
    assert state.num_corrupt == 1 and not state.path(chain[2]).exists()
    assert len(bm.take_loads()) == 2 and bm.take_state_loads() == [(seq.state_slot, b"\x06" * STATE_BYTES)]
    assert kv.num_hits == 2  # the third block's file was not read: no state after it


def test_a_load_into_a_slot_given_back_before_the_step_is_dropped(tmp_path: Path) -> None:
    _write_first_prompt(tmp_path)
    bm, _, _ = _manager(tmp_path)
    seq = Sequence(PROMPT, BS)
    assert bm.allocate(seq) and seq.num_computed_tokens == 12
    bm.free(seq)  # aborted before its first step: the slot's next holder must not get this state
    assert bm.take_state_loads() == []


def test_without_a_state_store_a_hybrid_model_takes_no_disk_hit(tmp_path: Path) -> None:
    _write_first_prompt(tmp_path)
    kv, _ = _stores(tmp_path)
    bm = BlockManager(32, BS, True, disk=kv, num_state_slots=2, num_snapshot_slots=2)
    seq = Sequence(PROMPT, BS)
    assert bm.num_cached_prefix_tokens(seq) == 0
    assert bm.allocate(seq) and seq.num_computed_tokens == 0 and bm.take_loads() == []
