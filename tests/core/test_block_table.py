"""Address translation: token position -> physical block -> flat KV slot.

Expected values come from the design (seed ch.04): logical block of token p is
``p // block_size``, the block table maps it to a physical block, and the slot
is ``physical_block * block_size + p % block_size``.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.block_table import physical_block, slot_for, slot_mapping
from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.sequence import Sequence

SEED_TABLE = [47, 12, 83]
SEED_BS = 256


# --- the seed's worked examples ----------------------------------------------
def test_seed_token_257_maps_to_slot_3073():
    # logical block 257 // 256 = 1 -> physical block 12, offset 1 -> 12*256 + 1
    assert physical_block(SEED_TABLE, SEED_BS, 257) == 12
    assert slot_for(SEED_TABLE, SEED_BS, 257) == 3073


def test_seed_token_300_lives_in_block_12():
    # quiz question 1: floor(300 / 256) = 1 -> block_table[1] = 12
    assert physical_block(SEED_TABLE, SEED_BS, 300) == 12
    assert slot_for(SEED_TABLE, SEED_BS, 300) == 12 * 256 + 44


@pytest.mark.parametrize(
    ("position", "block", "slot"),
    [
        (0, 47, 47 * 256),  # first token of logical block 0
        (255, 47, 47 * 256 + 255),  # last token of logical block 0
        (256, 12, 12 * 256),  # first token of logical block 1
        (511, 12, 12 * 256 + 255),
        (512, 83, 83 * 256),
        (767, 83, 83 * 256 + 255),  # last slot the table can address
    ],
)
def test_seed_table_block_boundaries(position, block, slot):
    assert physical_block(SEED_TABLE, SEED_BS, position) == block
    assert slot_for(SEED_TABLE, SEED_BS, position) == slot


def test_seed_600_tokens_take_3_blocks_of_256():
    seq = Sequence(list(range(600)), block_size=256)
    assert seq.num_blocks == 3  # ceil(600 / 256)
    assert seq.num_full_blocks == 2  # tokens 512..599 only partly fill block 2
    bm = BlockManager(num_blocks=512, block_size=256)
    assert bm.allocate(seq) is True
    assert len(seq.block_table) == 3
    assert len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 512 - 3
    # the last token (599) sits in the third, partly filled block; 600 does not exist yet
    assert physical_block(seq.block_table, 256, 599) == seq.block_table[2]
    assert slot_for(seq.block_table, 256, 599) == seq.block_table[2] * 256 + 87
    with pytest.raises(ValueError):
        physical_block(seq.block_table, 256, 768)


# --- out of range ----------------------------------------------------------------
@pytest.mark.parametrize("position", [-1, -256, 768, 769, 10_000])
def test_out_of_range_positions_raise(position):
    with pytest.raises(ValueError):
        physical_block(SEED_TABLE, SEED_BS, position)
    with pytest.raises(ValueError):
        slot_for(SEED_TABLE, SEED_BS, position)


def test_empty_block_table_has_no_slots():
    with pytest.raises(ValueError):
        physical_block([], 4, 0)
    with pytest.raises(ValueError):
        slot_for([], 4, 0)
    assert slot_mapping([], 4, 0, 0) == []
    with pytest.raises(ValueError):
        slot_mapping([], 4, 0, 1)


# --- slot_mapping ----------------------------------------------------------------
def test_slot_mapping_walks_scattered_blocks():
    table = [5, 2, 7]  # block_size 4: tokens 0-3 -> 5, 4-7 -> 2, 8-11 -> 7
    assert slot_mapping(table, 4, 0, 12) == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29, 30, 31]
    # a range that starts and ends mid-block
    assert slot_mapping(table, 4, 2, 9) == [22, 23, 8, 9, 10, 11, 28]
    # a decode step: one token
    assert slot_mapping(table, 4, 6, 7) == [10]
    assert slot_mapping(table, 4, 5, 5) == []


def test_slot_mapping_seed_decode_and_prefill():
    # prefill of tokens 250..260 crosses from physical block 47 into 12
    expected = [47 * 256 + p for p in range(250, 256)] + [12 * 256 + p for p in range(0, 5)]
    assert slot_mapping(SEED_TABLE, SEED_BS, 250, 261) == expected
    assert slot_mapping(SEED_TABLE, SEED_BS, 257, 258) == [3073]
    assert slot_mapping(SEED_TABLE, SEED_BS, 0, 768)[-1] == 83 * 256 + 255


@pytest.mark.parametrize(("start", "end"), [(-1, 2), (3, 2), (0, 13), (12, 13)])
def test_slot_mapping_bad_ranges_raise(start, end):
    with pytest.raises(ValueError):
        slot_mapping([5, 2, 7], 4, start, end)


def test_slot_mapping_full_capacity_is_allowed():
    assert len(slot_mapping([5, 2, 7], 4, 0, 12)) == 12
    assert slot_mapping([5, 2, 7], 4, 12, 12) == []


# --- Sequence block counting -------------------------------------------------------
@pytest.mark.parametrize(
    ("num_tokens", "blocks", "full"),
    [(0, 0, 0), (1, 1, 0), (255, 1, 0), (256, 1, 1), (257, 2, 1), (512, 2, 2), (513, 3, 2)],
)
def test_sequence_block_counts(num_tokens, blocks, full):
    seq = Sequence(list(range(num_tokens)), block_size=256)
    assert seq.num_blocks == blocks
    assert seq.num_full_blocks == full


def test_sequence_block_tokens_and_growth():
    seq = Sequence([10, 11, 12, 13, 14], block_size=4)
    assert seq.block_tokens(0) == [10, 11, 12, 13]
    assert seq.block_tokens(1) == [14]
    assert seq.num_blocks == 2
    seq.append_token(15)
    seq.append_token(16)
    seq.append_token(17)
    assert seq.block_tokens(1) == [14, 15, 16, 17]
    assert seq.num_blocks == 2 and seq.num_full_blocks == 2
    seq.append_token(18)
    assert seq.num_blocks == 3
    assert seq.num_prompt_tokens == 5
    assert seq.output_token_ids == [15, 16, 17, 18]
    assert seq.prompt_token_ids == [10, 11, 12, 13, 14]


def test_sequence_reset_for_recompute_keeps_tokens():
    seq = Sequence([1, 2, 3, 4, 5], block_size=4)
    seq.append_token(6)
    seq.block_table = [3, 9]
    seq.num_computed_tokens = 5
    seq.reset_for_recompute()
    assert seq.block_table == []
    assert seq.num_computed_tokens == 0
    assert seq.token_ids == [1, 2, 3, 4, 5, 6]
    assert seq.num_prompt_tokens == 5 and seq.output_token_ids == [6]
    assert seq.num_preemptions == 1
    assert seq.status.value == "waiting" and not seq.is_finished


def test_sequence_rejects_bad_block_size():
    with pytest.raises(ValueError):
        Sequence([1, 2], block_size=0)


# --- properties ---------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(
    block_size=st.integers(1, 8),
    table=st.lists(st.integers(0, 63), min_size=1, max_size=6, unique=True),
    data=st.data(),
)
def test_slot_mapping_agrees_with_slot_for(block_size, table, data):
    cap = len(table) * block_size
    start = data.draw(st.integers(0, cap))
    end = data.draw(st.integers(start, cap))
    slots = slot_mapping(table, block_size, start, end)
    assert slots == [slot_for(table, block_size, p) for p in range(start, end)]
    for p, s in zip(range(start, end), slots):
        # the slot decomposes back into (physical block, offset)
        assert s // block_size == table[p // block_size]
        assert s % block_size == p % block_size
    # distinct physical blocks -> distinct slots
    assert len(set(slots)) == len(slots)
