"""The step's inputs built in numpy match a token-by-token construction from ``slot_for``."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.engine.block_table import slot_for
from pagedllm.engine.scheduler import ScheduledSequence
from pagedllm.engine.sequence import Sequence
from pagedllm.runner.input_batch import InputBatch

BS = 4


def _scheduled(rng: random.Random, num_prefills: int, num_decodes: int) -> list[ScheduledSequence]:
    out = []
    for i in range(num_prefills + num_decodes):
        length = rng.randint(1, 40)
        seq = Sequence([rng.randint(0, 1000) for _ in range(length)], BS)
        seq.block_table = rng.sample(range(500), (length + BS - 1) // BS)  # scattered physical blocks
        if i < num_prefills:  # a chunk of a prompt: some tokens cached, several new
            new = rng.randint(2, length) if length >= 2 else 1
        else:
            new = 1
        out.append(ScheduledSequence(seq, length - new, new))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_build_matches_a_token_by_token_construction(seed: int) -> None:
    rng = random.Random(seed)
    batch = InputBatch(BS, torch.device("cpu"))
    # steps of growing and shrinking size: the buffers grow, then are reused
    for num_prefills, num_decodes in [(1, 0), (3, 5), (0, 2), (6, 20), (2, 1)]:
        scheduled = _scheduled(rng, num_prefills, num_decodes)
        ids, positions, meta = batch.build(scheduled)
        want_ids, want_pos, want_slots, want_qsl = [], [], [], [0]
        for s in scheduled:
            for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                want_ids.append(s.seq.token_ids[p])
                want_pos.append(p)
                want_slots.append(slot_for(s.seq.block_table, BS, p))
            want_qsl.append(len(want_ids))
        assert ids.tolist() == want_ids and positions.tolist() == want_pos
        assert meta.slot_mapping.tolist() == want_slots
        assert meta.query_start_loc == want_qsl
        assert meta.seq_lens == [s.num_computed_tokens + s.num_new_tokens for s in scheduled]
        assert meta.seq_lens_tensor.tolist() == meta.seq_lens
        assert meta.num_computed == [s.num_computed_tokens for s in scheduled]
        assert meta.num_prefills == sum(1 for s in scheduled if s.num_new_tokens > 1)
        width = max(len(s.seq.block_table) for s in scheduled)
        assert meta.block_tables.tolist() == [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in scheduled]
        for t in (ids, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens_tensor):
            assert t.dtype == torch.int64 and t.is_contiguous()


def test_build_refuses_tokens_beyond_the_block_table() -> None:
    seq = Sequence(list(range(9)), BS)
    seq.block_table = [3, 7]  # room for 8 tokens, 9 scheduled
    with pytest.raises(ValueError, match="does not fit"):
        InputBatch(BS, torch.device("cpu")).build([ScheduledSequence(seq, 0, 9)])
    with pytest.raises(ValueError, match="at least one"):
        InputBatch(BS, torch.device("cpu")).build([])
