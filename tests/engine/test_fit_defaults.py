"""A model starts with its defaults on the machine it is on (issue 48).

The KV pool's default budget is a share of the memory the weights leave (``resolved_config.default_kv_budget``),
and where one sequence of the model's full context does not fit in it, ``max_model_len`` is lowered to what
fits, with a warning naming the flags (``resolved_config.fit_max_model_len``). A ``max_model_len`` that was
given and does not fit is still an error naming them.

The arithmetic is tested with given memory figures (nothing here depends on this machine's memory); the
expected values are computed by hand from the model's KV shape. Checkpoints with Llama-3.2-1B's and
Qwen3-0.6B's KV shapes (layers, KV heads, head size, context) but a narrow MLP and hidden size then start
with no flags, once with this machine's memory and once with a memory figure that forces the fit.
"""

from __future__ import annotations

import logging
import os

import pytest

from pagedllm.config import EngineConfig
from pagedllm.resolved_config import (
    DEFAULT_KV_SHARE,
    MIN_FIT_MAX_MODEL_LEN,
    default_kv_budget,
    fit_max_model_len,
    kv_pool_blocks,
    plan_kv_pool,
)

GIB = 1 << 30
MIB = 1 << 20
# Llama-3.2-1B: 16 layers, 8 KV heads of 64, K and V in float32: 64 KiB a token, 1 MiB a block of 16
LLAMA_1B_BLOCK = 2 * 16 * 8 * 64 * 4 * 16
# Qwen3-0.6B: 28 layers, 8 KV heads of 128: 224 KiB a token, 3.5 MiB a block of 16
QWEN3_06B_BLOCK = 2 * 28 * 8 * 128 * 4 * 16
FLAGS = ("--max-model-len", "--kv-cache-memory-bytes")


def _config(max_model_len: int, fit: bool, **kw: object) -> EngineConfig:
    return EngineConfig(model="(none)", max_model_len=max_model_len, fit_max_model_len=fit, **kw)


# --- the arithmetic, with given memory ----------------------------------------------------------------------


def test_default_budget_is_a_share_of_what_the_weights_leave() -> None:
    assert DEFAULT_KV_SHARE == 0.5
    assert default_kv_budget(21 * GIB, 1 * GIB) == 10 * GIB  # CPU: half, no cap
    assert default_kv_budget(1 * GIB, 2 * GIB) == 0  # weights larger than what was free
    # a GPU's pool is allocated whole: a quarter, at most 2 GiB
    assert default_kv_budget(21 * GIB, 1 * GIB, lazy=False) == 2 * GIB
    assert default_kv_budget(5 * GIB, 1 * GIB, lazy=False) == 1 * GIB


def test_llama_1b_context_lowered_to_what_the_memory_holds() -> None:
    """7 GiB free, 1 GiB of weights: a 3 GiB pool of 3072 blocks holds 49152 tokens, not 131072 (8 GiB)."""
    cfg = _config(131072, fit=True)
    blocks, budget = kv_pool_blocks(cfg, LLAMA_1B_BLOCK, 7 * GIB, 1 * GIB)
    assert (blocks, budget) == (3072, 3 * GIB)
    plan = plan_kv_pool(cfg, blocks, budget, LLAMA_1B_BLOCK)
    assert (plan.max_model_len, plan.requested_max_model_len, plan.lowered) == (49152, 131072, True)
    # with 21 GiB free the whole context fits (10 GiB pool, 8 GiB a sequence): nothing lowered
    blocks, budget = kv_pool_blocks(cfg, LLAMA_1B_BLOCK, 21 * GIB, 1 * GIB)
    assert blocks == 10240 and not plan_kv_pool(cfg, blocks, budget, LLAMA_1B_BLOCK).lowered


def test_qwen3_06b_context_lowered_to_whole_blocks() -> None:
    """5 GiB free, 0.5 GiB of weights: 2.25 GiB / 3.5 MiB = 658 blocks (658.3), 10528 tokens of 40960."""
    cfg = _config(40960, fit=True)
    blocks, budget = kv_pool_blocks(cfg, QWEN3_06B_BLOCK, 5 * GIB, GIB // 2)
    assert blocks == 658
    assert fit_max_model_len(cfg, blocks, QWEN3_06B_BLOCK) == 658 * 16 == 10528


def test_a_given_max_model_len_that_does_not_fit_is_an_error_naming_the_flags() -> None:
    cfg = _config(131072, fit=False)
    with pytest.raises(ValueError, match=r"max_model_len=131072 does not fit: one sequence needs 8192 KV blocks") as e:
        fit_max_model_len(cfg, 3072, LLAMA_1B_BLOCK)
    assert all(flag in str(e.value) for flag in FLAGS)
    assert fit_max_model_len(cfg, 8192, LLAMA_1B_BLOCK) == 131072  # exactly one sequence: fits


def test_fitting_stops_at_a_useful_context() -> None:
    """Below MIN_FIT_MAX_MODEL_LEN tokens the fit refuses, naming the flags (a shorter model is never lowered)."""
    assert MIN_FIT_MAX_MODEL_LEN == 2048
    cfg = _config(131072, fit=True)
    assert fit_max_model_len(cfg, 128, LLAMA_1B_BLOCK) == 2048
    with pytest.raises(ValueError, match="lowered to fit no further than 2048 tokens") as e:
        fit_max_model_len(cfg, 127, LLAMA_1B_BLOCK)
    assert all(flag in str(e.value) for flag in FLAGS)
    short = _config(1000, fit=True)  # a model of 1000 tokens: fits (63 blocks) or is refused
    assert fit_max_model_len(short, 63, LLAMA_1B_BLOCK) == 1000
    with pytest.raises(ValueError, match="not one sequence of max_model_len=1000"):
        fit_max_model_len(short, 62, LLAMA_1B_BLOCK)
    # a pool whose size was given is what the user chose: lowered to it, however short
    assert fit_max_model_len(_config(131072, fit=True, num_kv_blocks=40), 40, LLAMA_1B_BLOCK) == 640
    assert fit_max_model_len(_config(131072, fit=True, kv_cache_memory_bytes=40 * MIB), 40, LLAMA_1B_BLOCK) == 640


def test_pool_sources_and_cap() -> None:
    # num_kv_blocks wins (no budget); with fit on, it may hold less than max_model_len without a refusal
    cfg = _config(131072, fit=True, num_kv_blocks=512)
    assert kv_pool_blocks(cfg, LLAMA_1B_BLOCK, 100 * GIB, 0) == (512, None)
    assert fit_max_model_len(cfg, 512, LLAMA_1B_BLOCK) == 8192
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        _config(131072, fit=False, num_kv_blocks=512)
    # kv_cache_memory_bytes: all of it, whatever is free
    assert kv_pool_blocks(_config(4096, fit=False, kv_cache_memory_bytes=5 * MIB), MIB, 0, 0) == (5, 5 * MIB)
    # the default never names more blocks than max_num_seqs sequences of max_model_len hold
    small = _config(256, fit=False, max_num_seqs=4)
    assert kv_pool_blocks(small, 4096, 100 * GIB, 0) == (4 * 16, 50 * GIB)
    # a model with 3 KV cache groups (sliding windows) may hold each sequence's blocks once per group
    assert kv_pool_blocks(small, 4096, 100 * GIB, 0, num_groups=3) == (3 * 4 * 16, 50 * GIB)
    with pytest.raises(ValueError, match="num_groups"):
        kv_pool_blocks(small, 4096, 100 * GIB, 0, num_groups=0)
    # two CPU ranks (0.5 GiB of weights each) share the machine: a quarter each of the 20 GiB left
    two = _config(131072, fit=True, tensor_parallel_size=2)
    assert kv_pool_blocks(two, MIB, 21 * GIB, GIB // 2) == (5120, 5 * GIB)
    assert kv_pool_blocks(two, MIB, 21 * GIB, GIB // 2, lazy=False)[1] == 2 * GIB  # a GPU each
    with pytest.raises(ValueError, match="bytes_per_block"):
        kv_pool_blocks(small, 0, GIB, 0)


def test_data_parallel_replicas_split_the_default_pool(smollm_path: str) -> None:
    """Two replicas on 21 GiB with 1 GiB model files: half of the 19 GiB two copies leave, split: 4.75 GiB each."""
    from pagedllm.loader import model_file_bytes
    from pagedllm.resolved_config import replica_kv_budget

    cfg = _config(4096, fit=True)
    assert replica_kv_budget(cfg, 2, 21 * GIB, 1 * GIB) == 19 * GIB // 4
    assert replica_kv_budget(cfg, 1, 21 * GIB, 1 * GIB) is None  # one replica: the engine's own default
    assert replica_kv_budget(_config(4096, fit=True, kv_cache_memory_bytes=GIB), 2, 21 * GIB, 0) is None
    assert model_file_bytes(smollm_path) == os.path.getsize(smollm_path)


def test_env_reports_the_memory_and_the_default_pool() -> None:
    from pagedllm.entrypoints.env_report import _memory

    memory = _memory()
    assert memory["available_gib"] > 0
    assert memory["default_kv_pool"].startswith(f"{DEFAULT_KV_SHARE:g} of what the weights leave")
    assert "--max-model-len" in memory["max_model_len_default"]


# --- real start-ups: checkpoints with Llama-3.2-1B's and Qwen3-0.6B's KV shapes -------------------------------

# name -> (config class, its KV shape and context as the real model's config.json has them, bytes a KV block)
KV_SHAPES = {
    "llama-3.2-1b": ("LlamaConfig", dict(num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                         head_dim=64, max_position_embeddings=131072), LLAMA_1B_BLOCK),
    "qwen3-0.6b": ("Qwen3Config", dict(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                       head_dim=128, max_position_embeddings=40960), QWEN3_06B_BLOCK),
}


@pytest.fixture(scope="session")
def kv_shape_dirs(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> dict[str, str]:  # noqa: ANN001
    """Random-weight folders with each real model's KV shape and context; a hidden size of 64, an MLP of 32
    and a tied embedding keep them at ~10M parameters."""
    import torch
    import transformers

    dirs = {}
    for name, (config_class, shape, _) in KV_SHAPES.items():
        config = getattr(transformers, config_class)(
            vocab_size=49152, hidden_size=64, intermediate_size=32, tie_word_embeddings=True,
            initializer_range=0.2, bos_token_id=1, eos_token_id=2, **shape,
        )
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        path = tmp_path_factory.mktemp(f"kv-shape-{name}")
        model.save_pretrained(path, safe_serialization=True)
        smollm_tokenizer.save_pretrained(path)
        dirs[name] = str(path)
    return dirs


def _greedy(llm: object) -> list[int]:
    from pagedllm import SamplingParams

    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(KV_SHAPES))
def test_real_kv_shapes_start_with_no_flags(
    name: str, kv_shape_dirs: dict[str, str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With this machine's memory: the model starts and generates, its context whole or lowered to the pool,
    and the start-up log says which. With 3 GiB free: lowered to exactly what half of what the weights leave
    holds, with a warning naming the flags. A max_model_len given that does not fit: an error naming them."""
    import pagedllm.runner.model_runner as model_runner
    from pagedllm import LLM

    path, (_, shape, per_block) = kv_shape_dirs[name], KV_SHAPES[name]
    context = shape["max_position_embeddings"]
    caplog.set_level(logging.INFO, logger="pagedllm.runner.model_runner")
    with LLM(path) as llm:
        runner = llm.llm_engine.model_runner
        assert runner.kv_bytes_per_block == per_block
        assert len(_greedy(llm)) == 4
        max_len = llm.llm_engine.config.max_model_len
        assert max_len == min(context, runner.num_kv_blocks * 16) >= MIN_FIT_MAX_MODEL_LEN
        assert f"blocks of 16 tokens, {runner.num_kv_blocks * per_block / GIB:.2f} GiB reserved" in caplog.text
        assert f"max_model_len {max_len}" in caplog.text
        assert ("max_model_len lowered" in caplog.text) == (max_len < context)
        # pagedllm env --load reports the same figures
        from pagedllm.entrypoints.env_report import loaded_model_report

        report = loaded_model_report(llm)
        assert (report["max_model_len"], report["num_kv_blocks"]) == (max_len, runner.num_kv_blocks)
        assert report["kv_cache_reserved_gib"] == round(runner.num_kv_blocks * per_block / GIB, 3)
    caplog.clear()

    free = 3 * GIB
    monkeypatch.setattr(model_runner, "available_memory_bytes", lambda device: free)
    with LLM(path) as llm:
        runner = llm.llm_engine.model_runner
        want_blocks = (free - llm.weight_bytes) // 2 // per_block
        assert runner.num_kv_blocks == want_blocks
        assert llm.llm_engine.config.max_model_len == want_blocks * 16 < context
        assert len(_greedy(llm)) == 4
        # a prompt past the lowered length is refused as any too-long prompt is
        with pytest.raises(ValueError, match="maximum context length"):
            llm.generate([{"prompt_token_ids": [5] * (want_blocks * 16 + 1)}], use_tqdm=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "lowered" in r.getMessage()]
    assert len(warnings) == 1 and f"from {context} to {want_blocks * 16} tokens" in warnings[0]
    assert all(flag in warnings[0] for flag in FLAGS)

    with pytest.raises(ValueError, match=f"max_model_len={context} does not fit") as e:
        LLM(path, max_model_len=context)
    assert all(flag in str(e.value) for flag in FLAGS)
