"""The Phi-3 family (``Phi3ForCausalLM``) from Hugging Face folders and from llama.cpp's converter, against transformers.

Two tiny random checkpoints made with transformers' own ``Phi3Config``:

- ``phi35``: Phi-3.5-mini's shape of RoPE (``longrope``, short and long
  factors, ``original_max_position_embeddings`` 64 of 1024 positions, so
  the attention factor is sqrt(1 + ln 16 / ln 64)), untied, every layer
  masked by a sliding window of 48 (Phi-3-mini sets one);
- ``phi4mini``: Phi-4-mini's: ``partial_rotary_factor`` 0.75 (12 of 16
  dimensions rotated, so its longrope factors are 6 long), tied embeddings.

Both carry SmolLM2's tokenizer with ``GPT2Tokenizer`` named in
``tokenizer_config.json``, as Phi-4-mini's files name it: the converter then
reads the vocabulary as GPT-2 BPE (with another class it wants Phi-3.5's
sentencepiece ``tokenizer.model``, which a BPE tokenizer does not have).

Both store q/k/v and gate/up fused (``qkv_proj``, ``gate_up_proj``), as the
converter's files do (``attn_qkv``, ``ffn_up``). Prompts of 100 tokens and
20 generated run past the original context (64), where transformers takes
``long_factor`` for the whole sequence: pagedllm's greedy tokens must be
transformers', and every logprob it reports (prompt and output, top 5)
within ``LOGPROB_TOL`` of transformers' one-forward logprobs (float32 on
both sides; F16 files against transformers on the same float16-rounded
weights). A short sequence (within the original context) runs pagedllm's
one table, the long factors (``layers/rotary.py``): it is checked against
transformers with ``short_factor`` replaced by ``long_factor``, and shown to
differ from transformers' own short-factor output, so the check discriminates.
"""

from __future__ import annotations

import json
import math
import os
import random
from types import SimpleNamespace

import pytest
import torch
from conftest import hf_greedy
from gguf_convert import read_gguf

from pagedllm import LLM, SamplingParams
from pagedllm.layers.rotary import rope_parameters
from pagedllm.layers.weights import split_fused_checkpoint
from pagedllm.loader import load_model_config
from pagedllm.loader.model_config import from_hf_config

# float32 activations and KV cache on both sides: only summation order differs (measured ~1e-5)
LOGPROB_TOL = 1e-4
ORIGINAL = 64
GENERATED = 20
WINDOW = 48
ENGINE = dict(max_model_len=256, num_kv_blocks=64, block_size=8, kv_cache_dtype="float32")
SHORT = {"phi35": [1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0], "phi4mini": [1.0, 1.1, 1.2, 1.3, 1.5, 1.7]}
LONG = {"phi35": [1.0, 1.2, 1.6, 2.5, 4.0, 6.0, 9.0, 12.0], "phi4mini": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}


def _phi3_config(name: str):  # noqa: ANN202
    from transformers import Phi3Config

    rope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=SHORT[name], long_factor=LONG[name])
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  original_max_position_embeddings=ORIGINAL, rms_norm_eps=1e-5, initializer_range=0.2,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, rope_parameters=rope)
    if name == "phi35":
        return Phi3Config(**common, tie_word_embeddings=False, sliding_window=WINDOW)
    return Phi3Config(**common, tie_word_embeddings=True, partial_rotary_factor=0.75)


@pytest.fixture(scope="session")
def phi3_dirs(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> dict[str, str]:  # noqa: ANN001
    """The two tiny Phi-3 folders (seeded random weights, SmolLM2's tokenizer)."""
    from transformers import AutoModelForCausalLM

    dirs = {}
    for name in ("phi35", "phi4mini"):
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(_phi3_config(name), dtype=torch.float32)
        path = tmp_path_factory.mktemp(f"tiny-{name}")
        model.save_pretrained(path, safe_serialization=True)
        smollm_tokenizer.save_pretrained(path)
        # as Phi-4-mini's tokenizer_config.json names it; Phi-3.5's ships a sentencepiece tokenizer.model
        # instead, which the converter reads when the class is another: these carry SmolLM2's BPE
        config_path = os.path.join(path, "tokenizer_config.json")
        with open(config_path) as f:
            tok_config = json.load(f)
        tok_config["tokenizer_class"] = "GPT2Tokenizer"
        with open(config_path, "w") as f:
            json.dump(tok_config, f)
        dirs[name] = str(path)
    return dirs


def _hf(path: str, gguf_path: str | None = None, long_only: bool = False):  # noqa: ANN202
    """transformers' model of the folder (float32); with ``gguf_path`` its matrices rounded as the file stores
    them; ``long_only``: ``short_factor`` replaced by ``long_factor`` (every length takes the long factors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if long_only:
        config.rope_parameters = {**config.rope_parameters, "short_factor": config.rope_parameters["long_factor"]}
    hf = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    if gguf_path is not None:
        matrix_types = {t.tensor_type.name for t in read_gguf(gguf_path).tensors if len(t.shape) == 2}
        assert len(matrix_types) == 1, matrix_types
        if matrix_types == {"F16"}:
            with torch.no_grad():
                for p in hf.parameters():
                    if p.dim() == 2:
                        p.copy_(p.half().float())
    return hf


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in lengths]


def _max_logprob_error(out, hf, ids: list[int]) -> float:  # noqa: ANN001
    """Largest gap between pagedllm's reported logprobs (prompt and output, top 5 and chosen) and transformers'."""
    with torch.inference_mode():
        want = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)
    prompt_len = len(out.prompt_token_ids)
    rows = [(i - 1, lps) for i, lps in enumerate(out.prompt_logprobs) if lps is not None]
    rows += [(prompt_len - 1 + i, lps) for i, lps in enumerate(out.outputs[0].logprobs)]
    return max(abs(lp.logprob - float(want[row, token])) for row, lps in rows for token, lp in lps.items())


def _check_against(llm: LLM, hf, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:  # noqa: ANN001
    """pagedllm's greedy tokens equal ``hf``'s and its logprobs are within LOGPROB_TOL; returns the tokens."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = []
    for prompt, out in zip(prompts, outs):
        got = out.outputs[0].token_ids
        assert got == hf_greedy(hf, prompt, max_tokens)
        assert _max_logprob_error(out, hf, prompt + got) < LOGPROB_TOL
        tokens.append(got)
    return tokens


def test_phi3_config_and_rope_tables(phi3_dirs: dict[str, str]) -> None:
    """The folders read as transformers' Phi3Config does: longrope with the top-level original context, the
    partial rotation, the window; the RoPE frequencies and attention factor are transformers' long ones."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for name, rotated in (("phi35", 16), ("phi4mini", 12)):
        cfg = load_model_config(phi3_dirs[name])
        assert cfg.architecture == "phi3" and cfg.rope_scaling["rope_type"] == "longrope"
        assert cfg.rope_scaling["original_max_position_embeddings"] == ORIGINAL
        assert int(cfg.head_dim * cfg.partial_rotary_factor) == rotated
        assert cfg.tie_word_embeddings == (name == "phi4mini")
        assert cfg.sliding_windows == ((WINDOW, WINDOW) if name == "phi35" else ())
        hf_config = AutoConfig.from_pretrained(phi3_dirs[name])
        want_freq, want_factor = ROPE_INIT_FUNCTIONS["longrope"](hf_config, torch.device("cpu"), seq_len=ORIGINAL + 1)
        inv_freq, factor = rope_parameters(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                           cfg.rope_scaling, partial_rotary_factor=cfg.partial_rotary_factor)
        assert inv_freq.shape == (rotated // 2,)
        torch.testing.assert_close(inv_freq, want_freq, rtol=0, atol=0)
        assert factor == want_factor == pytest.approx(math.sqrt(1 + math.log(1024 / ORIGINAL) / math.log(ORIGINAL)))


def test_phi4mini_folder_matches_transformers(phi3_dirs: dict[str, str]) -> None:
    """The fast tier's case: partial rotation (torch), tied head, fused projections split, longrope past the
    original context; transformers' greedy tokens and logprobs."""
    llm = LLM(phi3_dirs["phi4mini"], **ENGINE)
    assert llm.llm_engine.model_runner.model.model.layers[0].self_attn.native is None  # partial: torch
    _check_against(llm, _hf(phi3_dirs["phi4mini"]), _prompts([72], seed=6), 8)


@pytest.mark.slow  # two engines, five generations with prompt logprobs (~30 s on two busy cores)
def test_phi3_folders_match_transformers(phi3_dirs: dict[str, str]) -> None:
    """Both folders: transformers' greedy tokens and logprobs past the original context (the long factors, the
    window, the partial rotation in torch, the fused projections split); a short sequence is the long table's."""
    for name in ("phi35", "phi4mini"):
        hf = _hf(phi3_dirs[name])
        llm = LLM(phi3_dirs[name], **ENGINE)
        layer = llm.llm_engine.model_runner.model.model.layers[0].self_attn
        # a partial rotation runs in torch (the native pass rotates whole heads); a whole one natively where built
        assert layer.qk_norm_rope.rotary_dim == (12 if name == "phi4mini" else 16)
        if name == "phi4mini":
            assert layer.native is None
        assert layer.sliding_window == (WINDOW if name == "phi35" else None)
        _check_against(llm, hf, _prompts([100, 70], seed=7), GENERATED)
        # within the original context: the long table, as documented (transformers would take short_factor)
        short_prompt = _prompts([30], seed=8)
        ours = _check_against(llm, _hf(phi3_dirs[name], long_only=True), short_prompt, 10)
        assert ours[0] != hf_greedy(hf, short_prompt[0], 10)


def test_phi3_bad_configs_are_refused() -> None:
    """A RoPE type Phi-3 does not take, and a partial rotation of an odd number of dimensions, are ValueErrors;
    a fused tensor of the wrong rows is one too, and so is a tensor-parallel load."""
    base = dict(model_type="phi3", architectures=["Phi3ForCausalLM"], vocab_size=10, hidden_size=64,
                intermediate_size=32, num_hidden_layers=1, num_attention_heads=4)
    with pytest.raises(ValueError, match="phi3: unsupported rope_type 'dynamic'"):
        from_hf_config({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    cfg = from_hf_config({**base, "partial_rotary_factor": 0.7})  # 16 * 0.7 -> 11 dimensions
    from pagedllm.models.phi3 import Phi3ForCausalLM

    with pytest.raises(ValueError, match="even number"):
        Phi3ForCausalLM.decoder_spec(cfg)
    parts = {"qkv_proj": (("q_proj", 4), ("k_proj", 2), ("v_proj", 2))}
    split = dict(split_fused_checkpoint([("l.self_attn.qkv_proj.weight", torch.arange(16.0).view(8, 2))], parts))
    assert split["l.self_attn.k_proj.weight"].tolist() == [[8.0, 9.0], [10.0, 11.0]]
    with pytest.raises(ValueError, match="7 rows"):
        list(split_fused_checkpoint([("l.self_attn.qkv_proj.weight", torch.zeros(7, 2))], parts))
    # tensor parallelism is refused before any tensor is read (a rank holds only its own head counts)
    rank = SimpleNamespace(tp=SimpleNamespace(plan=SimpleNamespace(size=2)))
    with pytest.raises(ValueError, match="tensor parallelism"):
        Phi3ForCausalLM.load_weights(rank, iter(()))


@pytest.mark.slow  # converts the checkpoints in subprocesses (seconds each), fetches the converter once
def test_phi3_converted_gguf_match_transformers(phi3_dirs: dict[str, str], tmp_path_factory, gguf_converter) -> None:  # noqa: ANN001
    """llama.cpp's converter's F32 and F16 files of both checkpoints (attn_qkv, ffn_up, rope_factors_short/long,
    attn_factor, rope.dimension_count, sliding_window): transformers' tokens and logprobs on the file's weights."""
    from gguf_convert import ConvertedModels

    converted = ConvertedModels(phi3_dirs, tmp_path_factory.mktemp("phi3-gguf"), gguf_converter)
    folder_configs = {name: load_model_config(path) for name, path in phi3_dirs.items()}
    prompts = _prompts([100], seed=9)
    for name in ("phi35", "phi4mini"):
        hf_folder = phi3_dirs[name]
        for outtype in ("f32", "f16"):
            path = converted(name, outtype)
            cfg, want = load_model_config(path), folder_configs[name]
            assert cfg.architecture == "phi3" and cfg.checkpoint_format == "gguf"
            assert cfg.partial_rotary_factor == want.partial_rotary_factor
            assert cfg.sliding_windows == want.sliding_windows and cfg.tie_word_embeddings == want.tie_word_embeddings
            # the factors as the file stores them (float32), the converter's attention factor
            assert cfg.rope_scaling["long_factor"] == pytest.approx(LONG[name], rel=1e-7)
            assert cfg.rope_scaling["short_factor"] == pytest.approx(SHORT[name], rel=1e-7)
            freq, factor = rope_parameters(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                           cfg.rope_scaling, partial_rotary_factor=cfg.partial_rotary_factor)
            want_freq, want_factor = rope_parameters(want.head_dim, want.max_position_embeddings, want.rope_theta,
                                                     want.rope_scaling,
                                                     partial_rotary_factor=want.partial_rotary_factor)
            torch.testing.assert_close(freq, want_freq, rtol=0, atol=0)
            assert factor == pytest.approx(want_factor, rel=1e-7)
            llm = LLM(path, **ENGINE, gguf_activations="float32")
            if outtype == "f16":  # the fused F16 attn_qkv / ffn_up kept as stored, split by rows of blocks
                mlp = llm.llm_engine.model_runner.model.model.layers[0].mlp
                assert mlp.gate_up_proj.quant_method.name.startswith("gguf-f16")
            _check_against(llm, _hf(hf_folder, path), prompts, GENERATED)
            del llm
