"""Address translation: token position -> physical KV slot.

A sequence's block table maps logical block ``i`` (tokens ``i*B .. i*B+B-1``)
to a physical block id in the pre-allocated cache. The cache is addressed as
one flat array of ``num_blocks * block_size`` slots::

    block_table = [47, 12, 83], block_size = 256
    token 257 -> logical block 257 // 256 = 1 -> physical block 12
              -> slot 12 * 256 + 257 % 256 = 3073

The scheduler never touches tensors; once per step the model runner
(``runner/input_batch.py``) maps every scheduled token at once with
``batch_slot_mapping`` (numpy) and hands the result to the attention code as
the ``slot_mapping`` tensor it writes K/V through.
"""

from __future__ import annotations

import numpy as np


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


def batch_slot_mapping(
    block_tables: np.ndarray, seq_index: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """Slots of many tokens at once, the formula of ``slot_for`` in numpy.

    Token ``j`` sits at ``positions[j]`` of sequence ``seq_index[j]``, whose
    block table is row ``seq_index[j]`` of ``block_tables`` ``[num_seqs,
    max_blocks]`` (int64, padded). Callers check that each position lies
    within its sequence's table; numpy's indexing refuses a row or column
    outside the array.
    """
    return block_tables[seq_index, positions // block_size] * block_size + positions % block_size


def slot_mapping(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Slots of tokens ``start .. end-1`` of one sequence."""
    if not 0 <= start <= end <= len(block_table) * block_size:
        raise ValueError(
            f"token range [{start}, {end}) does not fit {len(block_table)} blocks of {block_size}"
        )
    if start == end:
        return []
    positions = np.arange(start, end, dtype=np.int64)
    table = np.asarray([block_table], dtype=np.int64)
    return batch_slot_mapping(table, np.zeros_like(positions), positions, block_size).tolist()
