"""The runner's side of state layers: the layer -> KV row map, the state tensors, the step's state fields.

Expected values are worked out by hand from docs/hybrid-models.md: a 4-layer
model whose layers 0, 1 and 3 are state layers keeps K/V for layer 2 alone
(row 0); a sequence computing from position 0 has no initial state.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.engine.scheduler import ScheduledSequence, SchedulerOutput
from pagedllm.engine.sequence import Sequence
from pagedllm.engine.step_builder import build_step_record
from pagedllm.loader.model_config import ModelArchConfig
from pagedllm.runner.input_batch import InputBatch
from pagedllm.runner.kv_cache import allocate_kv_cache, kv_bytes_per_block, kv_cache_rows
from pagedllm.runner.sequence_states import SequenceStates
from pagedllm.runner.state_cache import (
    allocate_state_cache,
    copy_state_slots,
    plan_state_slots,
    state_bytes_per_slot,
)
from pagedllm.sampling_params import SamplingParams
from pagedllm.step_record import SamplingSpec, SequenceStep

BS = 4
GREEDY = SamplingSpec(0.0, 0, 1.0, 0.0, None)


def _config(layer_types: tuple[str, ...]) -> ModelArchConfig:
    return ModelArchConfig(
        architecture="lfm2", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=4, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=128, tie_word_embeddings=True, layer_types=layer_types,
    )


def test_only_attention_layers_get_kv_rows() -> None:
    hybrid = _config(("conv", "conv", "full_attention", "linear_attention"))
    dense = _config(("full_attention",) * 4)
    assert hybrid.attention_layers == (2,) and hybrid.has_state_layers and not dense.has_state_layers
    assert kv_cache_rows(hybrid) == [None, None, 0, None]
    assert kv_cache_rows(dense) == [0, 1, 2, 3]
    # 2 (K, V) x 1 layer x 4 tokens x 2 heads x 4 dims x 4 bytes
    assert kv_bytes_per_block(hybrid, BS, torch.float32) == 2 * 1 * BS * 2 * 4 * 4
    assert kv_bytes_per_block(dense, BS, torch.float32) == 4 * kv_bytes_per_block(hybrid, BS, torch.float32)
    cache, per_layer = allocate_kv_cache(hybrid, 3, BS, torch.float32, torch.device("cpu"))
    assert cache.shape == (2, 1, 3, BS, 2, 4)
    assert per_layer[0] == () and per_layer[1] == () and per_layer[3] == ()
    assert per_layer[2][0].data_ptr() == cache[0, 0].data_ptr()


def test_unknown_layer_kinds_are_refused() -> None:
    with pytest.raises(ValueError, match="unsupported layer types"):
        _config(("conv", "ssm"))


def test_state_tensors_have_a_slot_dimension_and_copy_by_slot() -> None:
    shapes = [((2, 8),), None, ((2, 8), (3, 4, 4))]
    assert state_bytes_per_slot(shapes) == (16 + 16 + 48) * 4
    states = allocate_state_cache(shapes, 5, torch.device("cpu"))
    assert states[1] is None
    assert [t.shape for t in states[2]] == [(5, 2, 8), (5, 3, 4, 4)]
    assert all(t.dtype == torch.float32 and not t.any() for t in (*states[0], *states[2]))
    states[2][1][3].fill_(7.0)
    states[0][0][3].fill_(2.0)
    copy_state_slots(states, [(3, 0), (0, 4)])  # in order: 3 -> 0, then 0 (now 3's) -> 4
    assert states[2][1][0].eq(7).all() and states[2][1][4].eq(7).all() and states[0][0][4].eq(2).all()
    assert not states[2][1][1].any()


def test_slots_follow_max_num_seqs_within_half_the_budget() -> None:
    assert plan_state_slots(8, 1000, None) == 8
    assert plan_state_slots(8, 1000, 100_000) == 8
    assert plan_state_slots(8, 1000, 6_000) == 3  # half of 6,000 holds 3
    assert plan_state_slots(8, 1000, 100) == 1
    assert plan_state_slots(8, 0, None) == 0


def test_the_step_carries_each_sequences_slot_and_initial_state() -> None:
    batch = InputBatch(BS, torch.device("cpu"))
    prompt = SequenceStep("a", 0, (1, 2, 3), (0,), GREEDY, state_slot=5)
    chunk = SequenceStep("b", 4, (5, 6), (1, 2), GREEDY, state_slot=0)
    decode = SequenceStep("c", 7, (9,), (3, 4), GREEDY, state_slot=2)
    _, _, meta = batch.build([prompt, chunk, decode])
    assert meta.state_slots.tolist() == [5, 0, 2]
    assert meta.has_initial_state.tolist() == [False, True, True]
    _, _, plain = batch.build([SequenceStep("d", 0, (1, 2), (0,), GREEDY)])
    assert plain.state_slots is None and plain.has_initial_state is None
    with pytest.raises(ValueError, match="state slot"):
        batch.build([prompt, SequenceStep("e", 0, (1,), (1,), GREEDY)])


def test_the_record_sends_the_slot_once_and_the_copies() -> None:
    seq = Sequence([1, 2, 3], BS)
    seq.block_table, seq.state_slot = [4], 6
    out = SchedulerOutput([ScheduledSequence(seq, 0, 3)], state_copies_before=[(1, 2)],
                          state_copies_after=[(6, 3)])
    record = build_step_record(out, [SamplingParams(max_tokens=1)], [None])
    assert record.new_sequences[0].state_slot == 6
    assert (record.state_copies_before, record.state_copies_after) == (((1, 2),), ((6, 3),))
    (step,) = SequenceStates().apply(record)
    assert step.state_slot == 6
