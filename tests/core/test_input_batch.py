"""The step's inputs built in numpy match a token-by-token construction from ``slot_for``."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.block_table import slot_for
from pagedllm.runner.input_batch import InputBatch
from pagedllm.step_record import SamplingSpec, SequenceStep

BS = 4


GREEDY = SamplingSpec(0.0, 0, 1.0, 0.0, None)


def _step(token_ids: list[int], block_table: list[int], num_computed: int) -> SequenceStep:
    return SequenceStep("r", num_computed, tuple(token_ids[num_computed:]), tuple(block_table), GREEDY)


def _scheduled(rng: random.Random, num_prefills: int, num_decodes: int) -> list[tuple[list[int], SequenceStep]]:
    """(all the sequence's tokens, its step) for a mix of prompt chunks and decodes."""
    out = []
    for i in range(num_prefills + num_decodes):
        length = rng.randint(1, 40)
        tokens = [rng.randint(0, 1000) for _ in range(length)]
        table = rng.sample(range(500), (length + BS - 1) // BS)  # scattered physical blocks
        if i < num_prefills:  # a chunk of a prompt: some tokens cached, several new
            new = rng.randint(2, length) if length >= 2 else 1
        else:
            new = 1
        out.append((tokens, _step(tokens, table, length - new)))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_build_matches_a_token_by_token_construction(seed: int) -> None:
    rng = random.Random(seed)
    batch = InputBatch(BS, torch.device("cpu"))
    # steps of growing and shrinking size: the buffers grow, then are reused
    for num_prefills, num_decodes in [(1, 0), (3, 5), (0, 2), (6, 20), (2, 1)]:
        pairs = _scheduled(rng, num_prefills, num_decodes)
        scheduled = [s for _, s in pairs]
        ids, positions, meta = batch.build(scheduled)
        want_ids, want_pos, want_slots, want_qsl = [], [], [], [0]
        for tokens, s in pairs:
            for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                want_ids.append(tokens[p])
                want_pos.append(p)
                want_slots.append(slot_for(list(s.block_table), BS, p))
            want_qsl.append(len(want_ids))
        assert ids.tolist() == want_ids and positions.tolist() == want_pos
        assert meta.slot_mapping.tolist() == want_slots
        assert meta.query_start_loc == want_qsl
        assert meta.seq_lens == [s.num_computed_tokens + s.num_new_tokens for s in scheduled]
        assert meta.seq_lens_tensor.tolist() == meta.seq_lens
        assert meta.num_computed == [s.num_computed_tokens for s in scheduled]
        assert meta.num_prefills == sum(1 for s in scheduled if s.num_new_tokens > 1)
        width = max(len(s.block_table) for s in scheduled)
        assert meta.block_tables.tolist() == [list(s.block_table) + [0] * (width - len(s.block_table)) for s in scheduled]
        for t in (ids, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens_tensor):
            assert t.dtype == torch.int64 and t.is_contiguous()


def test_build_refuses_tokens_beyond_the_block_table() -> None:
    step = _step(list(range(9)), [3, 7], 0)  # room for 8 tokens, 9 scheduled
    with pytest.raises(ValueError, match="does not fit"):
        InputBatch(BS, torch.device("cpu")).build([step])
    with pytest.raises(ValueError, match="at least one"):
        InputBatch(BS, torch.device("cpu")).build([])
