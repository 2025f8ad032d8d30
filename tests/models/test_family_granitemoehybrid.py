"""Granite 4.0-H (``GraniteMoeHybridForCausalLM``, GGUF ``granitehybrid``) against transformers on tiny random weights.

One tiny checkpoint of the real config class: 4 layers, Mamba-2, attention,
Mamba-2, Mamba-2 (the published models' kind of mix), 8 Mamba heads of 16
in 2 groups of B/C, state 16, conv 4; 4 experts, top 2, a shared MLP; no
RoPE (Granite 4.0-H's ``position_embedding_type``); every Granite multiplier
away from 1 so that a multiplier applied twice or not at all changes the
tokens. ``A_log``, ``dt_bias``, ``D`` and the norms are drawn at random
(transformers starts them at fixed values, which would hide a swap).

transformers runs its own torch path on the CPU (the chunked scan and its
cache for decodes) in float32: pagedllm's greedy tokens must be its, and
every reported logprob within ``LOGPROB_TOL`` (only summation orders differ:
the chunked and recurrent scans, the experts' sums; measured ~1e-5). The
same from the files llama.cpp's converter writes (F32, F16: transformers then
runs the matrices rounded as the file stores them), from a prompt computed
in chunks of 16 and 64 tokens, and with prefix caching on and a shared
prefix (docs/hybrid-models.md: a state model takes no prefix hit yet, so
the second prompt is computed whole, and must still give its own tokens).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.layers.mamba2 import Mamba2Mixer
from pagedllm.loader import load_model_config
from pagedllm.models.granitemoehybrid import (
    GraniteMoeHybridForCausalLM,
    granite_hybrid_weight_names,
)

LOGPROB_TOL = 1e-4
GENERATED = 12
LAYERS = ["mamba", "attention", "mamba", "mamba"]
ENGINE = dict(max_model_len=256, num_kv_blocks=64, block_size=8, kv_cache_dtype="float32", max_num_seqs=4)


def _tiny_config():  # noqa: ANN202
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, layer_types=LAYERS, num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=48, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
        mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, embedding_multiplier=2.0,
        residual_multiplier=0.5, attention_multiplier=0.25, logits_scaling=2.0, position_embedding_type=None,
        rms_norm_eps=1e-6)


@pytest.fixture(scope="module")
def granite_dir(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> str:  # noqa: ANN001
    """The tiny checkpoint as a safetensors folder, its layer types named as the published config.json's."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(4321)
    model = AutoModelForCausalLM.from_config(_tiny_config(), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.uniform_(0.0, 2.0)
            elif name.endswith("dt_bias"):
                param.uniform_(-2.0, 0.5)
            elif name.endswith((".D", "norm.weight")):
                param.uniform_(0.5, 1.5)
    path = Path(tmp_path_factory.mktemp("tiny-granite-hybrid"))
    model.save_pretrained(path, safe_serialization=True)
    smollm_tokenizer.save_pretrained(path)
    # transformers saves "linear_attention" / "full_attention"; the published checkpoints (and llama.cpp's
    # converter, which looks for "attention") say "mamba" / "attention"
    config = json.loads((path / "config.json").read_text())
    config["layer_types"] = LAYERS
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def hf_model(granite_dir: str):  # noqa: ANN201
    return _hf(granite_dir)


def _hf(path: str, round_matrices_to_f16: bool = False):  # noqa: ANN202
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if round_matrices_to_f16:
        # the converter writes matrices (experts included) in the outtype; vectors, the conv and the router in F32
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if p.dim() >= 2 and "conv1d" not in name and "router" not in name:
                    p.copy_(p.half().float())
    return hf


def _prompts(seed: int, lengths: tuple[int, ...] = (70, 9)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in lengths]


def _max_logprob_error(hf, out) -> float:  # noqa: ANN001
    """Largest gap between pagedllm's logprobs (prompt and output, top 5 and chosen) and transformers'."""
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    with torch.inference_mode():
        want = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)
    prompt_len = len(out.prompt_token_ids)
    rows = [(i - 1, lps) for i, lps in enumerate(out.prompt_logprobs) if lps is not None]
    rows += [(prompt_len - 1 + i, lps) for i, lps in enumerate(out.outputs[0].logprobs)]
    return max(abs(lp.logprob - float(want[row, token])) for row, lps in rows for token, lp in lps.items())


def _check(llm: LLM, hf, prompts: list[list[int]], logprobs: bool = True,  # noqa: ANN001
           num_blocks: int = ENGINE["num_kv_blocks"]) -> None:
    """Greedy tokens equal transformers'; with ``logprobs``, every reported logprob within LOGPROB_TOL of its."""
    top = 5 if logprobs else None
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True, logprobs=top, prompt_logprobs=top)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, GENERATED)
        if logprobs:
            assert _max_logprob_error(hf, out) < LOGPROB_TOL
    assert llm.llm_engine.block_manager.num_free_blocks == num_blocks


def test_config_reads_the_hybrid(granite_dir: str) -> None:
    cfg = load_model_config(granite_dir)
    assert cfg.architecture == "granitemoehybrid"
    assert cfg.layer_types == ("mamba", "full_attention", "mamba", "mamba")
    assert cfg.attention_layers == (1,) and cfg.nope_layers == (0, 1, 2, 3)
    m = cfg.mamba
    assert (m.num_heads, m.head_dim, m.state_size, m.num_groups, m.conv_kernel, m.intermediate_size) == (
        8, 16, 16, 2, 4, 128)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.shared_expert_intermediate_size) == (4, 2, 48)
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attn_scale, cfg.logits_scaling) == (
        2.0, 0.5, 0.25, 2.0)


def test_without_experts_the_shared_mlp_is_the_dense_mlp() -> None:
    """num_local_experts 0: each layer's MLP is the shared MLP (its width, its tensors), as transformers runs it."""
    from pagedllm.layers.mlp import GatedMLP
    from pagedllm.loader.model_config import from_hf_config

    cfg = from_hf_config({**_tiny_config().to_dict(), "num_local_experts": 0, "layer_types": LAYERS})
    assert cfg.num_experts == 0 and cfg.shared_expert_intermediate_size == 48
    spec = GraniteMoeHybridForCausalLM.decoder_spec(cfg)
    assert all(layer.moe is None and layer.intermediate_size == 48 for layer in spec.layers)
    with torch.device("meta"):
        model = GraniteMoeHybridForCausalLM(cfg, None)
    assert isinstance(model.model.layers[0].mlp, GatedMLP)
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (96, 64)
    stacked = torch.arange(96 * 64, dtype=torch.float32).view(96, 64)
    names = dict(granite_hybrid_weight_names([("model.layers.0.shared_mlp.input_linear.weight", stacked)], False))
    assert torch.equal(names["model.layers.0.mlp.gate_proj.weight"], stacked[:48])
    assert torch.equal(names["model.layers.0.mlp.up_proj.weight"], stacked[48:])


def test_gguf_mamba_tensors_are_taken_back_to_the_modules_shapes() -> None:
    """The converter's A (-exp(A_log), [H, 1]), D [H, 1], conv [channels, width] and norm [groups, inner / groups]
    come back as A_log [H], D [H], conv1d.weight [channels, 1, width] and norm.weight [inner]."""
    a_log = torch.tensor([0.1, 0.7, 1.5])
    gguf = [("l.mamba.A", -torch.exp(a_log)[:, None]), ("l.mamba.D", torch.ones(3, 1)),
            ("l.mamba.conv1d.weight", torch.ones(6, 4)), ("l.mamba.norm.weight", torch.ones(2, 5))]
    names = dict(granite_hybrid_weight_names(gguf, True))
    torch.testing.assert_close(names["l.mamba.A_log"], a_log)
    assert names["l.mamba.D"].shape == (3,) and names["l.mamba.norm.weight"].shape == (10,)
    assert names["l.mamba.conv1d.weight"].shape == (6, 1, 4)


@pytest.fixture(scope="module")
def folder_llm(granite_dir: str) -> LLM:
    """One engine of the folder, prefix caching on, shared by the folder's tests."""
    return LLM(granite_dir, **ENGINE, enable_prefix_caching=True)


@pytest.mark.parametrize("native", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_folder_matches_transformers(native: bool, folder_llm: LLM, hf_model) -> None:  # noqa: ANN001
    """The folder's model, native kernels or torch layers: transformers' tokens and logprobs."""
    model = folder_llm.llm_engine.model_runner.model
    assert isinstance(model, GraniteMoeHybridForCausalLM)
    mixers = [layer.mamba for layer in model.model.layers if layer.is_mamba]
    assert len(mixers) == 3 and all(isinstance(m, Mamba2Mixer) for m in mixers)
    native_ops = folder_llm.llm_engine.model_runner.native_ops
    assert native_ops is not None and mixers[0].scan.native is not None  # float32: the native path
    if not native:
        model.use_native_ops(None)
    try:
        _check(folder_llm, hf_model, _prompts(5), logprobs=True)
    finally:
        model.use_native_ops(native_ops)


def test_a_shared_prefix_gives_each_prompts_tokens(folder_llm: LLM, hf_model) -> None:  # noqa: ANN001
    """Prefix caching on, two prompts sharing 48 tokens one after the other: each gets its own tokens."""
    prefix = _prompts(7, (48,))[0]
    first, second = prefix + _prompts(8, (11,))[0], prefix + _prompts(9, (5,))[0]
    _check(folder_llm, hf_model, [first], logprobs=False)
    _check(folder_llm, hf_model, [second], logprobs=False)


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_prompts_give_the_whole_prompts_tokens(chunk: int, granite_dir: str, hf_model) -> None:  # noqa: ANN001
    """A 150-token prompt computed 16 or 64 tokens a step (its state carried between chunks), beside another."""
    llm = LLM(granite_dir, **ENGINE, max_num_batched_tokens=chunk)
    _check(llm, hf_model, _prompts(6, (150, 20)), logprobs=False)


@pytest.mark.slow  # a third engine, three prompts recomputed
def test_preempted_sequences_give_their_tokens(granite_dir: str, hf_model) -> None:  # noqa: ANN001
    """Three 60-token prompts in a pool of 24 blocks of 8: decoding past 64 tokens preempts one (its blocks and
    state slot given back, its prompt computed again from zero later); every sequence still gets its tokens."""
    llm = LLM(granite_dir, **{**ENGINE, "num_kv_blocks": 24, "max_num_seqs": 3, "max_model_len": 128})
    _check(llm, hf_model, _prompts(10, (60, 60, 60)), logprobs=False, num_blocks=24)
    assert llm.llm_engine.scheduler.num_preemptions > 0


@pytest.mark.slow  # converts the checkpoint in a subprocess (seconds each)
# F16 only: the converter writes this family's own tensors (vectors, norms, A, D, the conv) in F32 in either outtype, so
# its F16 file holds both types; an all-F32 file's matrices are read as any family's (tests/models/
# test_gguf_converted.py's Llama F32 file)
@pytest.mark.parametrize("outtype", ["f16"])
def test_converter_gguf_matches_transformers(outtype: str, granite_dir: str, tmp_path_factory,  # noqa: ANN001
                                             gguf_converter) -> None:  # noqa: ANN001
    """llama.cpp's converter writes 'granitehybrid' (A as -exp(A_log), the conv squeezed, the gated norm per
    group, per-layer KV head counts): transformers' tokens and logprobs on float32 activations."""
    out = tmp_path_factory.mktemp("granite-hybrid-gguf") / f"granite-hybrid-{outtype}.gguf"
    path = gguf_converter.convert(granite_dir, outtype, str(out))
    cfg = load_model_config(path)
    assert (cfg.architecture, cfg.checkpoint_format) == ("granitehybrid", "gguf")
    assert cfg.layer_types == ("mamba", "full_attention", "mamba", "mamba")
    assert (cfg.mamba.num_heads, cfg.mamba.num_groups, cfg.mamba.state_size) == (8, 2, 16)
    llm = LLM(path, **ENGINE, gguf_activations="float32")
    assert isinstance(llm.llm_engine.model_runner.model, GraniteMoeHybridForCausalLM)
    _check(llm, _hf(granite_dir, round_matrices_to_f16=outtype == "f16"), _prompts(9))


def _q8_0_rounded(w: torch.Tensor) -> torch.Tensor:
    """``w`` as Q8_0 holds it (llama.cpp's reference quantizer, in float32): per run of 32 weights of a row,
    ``d = max |w| / 127``, ``q = roundf(w / d)`` (halves away from zero), ``d`` stored as float16."""
    blocks = w.float().reshape(*w.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    scaled = blocks * torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    return (d.half().float() * q).reshape(w.shape)


@pytest.mark.slow  # a converter run
def test_q8_0_gguf_matches_transformers_on_the_rounded_weights(granite_dir: str, tmp_path_factory,  # noqa: ANN001
                                                             gguf_converter) -> None:  # noqa: ANN001
    """A Q8_0 file (the Mamba and expert projections kept as Q8_0 blocks) on float32 activations: transformers'
    tokens on the weights rounded as the file rounds them (Q8_0 where a row is whole blocks of 32, else F16),
    logprobs within 2e-3 (the file's block scales are rounded to float16 on the way in and out)."""
    out = tmp_path_factory.mktemp("granite-hybrid-q8") / "granite-hybrid-q8_0.gguf"
    path = gguf_converter.convert(granite_dir, "q8_0", str(out))
    llm = LLM(path, **ENGINE, gguf_activations="float32")
    mixer = llm.llm_engine.model_runner.model.model.layers[0].mamba
    assert mixer.in_proj.quant_method.name == "gguf-q8_0"
    hf = _hf(granite_dir)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2 and "router" not in name and "conv1d" not in name:
                p.copy_(_q8_0_rounded(p) if p.shape[-1] % 32 == 0 else p.half().float())
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    prompt = _prompts(11)[0]
    got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == hf_greedy(hf, prompt, GENERATED)
    assert _max_logprob_error(hf, got) < 2e-3
