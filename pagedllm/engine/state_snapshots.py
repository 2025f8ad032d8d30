"""State snapshots of cached prefixes: a hybrid model's prefix hits need the state at the hit point.

A prefix hit reuses the K/V of cached blocks, but a state layer's state
after those tokens is not in any block: it is in the slot of the sequence
that computed them, which moves on. So the block manager keeps copies of a
slot's state at block boundaries of cached prompts, each held under the hash
of the block it ends with::

    snapshot slots [S0 S1 S2]  (after the running sequences' slots, in the same state tensors)
    hash(h(A, B)) -> S1        the state after blocks A, B of some prompt

A hit is cut to the longest cached prefix whose last block has a snapshot;
the hit's state is copied from the snapshot into the sequence's own slot
before its first step. The pool is bounded (its slots are the bytes the
runner sized for them); a full pool drops its least recently used snapshot,
and a snapshot goes when its block leaves the prefix cache (evicted or
reset). A snapshot is taken after the step that computes it (a copy the
runner makes after the step) and is found by lookups only once that step has
run (``confirm``), as a block's K/V.

With the prefix cache on disk, each snapshot is written beside its block's
K/V file once its step has run (keyed by the same hash), and a lookup past
RAM reads a state file back into the sequence's slot
(``engine/block_manager.py``, docs/hybrid-models.md).

Torch-free: it hands out slot ids; the runner copies the data.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    """``num_slots`` snapshot slots, ids ``first_slot .. first_slot + num_slots - 1``, keyed by block hash."""

    def __init__(self, first_slot: int, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.first_slot = first_slot
        self.num_slots = num_slots
        self._free: list[int] = list(range(first_slot + num_slots - 1, first_slot - 1, -1))  # pop: lowest first
        self._ready: OrderedDict[int, int] = OrderedDict()  # hash -> slot, least recently used first
        self._unconfirmed: dict[int, int] = {}  # hash -> slot, written by the step being planned
        self.num_taken = 0  # snapshots taken so far (statistics)

    def __len__(self) -> int:
        return len(self._ready) + len(self._unconfirmed)

    @property
    def lru_slots(self) -> list[int]:
        """The slots of the ready snapshots, least recently used (the next one dropped) first."""
        return list(self._ready.values())

    @property
    def num_unconfirmed(self) -> int:
        """Snapshots taken for the step being planned, not yet found by lookups."""
        return len(self._unconfirmed)

    def find(self, block_hash: int) -> int | None:
        """The slot of a ready snapshot under ``block_hash`` (marked recently used), else None."""
        slot = self._ready.get(block_hash)
        if slot is not None:
            self._ready.move_to_end(block_hash)
        return slot

    def has(self, block_hash: int) -> bool:
        """Whether a ready snapshot sits under ``block_hash`` (its use order unchanged)."""
        return block_hash in self._ready

    def take(self, block_hash: int) -> int | None:
        """A slot for a new snapshot under ``block_hash`` (the least recently used one dropped if none is free);
        None when one is kept or being taken already."""
        if block_hash in self._ready or block_hash in self._unconfirmed:
            return None
        if not self._free:
            if not self._ready:
                return None  # every slot waits for the step being planned
            _, slot = self._ready.popitem(last=False)
            self._free.append(slot)
        slot = self._free.pop()
        self._unconfirmed[block_hash] = slot
        self.num_taken += 1
        return slot

    def confirm(self) -> list[tuple[int, int]]:
        """The step planned with the snapshots taken since the last call has run: lookups find them.
        Returns their (hash, slot) pairs (the prefix cache on disk writes them)."""
        confirmed = list(self._unconfirmed.items())
        self._ready.update(self._unconfirmed)
        self._unconfirmed.clear()
        return confirmed

    def drop_unconfirmed(self) -> None:
        """The step failed: its snapshots were never written."""
        self._free.extend(self._unconfirmed.values())
        self._unconfirmed.clear()

    def drop(self, block_hash: int) -> None:
        """Forget the snapshot under ``block_hash`` (its block left the prefix cache), if any."""
        slot = self._ready.pop(block_hash, None)
        if slot is None:
            slot = self._unconfirmed.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def clear(self) -> None:
        """Forget every snapshot (the prefix cache was reset)."""
        self._free.extend(self._ready.values())
        self._ready.clear()
        self.drop_unconfirmed()
