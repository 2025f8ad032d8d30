"""Every config.json field that changes the arithmetic is honoured or refused by name; unsupported experts refused.

Honoured, against transformers on the same tiny random weights: Llama's
``mlp_bias`` (biases on gate, up and down) and ``attention_bias``, from the
folder and from llama.cpp's converter GGUF. Refused: a field the family's
transformers class does not compute, set to a value that would change the
result (``loader/config_fields.py``), each named in its error. Experts in
a dense family's config are refused as a mixture of experts, naming the
architecture and the mixture-of-experts ones supported (Mixtral, the
"llama" GGUF with an expert count that llama.cpp writes for it, and the
other MoE families run: ``test_family_moe.py``, ``test_family_qwen3_moe.py``).
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import _tiny_config, hf_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.loader import load_model_config
from pagedllm.loader.model_config import from_hf_config
from pagedllm.models import registry

GENERATED = 16
ENGINE = dict(max_model_len=256, num_kv_blocks=64, block_size=8, kv_cache_dtype="float32")
LOGPROB_TOL = 1e-4  # float32 on both sides, F16 files against transformers on the same rounded weights


def _save(config, path: str, tokenizer) -> str:  # noqa: ANN001
    """transformers' model of ``config`` (seeded), every bias drawn at random (transformers starts them at zero,
    which would hide one left out), saved with the tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def biased_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> str:  # noqa: ANN001
    """A tiny Llama with ``mlp_bias`` and ``attention_bias``: biases on all seven projections."""
    config = _tiny_config("llama")
    config.mlp_bias = True
    config.attention_bias = True
    return _save(config, tmp_path_factory.mktemp("tiny-llama-biased"), smollm_tokenizer)


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in (30, 7)]


def _hf(path: str, round_matrices_to_f16: bool = False):  # noqa: ANN202
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if round_matrices_to_f16:  # the converter writes matrices in the outtype, vectors (biases) in F32
        with torch.no_grad():
            for p in hf.parameters():
                if p.dim() == 2:
                    p.copy_(p.half().float())
    return hf


def test_llama_mlp_bias_and_attention_bias_match_transformers(biased_llama_dir: str) -> None:
    """Biases on gate, up, down, q, k, v and o (the MLP's were refused before): transformers' greedy tokens."""
    cfg = load_model_config(biased_llama_dir)
    assert cfg.mlp_bias and cfg.attention_bias
    llm = LLM(biased_llama_dir, **ENGINE)
    mlp = llm.llm_engine.model_runner.model.model.layers[0].mlp
    assert mlp.gate_up_proj.bias is not None and mlp.down_proj.bias is not None
    hf = _hf(biased_llama_dir)
    prompts = _prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, GENERATED) for p in prompts]
    # the check discriminates: without the MLP's biases, transformers picks other tokens
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                proj.bias.zero_()
    assert [o.outputs[0].token_ids for o in outs] != [hf_greedy(hf, p, GENERATED) for p in prompts]


@pytest.mark.slow  # converts the checkpoint in subprocesses (seconds each)
# F16 only: the converter writes this family's own tensors (vectors, norms, biases) in F32 in either outtype, so
# its F16 file holds both types; an all-F32 file's matrices are read as any family's (tests/models/
# test_gguf_converted.py's Llama F32 file)
@pytest.mark.parametrize("outtype", ["f16"])
def test_biased_llama_converter_gguf_matches_transformers(
    outtype: str, biased_llama_dir: str, tmp_path_factory, gguf_converter,  # noqa: ANN001
) -> None:
    """llama.cpp's converter writes the seven biases (ffn_gate/up/down.bias, attn_q/k/v/output.bias; q and k
    bias rows RoPE-permuted as their weights): transformers' tokens and logprobs on float32 activations."""
    from gguf_convert import read_gguf

    path = gguf_converter.convert(biased_llama_dir, outtype, str(tmp_path_factory.mktemp("biased-gguf") / f"llama-{outtype}.gguf"))
    names = {t.name for t in read_gguf(path).tensors}
    assert {f"blk.0.{n}.bias" for n in ("ffn_gate", "ffn_up", "ffn_down", "attn_q", "attn_output")} <= names
    cfg = load_model_config(path)
    assert cfg.mlp_bias and cfg.attention_bias
    hf = _hf(biased_llama_dir, round_matrices_to_f16=outtype == "f16")
    llm = LLM(path, **ENGINE, gguf_activations="float32")
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    prompts = _prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        assert tokens == hf_greedy(hf, prompt, GENERATED)
        with torch.inference_mode():
            want = torch.log_softmax(hf(input_ids=torch.tensor([prompt + tokens])).logits[0].double(), dim=-1)
        rows = [(i - 1, lps) for i, lps in enumerate(out.prompt_logprobs) if lps is not None]
        rows += [(len(prompt) - 1 + i, lps) for i, lps in enumerate(out.outputs[0].logprobs)]
        assert max(abs(lp.logprob - float(want[r, t])) for r, lps in rows for t, lp in lps.items()) < LOGPROB_TOL


def _config(arch: str, **fields: object) -> dict:
    """The tiny config.json of conftest's ``arch`` with ``fields`` set."""
    return {**_tiny_config(arch).to_dict(), **fields}


@pytest.mark.parametrize(("arch", "fields", "message"), [
    ("qwen3", {"mlp_bias": True}, "mlp_bias=true, which the 'qwen3' architecture does not compute"),
    ("mistral", {"mlp_bias": True}, "mlp_bias=true"),
    ("mistral", {"attention_bias": True}, "attention_bias=true, which the 'mistral' architecture"),
    ("llama", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ("qwen2", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ("llama", {"use_qk_norm": True}, "use_qk_norm=true"),
    ("llama", {"qk_layernorm": True}, "qk_layernorm=true"),
    ("llama", {"clip_qkv": 8.0}, "clip_qkv=8.0"),
    ("llama", {"sliding_window": 4096}, "sliding_window=4096, which the 'llama'"),
    ("llama", {"use_sliding_window": True}, "use_sliding_window=true"),
    ("llama", {"query_pre_attn_scalar": 64}, "query_pre_attn_scalar=64"),
    ("llama", {"embedding_multiplier": 12.0}, "embedding_multiplier=12.0"),
    ("llama", {"residual_multiplier": 0.22}, "residual_multiplier=0.22"),
    ("llama", {"attention_multiplier": 0.015}, "attention_multiplier=0.015"),
    ("llama", {"logits_scaling": 8.0}, "logits_scaling=8.0"),
    ("llama", {"scale_emb": 12}, "scale_emb=12"),
    ("llama", {"no_rope_layers": [1, 1, 1, 0]}, "no_rope_layers"),
    ("qwen3", {"norm_topk_prob": True}, "norm_topk_prob=true, which the 'qwen3' architecture"),
    ("qwen3", {"mlp_only_layers": [0]}, "mlp_only_layers=\\[0\\]"),
    ("llama", {"routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5"),
    ("llama", {"scoring_func": "sigmoid"}, "scoring_func=\"sigmoid\""),
])
def test_a_field_the_family_does_not_compute_is_refused_by_name(arch: str, fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_hf_config(_config(arch, **fields))


def test_layer_norm_eps_without_rms_norm_eps_is_refused() -> None:
    cfg = _config("llama", layer_norm_eps=1e-5)
    del cfg["rms_norm_eps"]
    with pytest.raises(ValueError, match="layer_norm_eps but no rms_norm_eps"):
        from_hf_config(cfg)


def test_fields_at_neutral_values_and_honoured_fields_are_read() -> None:
    """Neutral values load (real checkpoints carry them); honoured fields reach the configuration as
    transformers reads them."""
    neutral = dict(mlp_bias=False, attn_logit_softcapping=None, partial_rotary_factor=1.0, use_qk_norm=False,
                   sliding_window=None, pretraining_tp=2, embedding_multiplier=1.0, clip_qkv=None)
    assert from_hf_config(_config("llama", **neutral)).mlp_bias is False
    assert from_hf_config(_config("llama", mlp_bias=True, head_dim=32)).head_dim == 32
    # transformers' Qwen2 biases q, k and v whatever attention_bias says
    assert from_hf_config(_config("qwen2", attention_bias=False)).attention_bias
    assert from_hf_config(_config("qwen3", attention_bias=True)).attention_bias
    # a family whose own reading covers a field (Gemma 3's caps, Mistral's window) is not refused for it
    assert from_hf_config(_config("mistral", sliding_window=8)).sliding_window(0) == 8


def test_experts_are_refused_for_a_family_without_them_and_run_for_qwen3_moe() -> None:
    """A Qwen3-MoE config runs as Qwen3-MoE (by class or by model_type); experts in a config of a dense family
    (a Qwen3 config.json carrying num_experts) are refused by name, not run as a dense model."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(num_experts=8, num_hidden_layers=2).to_dict()
    cfg = from_hf_config({**config, "architectures": ["Qwen3MoeForCausalLM"]})
    assert cfg.num_experts == 8
    assert registry.model_class(cfg).__name__ == "Qwen3MoeForCausalLM"
    assert registry.model_class(from_hf_config(config)).__name__ == "Qwen3MoeForCausalLM"
    dense = {**config, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    with pytest.raises(ValueError, match=r"'Qwen3ForCausalLM'\] with 8 experts is a mixture of experts"):
        registry.model_class(from_hf_config(dense))


@pytest.mark.parametrize(("arch", "metadata", "message"), [
    ("llama", {"rope.dimension_count": 32}, r"llama.rope.dimension_count=32 rotates part of each head of 64"),
    ("olmo2", {"attention.sliding_window": 4096}, r"olmo2.attention.sliding_window=4096 is not computed"),
    ("qwen2", {"final_logit_softcapping": 30.0}, r"qwen2.final_logit_softcapping=30.0"),
    ("llama", {"logit_scale": 0.5}, r"llama.logit_scale=0.5"),
    ("llama", {"embedding_scale": 12.0}, r"llama.embedding_scale=12.0"),
    ("llama", {"residual_scale": 0.2}, r"llama.residual_scale=0.2"),
    ("llama", {"attention.clamp_kqv": 8.0}, r"llama.attention.clamp_kqv=8.0"),
    ("llama", {"attention.layer_norm_epsilon": 1e-5}, r"layer_norm_epsilon without layer_norm_rms_epsilon"),
    ("qwen3moe", {"expert_gating_func": 2}, r"qwen3moe.expert_gating_func=2 is not computed"),
    ("qwen3moe", {"expert_shared_feed_forward_length": 256}, r"qwen3moe.expert_shared_feed_forward_length=256"),
    ("qwen3moe", {"expert_weights_scale": 2.5}, r"qwen3moe.expert_weights_scale=2.5"),
    ("qwen3moe", {"leading_dense_block_count": 1}, r"qwen3moe.leading_dense_block_count=1"),
])
def test_gguf_metadata_the_architecture_does_not_compute_is_refused_by_name(
    arch: str, metadata: dict, message: str,
) -> None:
    from pagedllm.loader.config_fields import check_unread_gguf_metadata

    with pytest.raises(ValueError, match=message):
        check_unread_gguf_metadata(metadata.get, arch, 64)
    # the neutral values llama.cpp's converter writes load
    neutral = {"rope.dimension_count": 64, "attention.sliding_window": 0, "logit_scale": 1.0,
               "attention.layer_norm_rms_epsilon": 1e-5}
    check_unread_gguf_metadata(neutral.get, arch, 64)
