"""Tensor parallelism for Gemma 4: two real ranks (gloo and shared memory, processes) against one process.

Gemma 4's layers differ in shape (sliding layers: ``num_key_value_heads`` heads of ``head_dim``; global layers:
``num_global_key_value_heads`` of ``global_head_dim``, values shared with keys in the MoE shape) and its MoE
layers run the experts beside a dense MLP, each branch normed after its own sum. Under two ranks each rank
holds the same query heads in every layer and the kv heads they read, half of the dense MLP and half of every
expert, the router whole; the two branches' partial sums are all-reduced together. Tiny random checkpoints of
transformers' own ``Gemma4TextConfig`` (``tests/models/test_family_gemma4.py``'s), both shapes: greedy tokens
equal one process's, and rank 0's expert-load counts equal one process's. The plan's refusals need no process.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from test_family_gemma4 import WINDOW, _save, _tiny_config
from test_family_gemma4_gguf import gemma4_ggufs  # noqa: F401 (a fixture)
from test_tensor_parallel import TwoRankEngines, _restore_threads, _tokens, _tp, two_ranks  # noqa: F401

from pagedllm import SamplingParams
from pagedllm.distributed.shard_plan import ShardPlan, global_kv_split
from pagedllm.loader import load_model_config

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma4_tp_dirs(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> dict[str, str]:  # noqa: ANN001
    """The dense shape (global layers: larger heads, their own v projection) and the MoE one (experts of 32
    beside the MLP; global layers: 2 kv heads against the sliding layers' 4, values shared with keys)."""
    dense = _save(_tiny_config(), tmp_path_factory.mktemp("tiny-gemma4-tp"), smollm_tokenizer, 1357)
    moe_config = _tiny_config(num_attention_heads=8, num_key_value_heads=4, enable_moe_block=True, num_experts=4,
                              top_k_experts=2, moe_intermediate_size=32, attention_k_eq_v=True,
                              num_global_key_value_heads=2)
    moe = _save(moe_config, tmp_path_factory.mktemp("tiny-gemma4-moe-tp"), smollm_tokenizer, 2468)
    return {"dense": dense, "moe": moe}


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)  # one prompt runs past the sliding window (8) several times over
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in (5 * WINDOW + 3, 6)]


def _run(llm, prompts: list[list[int]]) -> list[list[int]]:  # noqa: ANN001
    return _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))


def _rank0_layer(llm, index: int):  # noqa: ANN001, ANN202
    return llm.llm_engine.model_runner.model.model.layers[index]


# --- the plan (no processes) ---------------------------------------------------------


def test_plan_splits_each_layer_kinds_kv_heads_and_the_same_query_heads(gemma4_tp_dirs: dict[str, str]) -> None:
    cfg = load_model_config(gemma4_tp_dirs["moe"])
    assert (cfg.num_key_value_heads, cfg.num_global_key_value_heads) == (4, 2)
    plan = ShardPlan.make(cfg, 1, 2)
    assert (plan.q_heads, plan.kv_heads, plan.global_kv_heads) == ((4, 4), (2, 2), (1, 1))
    assert plan.expert_intermediate == (16, 16)
    local = plan.local_config(cfg)
    # the rank's cache holds its widest layer's share: 2 sliding kv heads of 16 (a global layer's 1 of 32 fits)
    assert (local.num_global_key_value_heads, local.cache_kv_heads, local.cache_head_dim) == (1, 2, 32)
    assert global_kv_split(load_model_config(gemma4_tp_dirs["dense"]), 2) == [(0, 1), (1, 1)]


@pytest.mark.parametrize(("fields", "size"), [
    ({"num_global_key_value_heads": 1}, 2),  # 26B-A4B-like: one global kv head cannot split
    ({"num_key_value_heads": 3, "num_attention_heads": 6, "num_global_key_value_heads": 2}, 2),
])
def test_uneven_kv_splits_are_refused(gemma4_tp_dirs: dict[str, str], fields: dict, size: int) -> None:
    cfg = dataclasses.replace(load_model_config(gemma4_tp_dirs["moe"]), **fields)
    with pytest.raises(ValueError, match="evenly"):
        ShardPlan.make(cfg, 0, size)


# --- two real ranks ------------------------------------------------------------------


def test_gemma4_dense_on_two_ranks_equals_one(gemma4_tp_dirs: dict[str, str],
                                              two_ranks: TwoRankEngines) -> None:  # noqa: F811
    prompts = _prompts(3)
    one = _tp(gemma4_tp_dirs["dense"], 1, block_size=8)
    expected = _run(one, prompts)
    one.shutdown()
    two = two_ranks.shared(gemma4_tp_dirs["dense"], block_size=8)
    sliding, global_ = _rank0_layer(two, 0).self_attn, _rank0_layer(two, 2).self_attn
    # half the query heads; sliding: 1 of 2 kv heads of 16, global: 1 of 2 of 32 with its own v projection
    assert (sliding.num_heads, sliding.num_kv_heads, sliding.head_dim) == (2, 1, 16)
    assert (global_.num_heads, global_.num_kv_heads, global_.head_dim) == (2, 1, 32)
    assert global_.v_proj is not None and global_.o_proj.in_features == 2 * 32
    assert _rank0_layer(two, 0).mlp.down_proj.in_features == 48
    assert _run(two, prompts) == expected


def test_gemma4_moe_on_two_ranks_equals_one(gemma4_tp_dirs: dict[str, str],
                                            two_ranks: TwoRankEngines) -> None:  # noqa: F811
    prompts = _prompts(7)
    one = _tp(gemma4_tp_dirs["moe"], 1, block_size=8)
    expected = _run(one, prompts)
    one_counts = one.llm_engine.model_runner.expert_load.counts()
    one.shutdown()
    two = two_ranks.shared(gemma4_tp_dirs["moe"], block_size=8)
    layer = _rank0_layer(two, 2)
    assert (layer.self_attn.num_heads, layer.self_attn.num_kv_heads, layer.self_attn.v_proj) == (4, 1, None)
    # half of every expert's rows and down columns; the router whole
    assert (layer.experts.down.in_features, layer.experts.gate_up.out_features) == (16, 4 * 2 * 16)
    assert layer.router.proj.out_features == 4
    load = two.llm_engine.model_runner.expert_load
    load.reset()
    assert _run(two, prompts) == expected
    assert load.counts().tokens == one_counts.tokens and sum(one_counts.tokens[0]) > 0


@pytest.mark.slow  # converts the checkpoint in a subprocess (seconds)
def test_gemma4_dense_f16_gguf_on_two_ranks_equals_one(gemma4_ggufs, two_ranks: TwoRankEngines) -> None:  # noqa: ANN001, F811
    """llama.cpp's converter's F16 file of the dense shape (``test_family_gemma4_gguf.py``'s): each layer's q/k/v
    rows of its own head size cut from the file's tensors, o_proj's and down's columns."""
    path = gemma4_ggufs["dense", "f16"]
    prompts = [[p % 500 + 10 for p in prompt] for prompt in _prompts(11)]  # the file's vocabulary is 512
    one = _tp(path, 1, block_size=8)
    expected = _run(one, prompts)
    one.shutdown()
    two = two_ranks.shared(path, block_size=8)
    assert _rank0_layer(two, 2).self_attn.k_proj.out_features == 32  # one of the global layer's 2 kv heads of 32
    assert _run(two, prompts) == expected
