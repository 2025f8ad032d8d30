"""Mixtral, Qwen2-MoE, OLMoE and GraniteMoE: their routing read from config.json and GGUF metadata.

The tiny checkpoints are ``tests/moe_models.py``'s (transformers' own config
classes, seeded). Configuration tests need no model: each family's keys as
its transformers config class reads them (defaults included), llama.cpp's
GGUF keys as its converter writes them, and the refusals by name.
"""

from __future__ import annotations

import dataclasses

import pytest
from moe_models import GRANITEMOE_MULTIPLIERS, MOE_ARCHS, moe_config, save_tiny_moe

from pagedllm.loader import load_model_config
from pagedllm.loader.model_config import ModelArchConfig, from_hf_config
from pagedllm.loader.moe_config import gguf_moe_fields
from pagedllm.loader.moe_families_config import gguf_moe_family_fields

# per family: (num_experts, top_k, expert width, renormalised, shared expert width, q/k norm, attention bias)
ROUTING = {
    "mixtral": (4, 2, 96, True, 0, False, False),
    "qwen2_moe": (8, 2, 32, False, 48, False, True),
    "olmoe": (8, 2, 48, False, 0, True, False),
    "granitemoe": (4, 2, 64, True, 0, False, False),
}


@pytest.fixture(scope="session")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> dict[str, str]:  # noqa: ANN001
    """The four tiny folders (seeded random weights, SmolLM2's tokenizer)."""
    return {arch: save_tiny_moe(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), smollm_tokenizer) for arch in MOE_ARCHS}


def _routing(cfg: ModelArchConfig) -> tuple:
    return (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob,
            cfg.shared_expert_intermediate_size, cfg.qk_norm, cfg.attention_bias)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_folder_config_is_read_as_transformers_reads_it(arch: str, moe_dirs: dict[str, str]) -> None:
    """The saved config.json: experts, top-k, expert widths, renormalisation, shared expert, q/k norms, biases,
    and Granite's multipliers."""
    cfg = load_model_config(moe_dirs[arch])
    assert (cfg.architecture, cfg.checkpoint_format) == (arch, "hf")
    assert _routing(cfg) == ROUTING[arch]
    assert cfg.dense_layers == () and cfg.sliding_windows == ()
    if arch == "granitemoe":
        assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attn_scale, cfg.logits_scaling) == (
            6.0, 0.4, 0.05, 3.0)
    else:
        assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attn_scale, cfg.logits_scaling) == (
            1.0, 1.0, None, 1.0)


def _dict(arch: str, **extra: object) -> dict:
    """A config.json of ``arch`` with only the keys every config needs (the class's defaults for the rest)."""
    name = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
            "granitemoe": "GraniteMoeForCausalLM"}[arch]
    experts = "num_local_experts" if arch in ("mixtral", "granitemoe") else "num_experts"
    return {"model_type": arch, "architectures": [name], "vocab_size": 100, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, experts: 8, **extra}


def test_config_class_defaults_where_keys_are_left_out() -> None:
    """What each config class assumes for a key config.json leaves out (top-k, widths, eps, theta, biases)."""
    mixtral = from_hf_config(_dict("mixtral"))
    assert (mixtral.num_experts_per_tok, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (2, 64, True)
    assert (mixtral.rms_norm_eps, mixtral.rope_theta) == (1e-5, 1e6)
    qwen = from_hf_config(_dict("qwen2_moe"))
    assert (qwen.num_experts_per_tok, qwen.moe_intermediate_size, qwen.shared_expert_intermediate_size) == (4, 1408,
                                                                                                            5632)
    assert (qwen.norm_topk_prob, qwen.attention_bias, qwen.rms_norm_eps) == (False, True, 1e-6)
    olmoe = from_hf_config(_dict("olmoe"))
    assert (olmoe.num_experts_per_tok, olmoe.norm_topk_prob, olmoe.qk_norm, olmoe.rms_norm_eps) == (8, False, True,
                                                                                                    1e-5)
    granite = from_hf_config(_dict("granitemoe"))
    assert (granite.num_experts_per_tok, granite.norm_topk_prob, granite.attn_scale) == (2, True, 1.0)
    # each config class's own transformers defaults agree with the reading's
    for arch in MOE_ARCHS:
        full = from_hf_config(moe_config(arch).to_dict())
        assert _routing(full) == ROUTING[arch], arch


def test_family_keys_are_honoured_or_refused_by_name() -> None:
    """Qwen2-MoE's dense layers (``mlp_only_layers``, ``decoder_sparse_step``) and ``qkv_bias``; Mixtral's window
    on every layer; what no family here computes (OLMoE's ``clip_qkv``, Qwen2-MoE's sliding window, a top-k
    over more experts than there are, Mixtral's ``attention_bias``) is refused, named."""
    dense = from_hf_config(_dict("qwen2_moe", mlp_only_layers=[0], decoder_sparse_step=2))
    assert dense.dense_layers == (0, 2)  # layer 0 listed, layers 0 and 2 off the step of 2
    # an index past the layers is no layer, as in Qwen2MoeDecoderLayer
    assert from_hf_config(_dict("qwen2_moe", mlp_only_layers=[3, 7])).dense_layers == (3,)
    assert from_hf_config(_dict("qwen2_moe", qkv_bias=False)).attention_bias is False
    assert from_hf_config(_dict("qwen2_moe", norm_topk_prob=True)).norm_topk_prob is True
    assert from_hf_config(_dict("qwen2_moe", sliding_window=0, use_sliding_window=False)).sliding_windows == ()
    windowed = from_hf_config(_dict("mixtral", sliding_window=16))
    assert windowed.sliding_windows == (16,) * 4
    assert from_hf_config(_dict("mixtral", sliding_window=4096, max_position_embeddings=4096)).sliding_windows == ()
    assert from_hf_config(_dict("olmoe", attention_bias=True)).attention_bias is True
    for arch, bad, name in (
        ("olmoe", {"clip_qkv": 8.0}, "clip_qkv"),
        ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
        ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ("mixtral", {"attention_bias": True}, "attention_bias"),
        ("qwen2_moe", {"decoder_sparse_step": -1}, "decoder_sparse_step"),
        ("qwen2_moe", {"moe_intermediate_size": -8}, "moe_intermediate_size"),
        ("qwen2_moe", {"mlp_only_layers": "0"}, "mlp_only_layers"),
        ("granitemoe", {"residual_multiplier": 0}, "residual_multiplier"),
        ("mixtral", {"embedding_multiplier": 2.0}, "embedding_multiplier"),
    ):
        with pytest.raises(ValueError, match=name):
            from_hf_config(_dict(arch, **bad))


def test_gguf_routing_keys_as_llama_cpp_reads_them() -> None:
    """expert_used_count is the top-k; expert_feed_forward_length the experts' width where given (else
    feed_forward_length); renormalised as llama.cpp's graph of the architecture does unless
    expert_weights_norm says; a file with experts but no expert_used_count is refused."""
    def read(arch: str, **keys: object) -> ModelArchConfig:
        routers = [f"blk.{i}.ffn_gate_inp.weight" for i in range(2)]
        fields = gguf_moe_fields(keys.get, arch, 4, 2, 96, routers)
        base = ModelArchConfig(arch, 100, 32, 96, 2, 4, 2, 8, 1e-6, 1e4, 64, False, checkpoint_format="gguf",
                               num_experts=4, **fields)
        return gguf_moe_family_fields(base, keys.get)

    mixtral = read("llama", expert_used_count=2)
    assert (mixtral.num_experts_per_tok, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (2, 96, True)
    qwen = read("qwen2moe", expert_used_count=2, expert_feed_forward_length=32, expert_shared_feed_forward_length=48)
    assert (qwen.moe_intermediate_size, qwen.shared_expert_intermediate_size, qwen.norm_topk_prob) == (32, 48, False)
    assert read("olmoe", expert_used_count=2).norm_topk_prob is False
    assert read("granitemoe", expert_used_count=2).norm_topk_prob is True
    assert read("qwen2moe", expert_used_count=2, expert_weights_norm=True).norm_topk_prob is True
    dense = ModelArchConfig("llama", 100, 32, 96, 2, 4, 2, 8, 1e-6, 1e4, 64, False, checkpoint_format="gguf")
    assert gguf_moe_family_fields(dense, {}.get) is dense
    assert read("llama", expert_used_count=2, expert_weights_norm=False).norm_topk_prob is False
    with pytest.raises(ValueError, match="expert_used_count"):
        read("olmoe")
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        read("olmoe", expert_used_count=5)


def test_granitemoe_multipliers_match_granite() -> None:
    """GraniteMoE reads Granite's four multipliers under its own model_type (``granitemoe``)."""
    cfg = from_hf_config(_dict("granitemoe", **GRANITEMOE_MULTIPLIERS))
    assert dataclasses.astuple(cfg)[0] == "granitemoe"
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attn_scale, cfg.logits_scaling) == (
        6.0, 0.4, 0.05, 3.0)
