"""Address translation: token position -> physical KV slot.

A sequence's block table maps logical block ``i`` (tokens ``i*B .. i*B+B-1``)
to a physical block id in the pre-allocated cache. The cache is addressed as
one flat array of ``num_blocks * block_size`` slots::

    block_table = [47, 12, 83], block_size = 256
    token 257 -> logical block 257 // 256 = 1 -> physical block 12
              -> slot 12 * 256 + 257 % 256 = 3073

The scheduler never touches tensors; the model runner calls these functions
once per step for every scheduled token and turns the result into the
``slot_mapping`` tensor that the attention code writes K/V through.
"""

from __future__ import annotations


def physical_block(block_table: list[int], block_size: int, position: int) -> int:
    """The physical block that holds the K/V of token ``position``."""
    logical = position // block_size
    if position < 0 or logical >= len(block_table):
        raise ValueError(
            f"position {position} is outside the block table "
            f"({len(block_table)} blocks of {block_size})"
        )
    return block_table[logical]


def slot_for(block_table: list[int], block_size: int, position: int) -> int:
    """Flat cache slot of token ``position``: block_id * block_size + offset."""
    return physical_block(block_table, block_size, position) * block_size + position % block_size


def slot_mapping(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Slots of tokens ``start .. end-1``, walking block by block."""
    if not 0 <= start <= end <= len(block_table) * block_size:
        raise ValueError(
            f"token range [{start}, {end}) does not fit {len(block_table)} blocks of {block_size}"
        )
    slots: list[int] = []
    pos = start
    while pos < end:
        logical, offset = divmod(pos, block_size)
        run = min(block_size - offset, end - pos)
        base = block_table[logical] * block_size + offset
        slots.extend(range(base, base + run))
        pos += run
    return slots
