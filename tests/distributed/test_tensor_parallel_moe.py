"""Tensor parallelism for a mixture of experts: every rank a slice of every expert (``ShardPlan.expert_intermediate``).

One tiny random Qwen3-MoE (transformers' own config: 8 experts, top 2, both layers sparse, experts of 64
so that a GGUF Q8_0 file splits into one block of 32 per rank) from its folder and from llama.cpp's
converter's Q8_0 file: two real ranks give one process's greedy tokens, each rank holding half of every
expert's gate/up rows and down columns (the file's blocks as stored), the router whole. The plan's split
and its refusals need no processes.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from test_family_qwen3_moe import _save, _tiny_config
from test_tensor_parallel import TwoRankEngines, _restore_threads, _tokens, _tp, two_ranks  # noqa: F401

from pagedllm import SamplingParams
from pagedllm.distributed.shard_plan import ShardPlan, expert_split, shared_expert_split
from pagedllm.loader import load_model_config

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_tp_dir(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> str:  # noqa: ANN001
    config = _tiny_config(mlp_only_layers=[], num_experts_per_tok=2, moe_intermediate_size=64)
    return _save(config, tmp_path_factory.mktemp("tiny-qwen3-moe-tp"), smollm_tokenizer, 2468)


def _prompts() -> list[list[int]]:
    rng = random.Random(13)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in (37, 6)]


def _run(llm, prompts: list[list[int]]) -> list[list[int]]:  # noqa: ANN001
    return _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))


def _rank0_block(llm):  # noqa: ANN001, ANN202
    return llm.llm_engine.model_runner.model.model.layers[0].mlp


# --- the plan (no processes) ---------------------------------------------------------


def test_experts_split_evenly_for_float_and_in_whole_blocks_for_gguf(moe_tp_dir: str) -> None:
    cfg = load_model_config(moe_tp_dir)
    assert expert_split(cfg, 2) == [(0, 32), (32, 32)]
    assert expert_split(dataclasses.replace(cfg, moe_intermediate_size=30), 4) == [(0, 8), (8, 8), (16, 7),
                                                                                   (23, 7)]
    # Qwen3-30B-A3B's experts of 768 in a K-quant file: three blocks of 256, two to rank 0
    real = dataclasses.replace(cfg, moe_intermediate_size=768, checkpoint_format="gguf")
    assert expert_split(real, 2) == [(0, 512), (512, 256)]
    assert expert_split(dataclasses.replace(real, moe_intermediate_size=96), 2) == [(0, 64), (64, 32)]
    plan = ShardPlan.make(cfg, 1, 2)
    assert (plan.expert_intermediate, plan.total_expert_intermediate) == ((32, 32), 64)
    assert plan.local_config(cfg).moe_intermediate_size == 32
    assert plan.shared_expert_intermediate == (0, 0) and shared_expert_split(cfg, 2) == [(0, 0), (0, 0)]
    # a shared expert (Qwen2-MoE's) is cut as a routed one is: evenly, or in whole blocks of a GGUF file
    shared = dataclasses.replace(cfg, shared_expert_intermediate_size=5632, checkpoint_format="gguf")
    assert shared_expert_split(shared, 2) == [(0, 2816), (2816, 2816)]
    plan = ShardPlan.make(dataclasses.replace(cfg, shared_expert_intermediate_size=48), 1, 2)
    assert plan.shared_expert_intermediate == (24, 24)
    assert plan.local_config(cfg).shared_expert_intermediate_size == 24


@pytest.mark.parametrize(("fields", "size", "match"), [
    ({"moe_intermediate_size": 32, "checkpoint_format": "gguf"}, 2, "more than each expert's"),
    ({"moe_intermediate_size": 48, "checkpoint_format": "gguf"}, 2, "not whole GGUF blocks"),
    ({"moe_intermediate_size": 2}, 2 * 2, "more than"),
    ({"shared_expert_intermediate_size": 48, "checkpoint_format": "gguf"}, 2, "the shared expert's"),
])
def test_splits_that_leave_a_rank_no_whole_slice_are_refused(moe_tp_dir: str, fields: dict, size: int,
                                                            match: str) -> None:
    cfg = dataclasses.replace(load_model_config(moe_tp_dir), num_key_value_heads=4, **fields)
    with pytest.raises(ValueError, match=match):
        ShardPlan.make(cfg, 0, size)


# --- two real ranks ------------------------------------------------------------------


def test_qwen3_moe_folder_on_two_ranks_equals_one(moe_tp_dir: str, two_ranks: TwoRankEngines) -> None:  # noqa: F811
    prompts = _prompts()
    one = _tp(moe_tp_dir, 1, block_size=8)
    expected = _run(one, prompts)
    assert _rank0_block(one).experts.down.in_features == 64
    one_counts = one.llm_engine.model_runner.expert_load.counts()
    one.shutdown()
    two = two_ranks.shared(moe_tp_dir, block_size=8)
    block = _rank0_block(two)
    assert (block.experts.down.in_features, block.experts.gate_up.out_features) == (32, 8 * 2 * 32)
    assert block.gate.out_features == 8  # the router whole on every rank
    load = two.llm_engine.model_runner.expert_load
    load.reset()
    assert _run(two, prompts) == expected
    # the router is whole on every rank: rank 0's counts are the model's, one process's
    assert load.counts().tokens == one_counts.tokens and sum(one_counts.tokens[0]) > 0


@pytest.mark.slow  # converts the checkpoint in a subprocess (seconds)
def test_qwen3_moe_q8_0_gguf_on_two_ranks_keeps_its_blocks_and_equals_one(
        moe_tp_dir: str, tmp_path_factory: pytest.TempPathFactory, gguf_converter,  # noqa: ANN001
        two_ranks: TwoRankEngines) -> None:  # noqa: F811
    path = gguf_converter.convert(moe_tp_dir, "q8_0", str(tmp_path_factory.mktemp("moe-tp-gguf") / "q8_0.gguf"))
    prompts = _prompts()
    one = _tp(path, 1, block_size=8, gguf_activations="float32")
    expected = _run(one, prompts)
    one.shutdown()
    two = two_ranks.shared(path, block_size=8, gguf_activations="float32")
    down = _rank0_block(two).experts.down
    # one Q8_0 block (34 bytes) of each of the 64 hidden rows of each of the 8 experts: rank 0's columns 0..31
    assert down.qweight.dtype == torch.uint8 and tuple(down.qweight.shape) == (8 * 64, 34)
    assert _run(two, prompts) == expected


def test_a_gguf_experts_slice_off_its_blocks_is_refused_not_widened() -> None:
    """Down's columns from 16 of a Q8_0 file (blocks of 32): the kernels cannot take the slice as stored, and the
    layer says so rather than holding every expert in float."""
    from gguf import GGMLQuantizationType

    from pagedllm.layers.fused_moe import moe_fused_projections, stacked_experts_layer
    from pagedllm.layers.quantization.quant_config import QuantConfig

    q8_0 = int(GGMLQuantizationType.Q8_0)
    types = {f"model.layers.0.mlp.experts.{e}.down_proj.weight": q8_0 for e in range(4)}
    config = QuantConfig(gguf_types=types, fused=moe_fused_projections(4, 16, 64, expert_start=16))
    prefix = "model.layers.0.mlp.experts.down"
    with torch.device("meta"):
        assert stacked_experts_layer(32, 64, 4, False, config, prefix).quant_method.name.startswith("gguf")
        with pytest.raises(ValueError, match="not whole GGUF blocks"):
            stacked_experts_layer(16, 64, 4, False, config, prefix, input_start=16)


@pytest.fixture(scope="module")
def shared_and_biased_dirs(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> dict[str, str]:  # noqa: ANN001
    """A tiny Qwen2-MoE (a gated shared expert of 48 beside 8 experts of 32) and a tiny gpt-oss (biases on
    every expert projection, attention sinks), as their family tests save them."""
    from moe_models import save_tiny_moe
    from test_family_gpt_oss import save_tiny_gpt_oss

    return {"qwen2_moe": save_tiny_moe("qwen2_moe", tmp_path_factory.mktemp("tp-qwen2-moe"), smollm_tokenizer),
            "gpt_oss": save_tiny_gpt_oss(tmp_path_factory.mktemp("tp-gpt-oss"), smollm_tokenizer)}


@pytest.mark.parametrize("arch", ["qwen2_moe", "gpt_oss"])
def test_shared_expert_and_expert_biases_on_two_ranks_equal_one(
        arch: str, shared_and_biased_dirs: dict[str, str], two_ranks: TwoRankEngines) -> None:  # noqa: F811
    """Qwen2-MoE's shared expert (each rank half its rows, its partial sum joined to the routed experts' before
    the block's one all-reduce, the sigmoid gate whole) and gpt-oss's expert biases (gate/up's cut with their
    rows, down's added by rank 0 alone) give one process's greedy tokens."""
    path = shared_and_biased_dirs[arch]
    prompts = _prompts()
    one = _tp(path, 1, block_size=8)
    expected = _run(one, prompts)
    one.shutdown()
    two = two_ranks.own(path, block_size=8)
    try:
        block = _rank0_block(two)
        if arch == "qwen2_moe":
            shared = block.shared_expert
            assert (shared.gate_up_proj.out_features, shared.down_proj.in_features) == (2 * 24, 24)
            assert not shared.down_proj.reduce
        else:
            assert block.experts.down.in_features == 16 and block.experts.gate_up.bias is not None
        assert _run(two, prompts) == expected
    finally:
        two.shutdown()
