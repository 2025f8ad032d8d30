"""A hybrid model's state slot as bytes and back: what the prefix cache on disk stores beside the K/V blocks.

A slot's bytes are every state layer's tensors at that slot, in layer order
and in each layer's ``state_shapes()`` order, float32 as the runner holds
them (``runner/state_cache.py``)::

    states   per state layer: (conv_state [num_slots, ...], recurrent_state [num_slots, ...], ...)
    slot s   conv_state[s] | recurrent_state[s] | ... of layer 0 | ... of the next state layer  ->  bytes

The layout is the state shapes', which the state store's fingerprint holds
(``kv_disk/open_store.py``), so a file of another layout is never read.
"""

from __future__ import annotations

import warnings

import torch


def _slot_tensors(states: list[tuple[torch.Tensor, ...] | None]) -> list[torch.Tensor]:
    """Every state tensor, in the order a slot's bytes hold them."""
    return [t for layer in states for t in layer or ()]


def state_slot_nbytes(states: list[tuple[torch.Tensor, ...] | None]) -> int:
    """Bytes of one slot across every state tensor."""
    return sum(t[0].numel() * t.element_size() for t in _slot_tensors(states))


def read_state_bytes(states: list[tuple[torch.Tensor, ...] | None], slots: list[int]) -> list[bytes]:
    """The bytes of each slot in ``slots``, copied out (the slots may be reused after)."""
    tensors = _slot_tensors(states)
    out: list[bytes] = []
    for slot in slots:
        parts = [t[slot].contiguous().cpu().view(torch.uint8).reshape(-1) for t in tensors]
        out.append(torch.cat(parts).numpy().tobytes())
    return out


def write_state_bytes(states: list[tuple[torch.Tensor, ...] | None], loads: list[tuple[int, bytes]]) -> None:
    """Write each ``(slot, bytes)`` of ``loads`` into the state tensors (ValueError for bytes of another size)."""
    if not loads:
        return
    tensors = _slot_tensors(states)
    size = state_slot_nbytes(states)
    for slot, data in loads:
        if len(data) != size:
            raise ValueError(f"state slot {slot}: {len(data)} bytes, a slot of these state layers has {size}")
    for slot, data in loads:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only bytes: only read here
            src = torch.frombuffer(data, dtype=torch.uint8)
        offset = 0
        for t in tensors:
            n = t[0].numel() * t.element_size()
            t[slot].copy_(src[offset : offset + n].view(t.dtype).view(t.shape[1:]))
            offset += n
