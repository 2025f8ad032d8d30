"""Gemma 2 and Gemma 3 (text) from Hugging Face folders and from llama.cpp's converter's GGUF files, against transformers.

Tiny random checkpoints of the real config classes, tied as Gemma ships:
Gemma 2 with 4 layers (even ones sliding, as Gemma2Config lays them out),
a score softcap of 3 and a final logit softcap of 3, both small enough to
matter; Gemma 3 with 7 layers (every sixth global, the layout llama.cpp
assumes for a GGUF file), linear RoPE scaling on its global layer and
another base on its sliding ones. Both have a window of 8 tokens, shorter
than the prompts. Every norm weight is random (transformers initialises
Gemma's to 0, where ``1 + w`` and ``w`` would be told apart only by a
constant) and the embedding is scaled down, so that a tied model's hidden
state is not its input token's embedding and greedy tokens vary.
``query_pre_attn_scalar`` is the head size, as in the released 2B-12B
models: a GGUF file does not carry it (``loader/gguf_gemma.py``).

Engines compute in float32 with a float32 KV cache (``gguf_activations``
float32 for the files); greedy tokens must be transformers' and every
logprob pagedllm reports (prompt and output, top 5) within ``LOGPROB_TOL``
of transformers' one-forward logprobs, transformers running the folder's
weights rounded as the file stores them (float16 for ``f16``).

The Gemma 2 converter reads a SentencePiece ``tokenizer.model`` only: its
folder gets one, trained here in a subprocess with the converter's own
``sentencepiece`` (which the test process must not import,
``tests/gguf_convert.py``), Gemma's settings (no dummy prefix, whitespace
kept, byte fallback); the Gemma 3 folder keeps SmolLM2's BPE
``tokenizer.json``, which that converter takes as is.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import CapturingLLM, hf_greedy
from gguf_convert import read_gguf

from pagedllm import LLM, SamplingParams
from pagedllm.loader import load_model_config
from pagedllm.loader.gguf_gemma import gemma_gguf_settings
from pagedllm.loader.model_config import from_hf_config

ARCHS = ("gemma2", "gemma3")
WINDOW = 8
CAP = 3.0  # Gemma 2's score cap, and both families' final logit cap
GENERATED = 12
# float32 activations and KV on both sides, the same (rounded) weights: only summation order differs
LOGPROB_TOL = 1e-4
ENGINE = dict(max_model_len=128, num_kv_blocks=64, block_size=8, kv_cache_dtype="float32")
GEMMA2_LAYERS = ("sliding_attention", "full_attention") * 2
GEMMA3_LAYERS = ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
TOKENIZER_TEXTS = ["The quick brown fox, 33 times.", "café naïve résumé", " lazy dog jumps 7 times!\n  x"]


def _config(arch: str):  # noqa: ANN202
    from transformers import Gemma2Config, Gemma3TextConfig

    common = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, tie_word_embeddings=True, sliding_window=WINDOW, query_pre_attn_scalar=32,
        final_logit_softcapping=CAP,
    )
    if arch == "gemma2":
        return Gemma2Config(**common, num_hidden_layers=4, attn_logit_softcapping=CAP)
    return Gemma3TextConfig(
        **common, num_hidden_layers=7,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 20_000.0}},
    )


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> dict[str, str]:  # noqa: ANN001
    """arch -> a tiny random folder (seeded): random norm weights, the embedding scaled by 0.3."""
    from transformers import AutoModelForCausalLM

    dirs = {}
    for arch in ARCHS:
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.3)
            model.model.embed_tokens.weight.mul_(0.3)
        path = tmp_path_factory.mktemp(f"tiny-{arch}")
        model.save_pretrained(path, safe_serialization=True)
        smollm_tokenizer.save_pretrained(path)
        dirs[arch] = str(path)
    return dirs


def _hf(folder: str, gguf_path: str | None = None, **overrides: object):  # noqa: ANN202
    """transformers' model of the folder (eager attention, the one Gemma's softcap needs), its matrices rounded
    as ``gguf_path`` stores them; ``overrides`` change its config."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                              **overrides).eval()
    if gguf_path is not None and any(t.tensor_type.name == "F16" for t in read_gguf(gguf_path).tensors):
        with torch.no_grad():
            for p in hf.parameters():
                if p.dim() == 2:  # the converter writes matrices in the outtype, vectors in F32
                    p.copy_(p.half().float())
    return hf


@pytest.fixture(scope="module")
def hf_models(gemma_dirs: dict[str, str]) -> dict:
    return {arch: _hf(path) for arch, path in gemma_dirs.items()}


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in lengths]


def _generate(llm: LLM, prompts: list[list[int]], prompt_logprobs: int | None = 5) -> list:
    """Greedy outputs with top-5 logprobs (and the prompt's: a request asking for them skips the prefix cache)."""
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True, logprobs=5,
                            prompt_logprobs=prompt_logprobs)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _max_logprob_error(out, hf) -> float:  # noqa: ANN001
    """Largest gap between pagedllm's reported logprobs (prompt and output, top 5 and chosen) and transformers'."""
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.inference_mode():
        want = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)
    prompt_len = len(out.prompt_token_ids)
    rows = [(i - 1, lps) for i, lps in enumerate(out.prompt_logprobs or ()) if lps is not None]
    rows += [(prompt_len - 1 + i, lps) for i, lps in enumerate(out.outputs[0].logprobs)]
    return max(abs(lp.logprob - float(want[row, token])) for row, lps in rows for token, lp in lps.items())


def _assert_matches(outs: list, prompts: list[list[int]], hf) -> None:  # noqa: ANN001
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, GENERATED)
        assert _max_logprob_error(out, hf) < LOGPROB_TOL


def test_gemma2_config_reads_as_transformers(gemma_dirs: dict[str, str]) -> None:
    cfg = load_model_config(gemma_dirs["gemma2"])
    assert cfg.layer_types == GEMMA2_LAYERS and cfg.sliding_windows == (WINDOW, None, WINDOW, None)
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (CAP, CAP)
    assert cfg.attn_scale == 32**-0.5 and cfg.hidden_act == "gelu_pytorch_tanh" and not cfg.qk_norm
    # an older config.json: no layer_types (even layers slide), Gemma2Config's defaults for what it leaves out
    old = {k: v for k, v in _config("gemma2").to_dict().items()
           if k not in ("layer_types", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")}
    cfg = from_hf_config({**old, "num_hidden_layers": 3})
    assert cfg.sliding_windows == (WINDOW, None, WINDOW)
    assert (cfg.attn_scale, cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (256**-0.5, 50.0, 30.0)
    # null softcaps are no softcaps; a scalar that cannot scale and bidirectional attention are refused
    cfg = from_hf_config({**old, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (None, None)
    for bad in ({"query_pre_attn_scalar": 0}, {"use_bidirectional_attention": True}, {"sliding_window": None}):
        with pytest.raises(ValueError):
            from_hf_config({**old, **bad})


@pytest.mark.parametrize("arch", ["gemma2", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_gemma_folder_matches_transformers(arch: str, gemma_dirs: dict[str, str], hf_models: dict) -> None:
    """Greedy tokens and logprobs from the folder, decode steps captured where they can be (Gemma 3; Gemma 2's
    capped scores fall back to the uncaptured path); for Gemma 2 both caps are shown to matter."""
    prompts = _prompts([40, 9], seed=5)
    llm = CapturingLLM(gemma_dirs[arch], **ENGINE)
    outs = _generate(llm, prompts)
    _assert_matches(outs, prompts, hf_models[arch])
    captured = llm.llm_engine.model_runner.captured_decode
    assert (captured is None) == (arch == "gemma2")
    if arch == "gemma2":
        uncapped = _hf(gemma_dirs[arch], attn_logit_softcapping=None)
        assert outs[0].outputs[0].token_ids != hf_greedy(uncapped, prompts[0], GENERATED)
        # the final cap is monotonic: invisible to greedy tokens, plain in the logprobs
        assert _max_logprob_error(outs[0], _hf(gemma_dirs[arch], final_logit_softcapping=None)) > 0.1


@pytest.mark.slow
def test_gemma2_softcap_on_prefix_hits_and_chunks(gemma_dirs: dict[str, str], hf_models: dict) -> None:
    """Capped scores in prompts that continue cached context: prefix-cache hits and chunked prefills."""
    prefix = _prompts([24], seed=11)[0]
    prompts = [prefix + tail for tail in _prompts([5, 12], seed=12)]
    llm = LLM(gemma_dirs["gemma2"], **ENGINE, max_num_batched_tokens=7)
    first = _generate(llm, prompts[:1], prompt_logprobs=None)
    rest = _generate(llm, prompts[1:], prompt_logprobs=None)
    assert rest[0].num_cached_tokens == 24
    _assert_matches(first + rest, prompts, hf_models["gemma2"])


def _key(values: dict) -> object:
    return lambda name: values.get(name)


def test_gemma_gguf_metadata_reads_as_llama_cpp() -> None:
    """Layer kinds, window, score scale, softcaps and local RoPE base from a file's keys, and their defaults."""
    def read(arch: str, values: dict, layers: int = 6, max_position: int = 8192) -> dict:
        return gemma_gguf_settings(_key(values), arch, layers, 64, 4, 32, max_position)

    gemma2 = read("gemma2", {})
    assert gemma2["sliding_windows"] == (4096, None) * 3 and gemma2["layer_types"][:2] == GEMMA2_LAYERS[:2]
    assert (gemma2["attn_logit_softcapping"], gemma2["final_logit_softcapping"]) == (50.0, 30.0)
    assert gemma2["attn_scale"] == 32**-0.5 and "local_rope_theta" not in gemma2
    assert read("gemma2", {}, max_position=4096)["sliding_windows"] == (None,) * 6  # a window covering every position
    gemma3 = read("gemma3", {"attention.sliding_window": 8, "final_logit_softcapping": 3.0}, layers=7)
    assert gemma3["layer_types"] == GEMMA3_LAYERS and gemma3["sliding_windows"][5:] == (None, 8)
    assert (gemma3["attn_logit_softcapping"], gemma3["final_logit_softcapping"]) == (None, 3.0)
    assert gemma3["local_rope_theta"] == 10_000.0 and read("gemma3", {"rope.freq_base_swa": 5.0})["local_rope_theta"] == 5.0
    assert read("gemma3", {})["sliding_windows"] == (None,) * 6  # no window written: every layer global
    pattern = read("gemma3", {"attention.sliding_window": 8, "attention.sliding_window_pattern": [True, False] * 3})
    assert pattern["sliding_windows"] == (8, None) * 3
    assert read("gemma3", {"attention.sliding_window": 8, "attention.sliding_window_pattern": 3})["layer_types"][2] \
        == "full_attention"
    # the 27B models (46 / 62 layers) scale by (hidden / heads) ** -0.5, a written attention.scale wins
    assert read("gemma2", {}, layers=46)["attn_scale"] == 16**-0.5
    assert read("gemma3", {}, layers=62)["attn_scale"] == 16**-0.5
    assert read("gemma3", {"attention.scale": 0.25})["attn_scale"] == 0.25
    for bad in ({"attention.sliding_window_pattern": [True] * 5}, {"attention.sliding_window_pattern": 0},
                {"attention.sliding_window": -1}):
        with pytest.raises(ValueError):
            read("gemma2", bad)
    with pytest.raises(ValueError):
        gemma_gguf_settings(_key({}), "llama", 6, 64, 4, 32, 1024)


# --- GGUF files of llama.cpp's converter --------------------------------------------------------------------

_TRAIN_TOKENIZER = """
import json, sys
import sentencepiece as spm
out, texts = sys.argv[1], json.loads(sys.argv[2])
corpus = ["The quick brown fox jumps over the lazy dog %d times." % i for i in range(200)]
corpus += ["café naïve résumé, 33 times!"] * 10
spm.SentencePieceTrainer.train(
    sentence_iterator=iter(corpus), model_prefix=out + "/tokenizer", vocab_size=400, model_type="bpe",
    byte_fallback=True, add_dummy_prefix=False, remove_extra_whitespaces=False,
    normalization_rule_name="identity", split_digits=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3, minloglevel=2)
sp = spm.SentencePieceProcessor(model_file=out + "/tokenizer.model")
print(json.dumps([sp.encode(t) for t in texts]))
"""


def _with_sentencepiece_tokenizer(folder: str, dest: str) -> list[list[int]]:
    """A copy of ``folder`` at ``dest`` with a trained Gemma-style ``tokenizer.model``; the model's ids of
    TOKENIZER_TEXTS."""
    from gguf_convert import converter_deps_dir

    shutil.copytree(folder, dest)
    env = {**os.environ, "PYTHONPATH": str(converter_deps_dir())}
    done = subprocess.run([sys.executable, "-c", _TRAIN_TOKENIZER, dest, json.dumps(TOKENIZER_TEXTS)],
                          capture_output=True, text=True, env=env, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"training the test tokenizer failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def gemma_gguf(gemma_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory, gguf_converter):  # noqa: ANN001, ANN201
    """``(arch, outtype) -> path``, converted once each; ``.expected_ids``: the Gemma 2 tokenizer's ids of
    TOKENIZER_TEXTS."""
    from gguf_convert import ConvertedModels

    tmp = tmp_path_factory.mktemp("gemma-gguf")
    folders = dict(gemma_dirs)
    folders["gemma2"] = str(tmp / "gemma2-spm")
    converted = ConvertedModels(folders, tmp, gguf_converter)
    converted.expected_ids = _with_sentencepiece_tokenizer(gemma_dirs["gemma2"], folders["gemma2"])
    return converted


def _norm_offsets(path: str, folder: str) -> float:
    """Largest ``|file - (1 + folder)|`` over the norm weights: the converter's convention, checked on the file."""
    from safetensors.torch import load_file

    stored = {t.name: np.asarray(t.data, np.float32) for t in read_gguf(path).tensors if t.name.endswith("norm.weight")}
    weights = load_file(os.path.join(folder, "model.safetensors"))
    pairs = [("output_norm.weight", "model.norm.weight"), ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
             ("blk.0.ffn_norm.weight", "model.layers.0.pre_feedforward_layernorm.weight"),
             ("blk.0.post_ffw_norm.weight", "model.layers.0.post_feedforward_layernorm.weight")]
    return max(float(np.abs(stored[g] - (1.0 + weights[h].numpy())).max()) for g, h in pairs)


# Gemma 2's F16 file and both of Gemma 3's: what a family reads from the file (its metadata, norms, names,
# tokenizer) does not depend on the outtype, and Gemma 3's F32 file shows the unrounded weights' path
@pytest.mark.slow  # converts checkpoints in subprocesses (seconds each), fetches the converter once
@pytest.mark.parametrize(("arch", "outtype"), [("gemma2", "f16"), ("gemma3", "f32"), ("gemma3", "f16")])
def test_gemma_gguf_matches_transformers(arch: str, outtype: str, gemma_gguf, gemma_dirs: dict[str, str]) -> None:  # noqa: ANN001
    """The converter's file: its metadata read as the folder's config, its norms (``1 + w``) run as stored, its
    names, its tokenizer; greedy tokens and logprobs of transformers on the weights as stored."""
    path, folder = gemma_gguf(arch, outtype), gemma_dirs[arch]
    assert _norm_offsets(path, folder) == 0.0
    cfg, want = load_model_config(path), load_model_config(folder)
    for field in ("sliding_windows", "layer_types", "attn_scale", "attn_logit_softcapping",
                  "final_logit_softcapping", "rope_theta", "local_rope_theta", "hidden_act", "qk_norm",
                  "tie_word_embeddings", "head_dim"):
        assert getattr(cfg, field) == getattr(want, field), field
    assert cfg.checkpoint_format == "gguf" and cfg.rope_scaling == (None if arch == "gemma2" else
                                                                    {"rope_type": "linear", "factor": 4.0})
    prompts = _prompts([40, 9], seed=6)
    llm = LLM(path, **ENGINE, gguf_activations="float32")
    outs = _generate(llm, prompts)
    _assert_matches(outs, prompts, _hf(folder, path))
    if arch == "gemma2":
        # the converter's SentencePiece vocabulary, read back by pagedllm, tokenizes as the model it came from
        tokenizer = llm.get_tokenizer()
        assert [tokenizer.encode(t, add_special_tokens=False) for t in TOKENIZER_TEXTS] == gemma_gguf.expected_ids
