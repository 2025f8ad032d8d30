"""Model families from the shared blocks: the registry, a family defined here, activations, layers without RoPE.

The tiny checkpoints are transformers' own (``LlamaConfig``, seeded random
weights); transformers' greedy tokens on them are the oracle.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random

import pytest
import torch
from conftest import _tiny_config, hf_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import load_kernels
from pagedllm.layers.attention import make_backend
from pagedllm.layers.decoder import CausalLM, DecoderLayerSpec, DecoderSpec
from pagedllm.layers.native_ops import NativeOps
from pagedllm.layers.norm import NormSpec, RMSNorm
from pagedllm.layers.qk_rotary import QKNormRotary
from pagedllm.layers.rotary import RopeSpec
from pagedllm.layers.self_attention import AttentionSpec
from pagedllm.loader.model_config import ModelArchConfig, from_hf_config
from pagedllm.models import registry
from pagedllm.models.gemma2 import Gemma2ForCausalLM
from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from pagedllm.models.registry import MODEL_REGISTRY, Family, ModelRegistry

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in (1, 6, 19)]


def _save_llama(tmp_path_factory: pytest.TempPathFactory, tokenizer, hidden_act: str, name: str,  # noqa: ANN001
                attention_bias: bool = False) -> str:
    """A tiny random Llama with ``hidden_act`` (transformers' LlamaConfig), saved with the tokenizer.

    With ``attention_bias`` the biases are random too (transformers starts them at zero, which would hide
    a bias left out).
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    config = _tiny_config("llama")
    config.hidden_act = hidden_act
    config.attention_bias = attention_bias
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _hf_tokens(path: str, prompts: list[list[int]], **overrides: object) -> list[list[int]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    return [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


@pytest.mark.parametrize("hidden_act", ["gelu", "relu"])
def test_llama_honours_hidden_act(hidden_act: str, tmp_path_factory, smollm_tokenizer) -> None:  # noqa: ANN001
    """A Llama config naming another activation runs it (it ran SiLU, silently, before)."""
    path = _save_llama(tmp_path_factory, smollm_tokenizer, hidden_act, f"llama-{hidden_act}")
    prompts = _prompts()
    want = _hf_tokens(path, prompts)
    assert want != _hf_tokens(path, prompts, hidden_act="silu")  # the activation shows in the tokens
    llm = LLM(path, num_kv_blocks=64, max_model_len=128, block_size=8)
    assert _greedy(llm, prompts) == want


def test_llama_attention_bias_on_qkv_and_output_matches_transformers(tmp_path_factory, smollm_tokenizer) -> None:  # noqa: ANN001
    """transformers' Llama biases q, k, v and o with ``attention_bias`` (refused for o_proj's bias before)."""
    path = _save_llama(tmp_path_factory, smollm_tokenizer, "silu", "llama-bias", attention_bias=True)
    prompts = _prompts()
    llm = LLM(path, num_kv_blocks=64, max_model_len=128, block_size=8)
    assert llm.llm_engine.model_runner.model.model.layers[0].self_attn.o_proj.bias is not None
    assert _greedy(llm, prompts) == _hf_tokens(path, prompts)


class ExactGeluLlama(CausalLM):
    """A family written in the test from the shared blocks alone: Llama's layout, exact GELU always."""

    @classmethod
    def decoder_spec(cls, cfg: ModelArchConfig) -> DecoderSpec:
        norm = NormSpec(cfg.rms_norm_eps)
        attention = AttentionSpec(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        layer = DecoderLayerSpec(attention, cfg.intermediate_size, "gelu", norm)
        rope = RopeSpec(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        return DecoderSpec(cfg.vocab_size, cfg.hidden_size, (layer,) * cfg.num_hidden_layers, norm,
                           {"default": rope}, tie_word_embeddings=cfg.tie_word_embeddings)


def test_family_registered_in_a_test_matches_transformers(
    tmp_path_factory, smollm_tokenizer, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
) -> None:
    path = _save_llama(tmp_path_factory, smollm_tokenizer, "gelu", "exact-gelu-llama")
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["architectures"] = ["ExactGeluLlamaForCausalLM"]  # transformers still reads it as its model_type, llama
    with open(config_path, "w") as f:
        json.dump(config, f)
    prompts = _prompts()
    want = _hf_tokens(path, prompts)

    with pytest.raises(ValueError, match=r"unsupported architecture \['ExactGeluLlamaForCausalLM'\].*LlamaForCausalLM"):
        LLM(path, num_kv_blocks=64, max_model_len=128, block_size=8)

    family = Family(ExactGeluLlama, ("ExactGeluLlamaForCausalLM",))
    monkeypatch.setattr(registry, "MODEL_REGISTRY", MODEL_REGISTRY.with_family(family))
    llm = LLM(path, num_kv_blocks=64, max_model_len=128, block_size=8)
    assert isinstance(llm.llm_engine.model_runner.model, ExactGeluLlama)
    assert _greedy(llm, prompts) == want
    assert llm.llm_engine.block_manager.num_free_blocks == 64


def _arch(names: tuple[str, ...] = (), architecture: str = "llama", checkpoint_format: str = "hf") -> ModelArchConfig:
    return ModelArchConfig(
        architecture=architecture, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=64, tie_word_embeddings=False, architectures=names, checkpoint_format=checkpoint_format,
    )


@pytest.mark.parametrize(("names", "architecture", "checkpoint_format", "cls"), [
    (("LlamaForCausalLM",), "llama", "hf", LlamaForCausalLM),
    (("MistralForCausalLM",), "mistral", "hf", LlamaForCausalLM),
    (("Qwen2ForCausalLM",), "qwen2", "hf", Qwen2ForCausalLM),
    (("Gemma3ForCausalLM",), "gemma3", "hf", Gemma3ForCausalLM),
    ((), "qwen3", "hf", LlamaForCausalLM),  # a config.json that lists no architectures: its model_type
    ((), "llama", "gguf", LlamaForCausalLM),
    ((), "qwen2", "gguf", Qwen2ForCausalLM),
    ((), "gemma3", "gguf", Gemma3ForCausalLM),
    (("Gemma2ForCausalLM",), "gemma2", "hf", Gemma2ForCausalLM),
    ((), "gemma2", "gguf", Gemma2ForCausalLM),
])
def test_registry_finds_the_family_by_either_name(names, architecture, checkpoint_format, cls) -> None:  # noqa: ANN001
    assert registry.model_class(_arch(names, architecture, checkpoint_format)) is cls


@pytest.mark.parametrize(("cfg", "message"), [
    (_arch(("GPTNeoXForCausalLM",), "gpt_neox"),
     r"unsupported architecture \['GPTNeoXForCausalLM'\]; supported: .*'Qwen2ForCausalLM'"),
    (_arch((), "gpt_neox"), r"unsupported architecture model_type 'gpt_neox'; supported: .*'LlamaForCausalLM'"),
    (_arch((), "mamba", "gguf"), r"unsupported GGUF architecture 'mamba'; supported: \[.*'gemma2', 'gemma3'.*'llama'.*'olmo2'.*'phi3', 'qwen2'.*'qwen3'.*\]"),
])
def test_registry_refuses_an_unknown_architecture_by_name(cfg: ModelArchConfig, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        registry.model_class(cfg)


def test_registry_refuses_a_name_claimed_twice() -> None:
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        MODEL_REGISTRY.with_family(Family(ExactGeluLlama, ("LlamaForCausalLM",)))
    supported = ModelRegistry(MODEL_REGISTRY.families).supported("gguf")
    assert supported == sorted(supported)
    assert {"gemma2", "gemma3", "llama", "mistral", "olmo2", "phi3", "qwen2", "qwen3"} <= set(supported)


def test_an_unknown_model_type_is_read_and_refused_by_the_registry() -> None:
    """An unknown model_type is read as Llama's keys; which class runs it is the registry's to refuse."""
    cfg = {**_tiny_config("llama").to_dict(), "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}
    parsed = from_hf_config(cfg)
    assert parsed.architecture == "gpt_neox" and parsed.architectures == ("GPTNeoXForCausalLM",)
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM"):
        registry.model_class(parsed)
    with pytest.raises(ValueError, match="intermediate_size"):
        from_hf_config({k: v for k, v in cfg.items() if k != "intermediate_size"})


def test_an_unknown_activation_is_refused_by_name() -> None:
    cfg = from_hf_config({**_tiny_config("llama").to_dict(), "hidden_act": "quick_gelu"})
    backend = make_backend("reference", "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"unsupported hidden activation 'quick_gelu'; supported: .*'gelu'"), \
            torch.device("meta"):
        LlamaForCausalLM(cfg, backend)


def test_decoder_spec_refuses_a_layer_with_rope_and_no_table() -> None:
    norm = NormSpec(1e-6)
    attention = AttentionSpec(32, 2, 1, 16)  # rope=True
    with pytest.raises(ValueError, match="rope_table"):
        DecoderSpec(64, 32, (DecoderLayerSpec(attention, 64, "silu", norm, rope_table=None),), norm, {})
    with pytest.raises(ValueError, match="'local'"):
        DecoderSpec(64, 32, (DecoderLayerSpec(attention, 64, "silu", norm, rope_table="local"),), norm,
                    {"default": RopeSpec(16, 64, 10000.0)})


@pytest.mark.parametrize("with_norms", [False, True])
def test_layer_without_rope_norms_only_in_either_implementation(with_norms: bool) -> None:
    """SmolLM3-style layers without RoPE: q and k come out of qkv unrotated (normed per head where the model norms)."""
    gen = torch.Generator().manual_seed(3)
    num_heads, num_kv_heads, head_dim, rows = 4, 2, 16, 5
    norms = (RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)) if with_norms else (None, None)
    for norm in norms:
        if norm is not None:
            with torch.no_grad():
                norm.weight.copy_(torch.rand(head_dim, generator=gen) + 0.5)
    layer = QKNormRotary(num_heads, num_kv_heads, head_dim, *norms, rotate=False)
    qkv = torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q = qkv[:, : num_heads * head_dim].reshape(rows, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].reshape(rows, num_kv_heads, head_dim)
    if with_norms:  # the reference: transformers' RMSNorm per head
        def ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        q, k = ref(q, norms[0].weight.detach()), ref(k, norms[1].weight.detach())
    before = qkv.clone()
    got_q, got_k = layer(qkv, None)
    torch.testing.assert_close(got_q, q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, k, rtol=1e-6, atol=1e-6)
    lib = load_kernels()
    assert lib is not None, "the native kernels must build on the test machine"
    layer.select_impl(NativeOps(lib))
    native_q, native_k = layer(qkv, None)
    assert torch.equal(qkv, before)  # copies: v and the rest of qkv untouched
    torch.testing.assert_close(native_q, q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native_k, k, rtol=1e-5, atol=1e-5)


def test_every_registered_family_is_a_decoder_spec_on_the_shared_blocks() -> None:
    """A family file holds a ``decoder_spec``; its layers are the shared ones (no attention or MLP of its own).

    A family whose layer differs in structure (Gemma 4: experts beside the MLP, per-layer head shapes) names a
    layer class of ``pagedllm.layers`` (``CausalLM.layer_class``), still built on the shared MLP; the family
    file itself holds no layer code."""
    from pagedllm.layers.decoder import DecoderLayer
    from pagedllm.layers.fused_moe import MoEBlock
    from pagedllm.layers.mlp import GatedMLP
    from pagedllm.layers.self_attention import SelfAttention

    backend = make_backend("reference", "cpu", torch.float32)
    for family in MODEL_REGISTRY.families:
        assert issubclass(family.model_class, CausalLM), family.model_class
        architecture = family.config_types[0] if family.config_types else "llama"
        with torch.device("meta"):
            model = family.model_class(_arch(architecture=architecture), backend)
        layer = model.model.layers[0]
        if family.model_class.layer_class is not None:
            assert type(layer) is family.model_class.layer_class
            assert type(layer).__module__.startswith("pagedllm.layers.") and type(layer.mlp) is GatedMLP
            assert type(layer.self_attn).__module__.startswith("pagedllm.layers.")
            continue
        assert type(layer) is DecoderLayer
        assert type(layer.self_attn) is SelfAttention and type(layer.mlp) is GatedMLP
        if getattr(family.model_class, "supports_experts", False):  # and its sparse layers the shared MoE block
            sparse = dataclasses.replace(_arch(architecture=architecture), num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32)
            with torch.device("meta"):
                model = family.model_class(sparse, backend)
            assert type(model.model.layers[0].mlp) is MoEBlock
