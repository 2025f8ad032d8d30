"""SmolLM3 (NoPE layers) and Granite (four multipliers) against transformers, from folders and converter GGUFs.

Tiny random checkpoints made with transformers' own config classes
(``SmolLM3Config``, ``GraniteConfig``), eight layers, seeded. SmolLM3 keeps
its default NoPE pattern (layers 3 and 7 unrotated), the one llama.cpp's
GGUF graph hard-codes; Granite's multipliers are far from 1 (embeddings x6,
branches x0.4, scores x0.05 instead of 16**-0.5 = 0.25, logits / 3) so that
each one moves the output. The oracle is transformers on the same weights
in float32 with its own KV cache (``hf_greedy``) and one forward for
logprobs; pagedllm runs float32 activations and a float32 KV cache, its
decode steps captured (native kernels), then again through torch's layers.
Greedy tokens must be equal, every reported logprob (prompt and output,
top 5) within ``LOGPROB_TOL``. Each check is shown to discriminate: the
model without the NoPE layers, or with any one multiplier at 1, is far
from pagedllm's logprobs.

The GGUF tests convert each folder with llama.cpp's ``convert_hf_to_gguf.py``
(``tests/gguf_convert.py``) to F32 and F16 and check the metadata read
(``smollm3``: no key, every fourth layer NoPE; ``granite.*_scale`` keys)
and the same tokens and logprobs against transformers on the weights as
stored (``_hf_as_stored``); they are slow (a converter run per file).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from conftest import CapturingLLM, hf_greedy
from test_gguf_converted import _hf_as_stored, _hf_logprobs, _max_logprob_error

from pagedllm import LLM, SamplingParams
from pagedllm.layers.decoder import DecoderLayerSpec, DecoderSpec
from pagedllm.layers.norm import NormSpec
from pagedllm.layers.rotary import RopeSpec
from pagedllm.layers.self_attention import AttentionSpec
from pagedllm.loader import load_model_config
from pagedllm.loader.model_config import ModelArchConfig, from_hf_config
from pagedllm.loader.smollm3_granite_config import gguf_family_fields
from pagedllm.models.llama import GraniteForCausalLM, SmolLM3ForCausalLM
from pagedllm.models.registry import MODEL_REGISTRY
from pagedllm.runner.capture.captured_decode import CapturedDecode
from pagedllm.runner.capture.decode_graph import num_programs

# float32 on both sides; measured worst gap ~1e-5 (the multiplied embeddings make the logits large)
LOGPROB_TOL = 1e-4
GENERATED = 12
ENGINE = dict(max_model_len=256, num_kv_blocks=64, block_size=8, kv_cache_dtype="float32", enable_prefix_caching=False)
GRANITE_MULTIPLIERS = dict(embedding_multiplier=6.0, residual_multiplier=0.4, attention_multiplier=0.05,
                           logits_scaling=3.0)
NOPE_LAYERS = (3, 7)  # SmolLM3's default: every fourth of eight layers


def _config(arch: str):  # noqa: ANN202
    from transformers import GraniteConfig, SmolLM3Config

    common = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.2,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    if arch == "smollm3":
        return SmolLM3Config(**common)
    return GraniteConfig(**common, **GRANITE_MULTIPLIERS)


@pytest.fixture(scope="session")
def smolgran_dirs(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> dict[str, str]:  # noqa: ANN001
    """The tiny SmolLM3 and Granite folders (seeded random weights, SmolLM2's tokenizer)."""
    from transformers import AutoModelForCausalLM

    dirs = {}
    for arch in ("smollm3", "granite"):
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32)
        path = tmp_path_factory.mktemp(f"tiny-{arch}")
        model.save_pretrained(path, safe_serialization=True)
        smollm_tokenizer.save_pretrained(path)
        dirs[arch] = str(path)
    return dirs


def _hf(path: str, **overrides: object):  # noqa: ANN202
    """transformers' model of the folder in float32, config fields replaced by ``overrides``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    for name, value in overrides.items():
        setattr(config, name, value)
    return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in (37, 5)]


def _generate(llm: LLM, prompts: list[list[int]]) -> list:
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _reference(hf, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:  # noqa: ANN001
    """Per prompt: transformers' greedy tokens (its own KV cache) and its one-forward logprobs over them."""
    refs = []
    for prompt in prompts:
        tokens = hf_greedy(hf, prompt, GENERATED)
        refs.append((tokens, _hf_logprobs(hf, prompt + tokens)))
    return refs


def _check_against(refs: list[tuple[list[int], torch.Tensor]], outs: list) -> None:
    """Greedy tokens equal the reference's, every reported logprob within LOGPROB_TOL of its logprobs."""
    for (tokens, logprobs), out in zip(refs, outs):
        assert out.outputs[0].token_ids == tokens
        assert _max_logprob_error(out, logprobs) < LOGPROB_TOL


def _variants(arch: str) -> dict[str, dict]:
    """The same weights with one of the family's differences undone (config overrides for transformers)."""
    if arch == "smollm3":
        return {"rope in every layer": {"no_rope_layers": [1] * 8}}
    return {name: {name: 1.0} for name in GRANITE_MULTIPLIERS}


@pytest.mark.parametrize("arch", ["smollm3", "granite"])
def test_folder_matches_transformers_captured_and_torch(arch: str, smolgran_dirs: dict[str, str]) -> None:
    """The folder's config is read (NoPE layers, multipliers); tokens and logprobs are transformers', with the
    decode steps captured on native kernels and again through torch's layers; each difference matters."""
    path = smolgran_dirs[arch]
    cfg = load_model_config(path)
    if arch == "smollm3":
        assert cfg.nope_layers == NOPE_LAYERS and cfg.attn_scale is None
    else:
        assert cfg.nope_layers == () and cfg.attn_scale == 0.05
        assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling) == (6.0, 0.4, 3.0)
    prompts = _prompts(seed=7)
    refs = _reference(_hf(path), prompts)
    llm = CapturingLLM(path, **ENGINE)
    runner = llm.llm_engine.model_runner
    outs = _generate(llm, prompts)
    _check_against(refs, outs)
    assert isinstance(runner.captured_decode, CapturedDecode) and runner.captured_decode.failed is None
    assert runner.captured_decode.num_traces == 1  # the decode steps above were replayed
    for graph in runner.captured_decode.graphs.values():
        # the NoPE layers and the residual multipliers are native program nodes; only Granite's embedding
        # scale (the shared blocks' torch multiply) is a Python call, between two programs
        assert len(graph.runs) == (1 if arch == "smollm3" else 3)
        assert num_programs(graph.runs) == (1 if arch == "smollm3" else 2)
    layers = runner.model.model.layers
    assert [i for i, layer in enumerate(layers) if layer.self_attn.qk_norm_rope.rotate is False] == list(cfg.nope_layers)

    # the same engine through torch's norms, RoPE and activations, eagerly
    runner.model.use_native_ops(None)
    runner.captured_decode = None
    _check_against(refs, _generate(llm, prompts))
    assert llm.llm_engine.block_manager.num_free_blocks == ENGINE["num_kv_blocks"]

    # discriminates: undo any one difference and transformers' logprobs move far from pagedllm's
    ids = prompts[0] + outs[0].outputs[0].token_ids
    for name, overrides in _variants(arch).items():
        gap = _max_logprob_error(outs[0], _hf_logprobs(_hf(path, **overrides), ids))
        assert gap > 100 * LOGPROB_TOL, (name, gap)


@pytest.fixture(scope="session")
def smolgran_gguf(smolgran_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory, gguf_converter):  # noqa: ANN001, ANN201
    """``(arch, outtype) -> path``: the folder converted by llama.cpp's converter, once per session."""
    from gguf_convert import ConvertedModels

    return ConvertedModels(smolgran_dirs, tmp_path_factory.mktemp("smolgran-gguf"), gguf_converter)


@pytest.mark.slow
# one outtype a family: what each reads from its file (NoPE layers, granite.*_scale keys, Q/K rows) is stored
# alike in F32 and F16 files, and each outtype's weights are read as any family's
@pytest.mark.parametrize(("arch", "outtype"), [("smollm3", "f32"), ("granite", "f16")])
def test_converted_gguf_matches_transformers(
    arch: str, outtype: str, smolgran_gguf, smolgran_dirs: dict[str, str],  # noqa: ANN001
) -> None:
    """The converter's file: its metadata read as llama.cpp reads it, its Q/K rows unpermuted, and
    transformers' tokens and logprobs on the weights as the file stores them."""
    path = smolgran_gguf(arch, outtype)
    cfg = load_model_config(path)
    assert cfg.architecture == arch and cfg.checkpoint_format == "gguf"
    if arch == "smollm3":
        assert cfg.nope_layers == NOPE_LAYERS  # no key: llama.cpp's fixed step of 4
    else:  # the converter's granite.*_scale keys, stored as float32
        f32 = {name: float(torch.tensor(v, dtype=torch.float32)) for name, v in GRANITE_MULTIPLIERS.items()}
        assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attn_scale, cfg.logits_scaling) == (
            f32["embedding_multiplier"], f32["residual_multiplier"], f32["attention_multiplier"], f32["logits_scaling"])
        assert cfg.nope_layers == ()
    prompts = _prompts(seed=13)
    refs = _reference(_hf_as_stored(smolgran_dirs[arch], path), prompts)
    llm = LLM(path, **ENGINE, gguf_activations="float32")
    _check_against(refs, _generate(llm, prompts))


# --- configuration and spec, no model ---------------------------------------------------------------

def _smollm3_dict(**extra: object) -> dict:
    return {"model_type": "smollm3", "architectures": ["SmolLM3ForCausalLM"], "vocab_size": 100, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, **extra}


def test_smollm3_config_reading() -> None:
    """``no_rope_layers`` (1 = RoPE) or every ``no_rope_layer_interval``-th layer; windows on the layers
    ``layer_types`` marks; SmolLM3's own default theta; malformed values refused by name."""
    defaults = from_hf_config(_smollm3_dict())
    assert defaults.nope_layers == (3,)  # SmolLM3Config's defaults for the keys left out
    assert (defaults.tie_word_embeddings, defaults.max_position_embeddings, defaults.num_key_value_heads) == (
        True, 32768, 4)
    assert from_hf_config(_smollm3_dict(no_rope_layer_interval=2)).nope_layers == (1, 3, 5)
    explicit = from_hf_config(_smollm3_dict(no_rope_layers=[0, 1, 1, 0, 1, 1, 1]))  # longer than the layers: ok
    assert explicit.nope_layers == (0, 3) and explicit.rope_theta == 2_000_000.0
    assert from_hf_config(_smollm3_dict(rope_theta=5e6)).rope_theta == 5e6
    windowed = from_hf_config(_smollm3_dict(use_sliding_window=True, sliding_window=16))
    assert windowed.sliding_windows == (None, None, None, 16, None, None)  # SmolLM3Config: the NoPE layers
    assert from_hf_config(_smollm3_dict(sliding_window=16)).sliding_windows == ()  # not switched on
    for bad, name in (({"no_rope_layers": [1, 1]}, "no_rope_layers"), ({"no_rope_layers": [2] * 6}, "no_rope_layers"),
                      ({"no_rope_layer_interval": 0}, "no_rope_layer_interval"),
                      ({"layer_types": ["sliding_attention"] * 6}, "sliding_window")):
        with pytest.raises(ValueError, match=name):
            from_hf_config(_smollm3_dict(**bad))


def test_granite_config_reading() -> None:
    """config.json's multipliers (transformers' defaults 1.0: a score scale of 1, not head_dim**-0.5); GGUF keys
    as llama.cpp reads them (logit_scale required, 0 or absent is no scaling, rope.scaling.finetuned a switch)."""
    base = {"model_type": "granite", "architectures": ["GraniteForCausalLM"], "vocab_size": 100, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4}
    plain = from_hf_config(base)
    assert (plain.attn_scale, plain.embedding_multiplier, plain.residual_multiplier, plain.logits_scaling) == (
        1.0, 1.0, 1.0, 1.0)
    read = from_hf_config({**base, "embedding_multiplier": 12, "residual_multiplier": 0.22,
                           "attention_multiplier": 0.0078125, "logits_scaling": 8})
    assert (read.attn_scale, read.embedding_multiplier, read.residual_multiplier, read.logits_scaling) == (
        0.0078125, 12.0, 0.22, 8.0)
    for name, value in (("residual_multiplier", 0), ("logits_scaling", -2.0), ("embedding_multiplier", float("nan")),
                        ("attention_multiplier", "1")):
        with pytest.raises(ValueError, match=name):
            from_hf_config({**base, name: value})

    gguf_base = dataclasses.replace(plain, architecture="granite", attn_scale=None, checkpoint_format="gguf")

    def fields(**keys: object) -> ModelArchConfig:
        return gguf_family_fields(gguf_base, keys.get)

    got = fields(logit_scale=8.0, embedding_scale=12.0, residual_scale=0.22, **{"attention.scale": 0.5})
    assert (got.logits_scaling, got.embedding_multiplier, got.residual_multiplier, got.attn_scale) == (
        8.0, 12.0, 0.22, 0.5)
    zeros = fields(logit_scale=2.0, embedding_scale=0.0, residual_scale=0.0, **{"attention.scale": 0.0})
    assert (zeros.embedding_multiplier, zeros.residual_multiplier, zeros.attn_scale) == (1.0, 1.0, None)
    assert fields(logit_scale=2.0).nope_layers == ()
    assert fields(logit_scale=2.0, **{"rope.scaling.finetuned": False}).nope_layers == (0, 1, 2)
    with pytest.raises(ValueError, match="logit_scale"):
        fields(embedding_scale=12.0)
    smollm3 = gguf_family_fields(dataclasses.replace(gguf_base, architecture="smollm3", num_hidden_layers=9), {}.get)
    assert smollm3.nope_layers == (3, 7)


def test_registry_and_specs() -> None:
    """Both families are found by either name; the specs carry the NoPE layers and the multipliers, and the
    shared blocks refuse what they cannot run."""
    for names, gguf, cls in ((("SmolLM3ForCausalLM",), "smollm3", SmolLM3ForCausalLM),
                             (("GraniteForCausalLM",), "granite", GraniteForCausalLM)):
        cfg = ModelArchConfig(gguf, 100, 32, 64, 8, 4, 2, 8, 1e-6, 1e4, 64, False, architectures=names,
                              nope_layers=(1, 5), residual_multiplier=0.5, embedding_multiplier=3.0,
                              logits_scaling=2.0, attn_scale=0.1)
        assert MODEL_REGISTRY.model_class(cfg) is cls
        assert MODEL_REGISTRY.model_class(dataclasses.replace(cfg, checkpoint_format="gguf")) is cls
        spec = cls.decoder_spec(cfg)
        assert [i for i, layer in enumerate(spec.layers) if layer.rope_table is None] == [1, 5]
        assert all(layer.attention.rope == (layer.rope_table is not None) for layer in spec.layers)
        if cls is GraniteForCausalLM:
            assert {layer.residual_multiplier for layer in spec.layers} == {0.5}
            assert {layer.attention.scale for layer in spec.layers} == {0.1}
            assert (spec.embed_scale, spec.logits_scaling) == (3.0, 2.0)
            ones = cls.decoder_spec(dataclasses.replace(cfg, residual_multiplier=1.0, embedding_multiplier=1.0,
                                                        logits_scaling=1.0))
            assert (ones.layers[0].residual_multiplier, ones.embed_scale, ones.logits_scaling) == (None, None, None)
        else:
            assert spec.embed_scale is None and spec.logits_scaling is None
    for name, value in (("nope_layers", (8,)), ("residual_multiplier", 0.0), ("logits_scaling", float("inf"))):
        with pytest.raises(ValueError, match=name):
            ModelArchConfig("granite", 100, 32, 64, 8, 4, 2, 8, 1e-6, 1e4, 64, False, **{name: value})
    attention = AttentionSpec(32, 4, 2, 8)
    with pytest.raises(ValueError, match="residual multiplier"):
        DecoderSpec(100, 32, (DecoderLayerSpec(attention, 64, "silu", NormSpec(1e-6), post_norms=True,
                                               residual_multiplier=0.5),), NormSpec(1e-6), {"default": RopeSpec(8, 64, 1e4)})
    with pytest.raises(ValueError, match="logits_scaling"):
        DecoderSpec(100, 32, (), NormSpec(1e-6), logits_scaling=0.0)
