"""The state slots of a hybrid model: one per running sequence, owned by the block manager.

A hybrid model's state layers (Gated DeltaNet, short conv, Mamba-2:
docs/hybrid-models.md) keep a fixed-size state per sequence rather than K/V
per token. The runner allocates, per state layer, tensors of
``[num_slots, *state_shape]`` once; this class decides which running
sequence owns which slot. Torch-free, like the rest of the bookkeeping::

    free (a heap: lowest id first)   held
    [ 2, 5, 6 ]                      seq 7 -> 0, seq 9 -> 1, seq 12 -> 3, seq 13 -> 4

Lowest id first keeps the slots in use packed at the start of the tensors,
so only their pages are resident (the tensors are lazily backed, as the KV
pool). A slot's contents need no clearing when it changes hands: a sequence
that computes from position 0 starts from a zero state
(``has_initial_state`` False in the step's metadata).
"""

from __future__ import annotations

import heapq


class StateSlots:
    """A fixed pool of ``num_slots`` state slots, handed out lowest id first.

    Args:
        num_slots: slots in the pool, >= 1.
        first_slot: the pool's lowest slot id (the state tensors hold other pools before it: the running
            slots, then the snapshots, then the speculative decoding checkpoints), >= 0.
    """

    def __init__(self, num_slots: int, first_slot: int = 0) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if first_slot < 0:
            raise ValueError(f"first_slot must be >= 0, got {first_slot}")
        self.num_slots = num_slots
        self.first_slot = first_slot
        self._free: list[int] = list(range(first_slot, first_slot + num_slots))  # already a heap
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        """Slots no sequence holds."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Slots held by sequences."""
        return len(self._held)

    def take(self) -> int:
        """The lowest free slot, now held; ValueError when none is free (``num_free`` says so first)."""
        if not self._free:
            raise ValueError(f"all {self.num_slots} state slots are held")
        slot = heapq.heappop(self._free)
        self._held.add(slot)
        return slot

    def give_back(self, slot: int) -> None:
        """Return a held slot to the pool; ValueError for a slot not held (a double free)."""
        if slot not in self._held:
            raise ValueError(f"state slot {slot} is not held")
        self._held.remove(slot)
        heapq.heappush(self._free, slot)

    @property
    def held_slots(self) -> list[int]:
        """The held slots, lowest id first (the /kv page lists who holds each)."""
        return sorted(self._held)

    @property
    def free_slots(self) -> list[int]:
        """The free slots in the order they would be handed out."""
        return sorted(self._free)
