"""gpt-oss's pieces outside the expert block, each against transformers' gpt-oss code.

The clamped SwiGLU against ``GptOssExperts._apply_gate`` (which reads gate
and up interleaved, gate in the even columns), YaRN as gpt-oss configures
it (factor 32 over 4,096 positions, ``truncate`` False) against
``GptOssRotaryEmbedding``, and a layer's attention sinks loaded from the
checkpoint name ``self_attn.sinks`` into the softmax.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssRotaryEmbedding

from pagedllm.layers.activation import ClampedSwigluAndMul, gated_activation
from pagedllm.layers.rotary import RotaryEmbedding

GPT_OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "original_max_position_embeddings": 4096}


def _tiny_config(**rope: object) -> GptOssConfig:
    return GptOssConfig(hidden_size=64, intermediate_size=32, head_dim=64, num_attention_heads=2,
                        num_key_value_heads=1, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=8192, rope_parameters={**GPT_OSS_YARN, "rope_theta": 150000.0, **rope})


@pytest.mark.parametrize(("alpha", "limit"), [(1.702, 7.0), (1.0, 2.5)])
def test_clamped_swiglu_is_transformers_gate_on_deinterleaved_columns(alpha: float, limit: float) -> None:
    cfg = _tiny_config()
    cfg.swiglu_alpha, cfg.swiglu_limit = alpha, limit
    experts = GptOssExperts(cfg)
    gen = torch.Generator().manual_seed(0)
    # values well past the limit on both sides, so both clamps act
    interleaved = torch.randn(50, 2 * 32, generator=gen, dtype=torch.float64) * 6
    want = experts._apply_gate(interleaved)
    halves = torch.cat([interleaved[:, ::2], interleaved[:, 1::2]], dim=-1)  # [gate | up]
    act = gated_activation("swiglu_oai", swiglu_alpha=alpha, swiglu_limit=limit)
    assert isinstance(act, ClampedSwigluAndMul)
    torch.testing.assert_close(act(halves), want, rtol=0, atol=0)
    # the clamps matter: an unclamped SwiGLU of the same inputs differs
    gate, up = halves.chunk(2, dim=-1)
    assert not torch.allclose((up + 1) * gate * torch.sigmoid(alpha * gate), want)


def test_clamped_swiglu_refuses_a_limit_that_is_not_positive() -> None:
    with pytest.raises(ValueError, match="limit"):
        ClampedSwigluAndMul(1.702, 0.0)


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_tables_are_gpt_oss_rotary(truncate: bool) -> None:
    cfg = _tiny_config(truncate=truncate)
    theirs = GptOssRotaryEmbedding(cfg)
    ours = RotaryEmbedding(64, cfg.max_position_embeddings, 150000.0, {**GPT_OSS_YARN, "truncate": truncate})
    positions = torch.tensor([0, 1, 5, 127, 128, 4095, 4096, 8191])
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), positions[None])
    want_cos = torch.cat([cos[0], cos[0]], dim=-1)  # gpt-oss rotates halves with one angle per pair
    got_cos, got_sin = (t.reshape(len(positions), -1) for t in ours.cos_sin(positions, torch.float32))
    torch.testing.assert_close(got_cos, want_cos, rtol=1e-6, atol=1e-6)
    # our sin table carries rotate-half's sign on its first half (rotary.py)
    torch.testing.assert_close(got_sin.abs(), torch.cat([sin[0], sin[0]], dim=-1).abs(), rtol=1e-6, atol=1e-6)


def test_truncate_changes_gpt_oss_frequencies() -> None:
    """What a reader of gpt-oss's config must keep: without ``truncate`` False the frequencies differ."""
    kept = GptOssRotaryEmbedding(_tiny_config(truncate=False)).inv_freq
    dropped = GptOssRotaryEmbedding(_tiny_config(truncate=True)).inv_freq
    assert not torch.equal(kept, dropped)
