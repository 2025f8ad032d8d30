"""Speculative decoding on hybrid models (tiny random LFM2, Qwen3.5, Granite 4.0-H): greedy is plain decoding.

A hybrid model's state layers cannot drop a rejected draft's tokens from their
state: before each verify step the sequence's state is copied to a checkpoint
slot, and a rejection restores it and computes the accepted tokens again
(docs/hybrid-models.md). The prompts repeat token patterns; the weights are
drawn with ``initializer_range`` 0.05 (Qwen3.5's embeddings tied: untied, its
seeded model never repeats a token of the context; Granite 4.0-H's 0.02, tied,
its embedding multiplier 3: at 0.05 it never repeats one either), where the
seeded models fall into short loops that prompt lookup drafts from, and leave
them, so drafts are both accepted and rejected: each test asserts both
happened (the engine's counters, and the rollbacks: to a checkpoint, and
keeping every draft), so none passes with speculation idle. Every block,
state slot and checkpoint comes back.
"""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm import LLM, SamplingParams

# cost_model off: every proposal verified, whatever this machine's timings say
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "cost_model": False}
PROMPTS = [
    {"prompt_token_ids": [300 + (i % 5) for i in range(30)]},
    {"prompt_token_ids": [1000 + (i * 7) % 11 for i in range(17)] * 2},
    {"prompt_token_ids": [5000, 17, 4242, 999] * 5},
]
PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# decode steps captured from the first (the verify steps, their checkpoints copied before them, run eagerly)
ENGINE = dict(max_model_len=256, num_kv_blocks=128, block_size=4, kv_cache_dtype="float32", max_num_seqs=4,
              itl_target_ms=None, capture_min_decode_steps=0)
FAMILIES = ("lfm2", "qwen3_5", "granitemoehybrid")
GRANITE_LAYERS = ["mamba", "attention", "mamba", "mamba"]


def _config(family: str):  # noqa: ANN202
    if family == "lfm2":
        from transformers import Lfm2Config

        return Lfm2Config(vocab_size=49152, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                          layer_types=["conv", "conv", "full_attention", "conv"], conv_L_cache=3,
                          block_multiple_of=32, initializer_range=0.05, bos_token_id=1, eos_token_id=2,
                          pad_token_id=0)
    if family == "granitemoehybrid":
        from transformers import GraniteMoeHybridConfig

        # Mamba-2 state layers (and their conv) around one attention layer, experts and a shared MLP; the
        # embedding scaled up (tied): the seeded model repeats context tokens, which prompt lookup drafts from
        return GraniteMoeHybridConfig(
            vocab_size=49152, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.02, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, layer_types=GRANITE_LAYERS, num_local_experts=4,
            num_experts_per_tok=2, shared_intermediate_size=48, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
            mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, position_embedding_type=None,
            embedding_multiplier=3.0)
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                             linear_conv_kernel_dim=4, max_position_embeddings=1024, initializer_range=0.05,
                             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> dict[str, str]:  # noqa: ANN001
    """Each family's seeded tiny random checkpoint on disk."""
    from transformers import AutoModelForCausalLM

    dirs = {}
    for family in FAMILIES:
        torch.manual_seed(1234)
        path = tmp_path_factory.mktemp(f"tiny-spec-{family}")
        model = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32)
        model.save_pretrained(path, safe_serialization=True)
        smollm_tokenizer.save_pretrained(path)
        if family == "granitemoehybrid":  # the published config.json's names for the layer types
            config = json.loads((path / "config.json").read_text())
            config["layer_types"] = GRANITE_LAYERS
            (path / "config.json").write_text(json.dumps(config))
        dirs[family] = str(path)
    return dirs


def _run(path: str, speculative_config: dict | None) -> tuple[list, LLM, list[tuple[int, int, int]]]:
    """The outputs, the engine, and each rollback's (checkpoint length, length asked, computed length)."""
    llm = LLM(path, speculative_config=speculative_config, **ENGINE)
    bm = llm.llm_engine.block_manager
    rollbacks: list[tuple[int, int, int]] = []
    rollback = bm.rollback

    def spy(seq, num_computed_tokens):  # noqa: ANN001, ANN202
        checkpoint = seq.state_checkpoint[1] if seq.state_checkpoint is not None else -1
        rollbacks.append((checkpoint, num_computed_tokens, seq.num_computed_tokens))
        return rollback(seq, num_computed_tokens)

    bm.rollback = spy
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert not llm.llm_engine.requests and bm.num_free_blocks == bm.num_blocks
    assert bm.state_slots.num_used == 0
    runner = llm.llm_engine.model_runner
    captured = runner.captured_decode
    if not runner.model_config.num_experts:  # experts not in GGUF blocks read their routing into Python: eager
        assert captured is not None and captured.failed is None and captured.num_traces >= 1
    if bm.checkpoints is not None:
        assert bm.checkpoints.num_used == 0
    return outs, llm, rollbacks


@pytest.mark.parametrize("family", FAMILIES)
def test_ngram_greedy_on_a_hybrid_model_equals_plain(model_dirs: dict[str, str], family: str) -> None:
    want, _, _ = _run(model_dirs[family], None)
    got, llm, rollbacks = _run(model_dirs[family], NGRAM)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    proposed = sum(g.metrics["spec_decode_num_draft_tokens"] for g in got)
    accepted = sum(g.metrics["spec_decode_num_accepted_tokens"] for g in got)
    assert 0 < accepted < proposed, f"{family}: drafts proposed {proposed}, accepted {accepted}: need both kinds"
    # verify steps that rejected a draft went back to their checkpoint (before the drafts), and ones that
    # accepted every draft kept their state
    assert any(asked < computed for _, asked, computed in rollbacks), f"{family}: no rollback to a checkpoint"
    assert any(asked == computed for _, asked, computed in rollbacks), f"{family}: no verify step kept every draft"
    assert all(r[0] >= 0 for r in rollbacks)
    assert llm.llm_engine.block_manager.checkpoints.num_slots == llm.llm_engine.block_manager.state_slots.num_slots
