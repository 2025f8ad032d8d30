"""A RoPE table covers the positions the engine reaches (``max_model_len``), not the model's whole context."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.rotary import RotaryEmbedding


def test_a_table_built_for_fewer_positions_is_the_full_tables_first_rows() -> None:
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 1024}
    full = RotaryEmbedding(64, 8192, 500000.0, llama3)  # built at construction: 8192 rows
    short = RotaryEmbedding(64, 8192, 500000.0, llama3)
    short.build_tables(300)
    assert full.cos.shape == (8192, 64) and short.cos.shape == (300, 64) and short.sin.shape == (300, 64)
    # the frequencies are the model's (its 8192 positions' scaling), only the rows stop early
    assert torch.equal(short.cos, full.cos[:300]) and torch.equal(short.sin, full.sin[:300])
    short.build_tables(10**6)  # more than the model has: its own length
    assert short.cos.shape == (8192, 64)


def test_a_model_built_on_the_meta_device_builds_no_table_until_loaded() -> None:
    with torch.device("meta"):
        table = RotaryEmbedding(64, 131072, 500000.0, None)
    assert table.cos.device.type == "meta"
    table = table.to_empty(device="cpu")  # as the model loader places a model built on meta
    table.build_tables(128)
    assert table.cos.shape == (128, 64) and table.cos.device.type == "cpu"


def test_a_table_of_no_positions_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="num_positions=0"):
        RotaryEmbedding(64, 256, 10000.0, None).build_tables(0)
