"""Gemma 4 text (``Gemma4ForCausalLM``, model_type ``gemma4_text``) against transformers on the same tiny random weights.

Tiny random checkpoints of transformers' own ``Gemma4TextConfig``: hidden 64,
three layers (sliding, sliding, global), a window of 8 tokens under prompts
of 33, global layers with heads of 32 beside the sliding layers' 16
(``per_layer_config``), proportional RoPE on a quarter of the global head.
The dense one has a v projection everywhere; the one with experts (4
experts, top 2, beside the dense MLP in every layer, as 26B-A4B) shares
values with keys on its global layer (``attention_k_eq_v``), with one kv
head there against two on the sliding layers. Every norm weight, layer
scalar, router scale and per-expert scale is drawn at random, so a norm
applied as ``1 + w``, a scalar or scale left out, or a wrong expert changes
the logprobs. A Gemma4ForConditionalGeneration folder (the Hub's form, with
a tiny vision tower) runs its text model.

On float32 activations (the native kernels): transformers' greedy tokens
(its own KV cache) and every reported logprob within ``LOGPROB_TOL``
(only summation order differs, measured ~5e-6).
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import hf_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.layers.gemma4_layer import Gemma4DecoderLayer
from pagedllm.loader import load_model_config
from pagedllm.loader.model_config import from_hf_config
from pagedllm.models.gemma4 import Gemma4ForCausalLM

LOGPROB_TOL = 1e-4
GENERATED = 12
WINDOW = 8
ENGINE = dict(max_model_len=256, num_kv_blocks=64, block_size=8, kv_cache_dtype="float32")
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"]


def _tiny_config(**overrides: object):  # noqa: ANN202
    from transformers import Gemma4TextConfig

    fields = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, global_head_dim=32, layer_types=LAYER_TYPES,
                  sliding_window=WINDOW, hidden_size_per_layer_input=0, max_position_embeddings=1024,
                  final_logit_softcapping=30.0, tie_word_embeddings=True, initializer_range=0.2, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    return Gemma4TextConfig(**{**fields, **overrides})


def _save(config, path, tokenizer, seed: int) -> str:  # noqa: ANN001
    """A tiny random model of ``config`` saved as a safetensors folder; norms and scales drawn from [0.5, 1.5)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or name.endswith(("layer_scalar", "router.scale", "per_expert_scale")):
                tensor.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def gemma4_dense_dir(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> str:  # noqa: ANN001
    """31B's shape: global layers with larger heads and their own v projection."""
    return _save(_tiny_config(), tmp_path_factory.mktemp("tiny-gemma4"), smollm_tokenizer, 1234)


@pytest.fixture(scope="module")
def gemma4_moe_dir(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> str:  # noqa: ANN001
    """26B-A4B's shape: experts beside the MLP, values shared with keys on the global layer (one kv head)."""
    config = _tiny_config(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                          attention_k_eq_v=True, num_global_key_value_heads=1)
    return _save(config, tmp_path_factory.mktemp("tiny-gemma4-moe"), smollm_tokenizer, 4321)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in (33, 7)]


def _max_logprob_error(hf, out) -> float:  # noqa: ANN001
    """Largest gap between pagedllm's logprobs (prompt and output, top 5 and chosen) and transformers'."""
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    with torch.inference_mode():
        want = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)
    prompt_len = len(out.prompt_token_ids)
    rows = [(i - 1, lps) for i, lps in enumerate(out.prompt_logprobs) if lps is not None]
    rows += [(prompt_len - 1 + i, lps) for i, lps in enumerate(out.outputs[0].logprobs)]
    return max(abs(lp.logprob - float(want[row, token])) for row, lps in rows for token, lp in lps.items())


def _check_against_transformers(path: str, prompts: list[list[int]], hf=None) -> LLM:  # noqa: ANN001
    """Greedy tokens equal transformers' (``hf``, else the folder's causal LM); every reported logprob within
    ``LOGPROB_TOL`` of its; no block leaked."""
    from transformers import AutoModelForCausalLM

    if hf is None:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, GENERATED)
        assert _max_logprob_error(hf, out) < LOGPROB_TOL
    assert llm.llm_engine.block_manager.num_free_blocks == ENGINE["num_kv_blocks"]
    return llm


def test_gemma4_dense_folder_matches_transformers(gemma4_dense_dir: str) -> None:
    """Sliding layers of 2 kv heads of 16, a global one of 2 of 32 rotated proportionally; one cache shape."""
    cfg = load_model_config(gemma4_dense_dir)
    assert (cfg.architecture, cfg.global_head_dim, cfg.num_global_key_value_heads, cfg.attention_k_eq_v) == (
        "gemma4", 32, 2, False)
    assert cfg.sliding_windows == (WINDOW, WINDOW, None) and cfg.num_experts == 0
    assert cfg.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    assert (cfg.cache_kv_heads, cfg.cache_head_dim) == (2, 32)
    llm = _check_against_transformers(gemma4_dense_dir, _prompts(5))
    model = llm.llm_engine.model_runner.model
    assert isinstance(model, Gemma4ForCausalLM) and isinstance(model.model.layers[0], Gemma4DecoderLayer)
    assert model.model.layers[2].self_attn.v_proj is not None
    assert tuple(llm.llm_engine.model_runner.kv_caches[0][0].shape[-2:]) == (2, 32)


def test_gemma4_moe_folder_matches_transformers(gemma4_moe_dir: str) -> None:
    """Experts beside the MLP in every layer (4, top 2, per-expert scales); the global layer's values are its
    keys' projection, its one kv head repeated into the cache's two."""
    cfg = load_model_config(gemma4_moe_dir)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (4, 2, 32, True)
    assert (cfg.attention_k_eq_v, cfg.attention_shape(0), cfg.attention_shape(2)) == (True, (2, 16), (1, 32))
    llm = _check_against_transformers(gemma4_moe_dir, _prompts(9))
    layer = llm.llm_engine.model_runner.model.model.layers[2]
    assert layer.self_attn.v_proj is None and layer.self_attn.kv_repeat == 2
    assert layer.experts.gate_up.out_features == 4 * 2 * 32 and layer.mlp.gate_up_proj.out_features == 2 * 96
    _check_expert_load(llm, gemma4_moe_dir)


def _check_expert_load(llm: LLM, path: str) -> None:
    """Every layer's expert counts (what /metrics and bench show) equal the top-2 choices of transformers' own
    routers over the same tokens (a prompt, then each generated token but the last, each computed once)."""
    from transformers import AutoModelForCausalLM

    load = llm.llm_engine.model_runner.expert_load
    assert load is not None and load.layers == [0, 1, 2]  # experts in every layer, beside the dense MLP
    load.reset()
    prompt = _prompts(21)[0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    computed = prompt + list(out.outputs[0].token_ids)[:-1]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    chosen: list[torch.Tensor] = []  # each router's top-k indices, layer by layer
    routers = [m for name, m in hf.named_modules() if type(m).__name__ == "Gemma4TextRouter"]
    hooks = [r.register_forward_hook(lambda _m, _i, o: chosen.append(o[2])) for r in routers]
    with torch.inference_mode():
        hf(input_ids=torch.tensor([computed]))
    for h in hooks:
        h.remove()
    counts = load.counts()
    assert len(chosen) == 3 and counts.num_steps == 4  # one prefill, then a decode per generated token but one
    want = [torch.bincount(ids.reshape(-1), minlength=4).tolist() for ids in chosen]
    assert [list(row) for row in counts.tokens] == want


@pytest.fixture(scope="module")
def gemma4_multimodal_dir(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> str:  # noqa: ANN001
    """A Gemma4ForConditionalGeneration (the Hub's form: text model under ``model.language_model``, a tiny vision
    tower beside it) around the dense text shape."""
    from transformers import Gemma4Config, Gemma4VisionConfig

    vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=16)
    config = Gemma4Config(text_config=_tiny_config(), vision_config=vision, audio_config=None)
    return _save(config, tmp_path_factory.mktemp("tiny-gemma4-multimodal"), smollm_tokenizer, 777)


def test_gemma4_multimodal_folder_runs_its_text_model(gemma4_multimodal_dir: str) -> None:
    """A Gemma4ForConditionalGeneration folder: its text_config read, ``model.language_model.*`` loaded, the
    vision tower left out; on text prompts, transformers' (the whole multimodal model's) tokens and logprobs."""
    from transformers import Gemma4ForConditionalGeneration

    cfg = load_model_config(gemma4_multimodal_dir)
    assert (cfg.architecture, cfg.architectures, cfg.global_head_dim) == (
        "gemma4", ("Gemma4ForConditionalGeneration",), 32)
    hf = Gemma4ForConditionalGeneration.from_pretrained(gemma4_multimodal_dir, dtype=torch.float32).eval()
    _check_against_transformers(gemma4_multimodal_dir, _prompts(11)[:1], hf)


_BASE = dict(model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], vocab_size=512, hidden_size=64,
             intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             hidden_size_per_layer_input=0, layer_types=["sliding_attention", "full_attention"], sliding_window=8)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"hidden_size_per_layer_input": 256}, "per-layer embeddings"),
    ({"hidden_size_per_layer_input": None}, "per-layer embeddings"),  # transformers' default (256) applies
    ({"num_kv_shared_layers": 1}, "num_kv_shared_layers"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ({"model_type": "gemma4"}, "text_config"),
    ({"per_layer_config": {"1": {"sliding_window": 4}}}, "per_layer_config"),
    ({"per_layer_config": {"0": {"head_dim": 32}}}, "per_layer_config"),
    ({"query_pre_attn_scalar": 256}, "query_pre_attn_scalar"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
])
def test_gemma4_refuses_what_it_does_not_compute(overrides: dict, message: str) -> None:
    """Each Gemma 4 feature not computed here is a ValueError naming it, not another model run in its place."""
    cfg = {**_BASE, **overrides}
    if overrides.get("hidden_size_per_layer_input", 0) is None:
        del cfg["hidden_size_per_layer_input"]
    with pytest.raises(ValueError, match=message):
        from_hf_config(cfg)


def test_gemma4_config_defaults_as_transformers() -> None:
    """Without layer_types, per_layer_config or rope_parameters: every sixth layer global and the last forced
    global, global heads of 512 (``global_head_dim``'s default), proportional RoPE on a quarter."""
    cfg = {**_BASE, "num_hidden_layers": 8}
    del cfg["layer_types"]
    read = from_hf_config(cfg)
    full = tuple(i for i, t in enumerate(read.layer_types) if t == "full_attention")
    assert full == (5, 7) and read.attention_shape(7) == (2, 512) and read.attention_shape(0) == (2, 16)
    assert (read.rope_theta, read.local_rope_theta, read.local_rope_scaling) == (1_000_000.0, 10_000.0, None)
    assert read.attn_scale == 1.0
