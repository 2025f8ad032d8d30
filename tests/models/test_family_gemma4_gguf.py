"""Gemma 4 text from GGUF files made by llama.cpp's own converter (architecture ``gemma4``), against transformers.

The tiny random checkpoints of ``test_family_gemma4.py`` (hidden 64, layers
sliding, sliding, global; global heads of 32 beside the sliding layers' 16,
proportional RoPE on a quarter of the global head; the dense 31B shape, and
the 26B-A4B shape with 4 experts, top 2, beside the MLP and values shared
with keys on the global layer), with a vocabulary of 512 and a Gemma-style
tokenizer (BPE with byte fallback, the only kind the converter's Gemma 4
vocabulary reader takes), converted by ``gguf_converter`` to F32 and F16.

On float32 activations: transformers' greedy tokens and every reported
logprob within ``LOGPROB_TOL`` (the folder test's), against transformers on
the weights as the file holds them (F16 rounds every matrix but the
router's, which the converter keeps F32). The file's own tokenizer encodes
as the folder's.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import hf_greedy
from test_family_gemma4 import LOGPROB_TOL, WINDOW, _max_logprob_error, _save, _tiny_config

from pagedllm import LLM, SamplingParams
from pagedllm.loader import load_model_config

VOCAB = 512
GENERATED = 12
ENGINE = dict(max_model_len=256, num_kv_blocks=64, block_size=8, kv_cache_dtype="float32",
              gguf_activations="float32")
TEXT = "The quick brown fox jumps, said the cat, 33 times: café!"


def _gemma_style_tokenizer():  # noqa: ANN202
    """A BPE tokenizer with byte fallback (Gemma's kind), VOCAB tokens: specials, trained merges, 256 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    corpus = [f"The quick brown fox jumps over the lazy dog {i} times, said the cat." for i in range(300)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=VOCAB - 256,
                                                        special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"]))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    if len(vocab) != VOCAB - 256:
        raise RuntimeError(f"the trainer made {len(vocab)} tokens, not {VOCAB - 256}")
    vocab.update({f"<0x{b:02X}>": VOCAB - 256 + b for b in range(256)})
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), pad_token="<pad>",
                                   eos_token="<eos>", bos_token="<bos>", unk_token="<unk>")


@pytest.fixture(scope="module")
def gemma4_ggufs(tmp_path_factory: pytest.TempPathFactory, gguf_converter) -> object:  # noqa: ANN001
    """``(shape, outtype) -> path`` ("dense" / "moe", "f32" / "f16"), each converted once; ``.folders``."""
    tmp = tmp_path_factory.mktemp("tiny-gemma4-gguf")
    tokenizer = _gemma_style_tokenizer()
    moe = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
               attention_k_eq_v=True, num_global_key_value_heads=1)
    folders = {"dense": _save(_tiny_config(vocab_size=VOCAB), tmp / "dense", tokenizer, 1234),
               "moe": _save(_tiny_config(vocab_size=VOCAB, **moe), tmp / "moe", tokenizer, 4321)}

    class Files(dict):
        def __missing__(self, key: tuple[str, str]) -> str:
            shape, outtype = key
            self[key] = gguf_converter.convert(folders[shape], outtype, str(tmp / f"gemma4-{shape}-{outtype}.gguf"))
            return self[key]

    files = Files()
    files.folders = folders
    return files


def _hf(path: str, round_to_f16: bool):  # noqa: ANN202
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if round_to_f16:  # the converter writes matrices in the outtype, the router and every vector in F32
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if p.dim() >= 2 and not name.endswith("router.proj.weight"):
                    p.copy_(p.half().float())
    return hf


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, VOCAB) for _ in range(n)] for n in (33, 7)]


def _check(llm: LLM, hf, prompts: list[list[int]]) -> None:  # noqa: ANN001
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, GENERATED)
        assert _max_logprob_error(hf, out) < LOGPROB_TOL
    assert llm.llm_engine.block_manager.num_free_blocks == ENGINE["num_kv_blocks"]


@pytest.mark.slow  # the converter runs in a subprocess (seconds a file)
@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_gemma4_dense_gguf_matches_transformers(outtype: str, gemma4_ggufs) -> None:  # noqa: ANN001
    """31B's shape from the file: the sliding layers' heads from ``key_length_swa``, the global layer's from
    ``key_length``, proportional RoPE from the ``rope_freqs`` tensor (global layers only), a v projection
    everywhere; the file's tokenizer encodes as the folder's."""
    from transformers import AutoTokenizer

    path = gemma4_ggufs["dense", outtype]
    cfg = load_model_config(path)
    assert (cfg.architecture, cfg.head_dim, cfg.num_key_value_heads) == ("gemma4", 16, 2)
    assert (cfg.global_head_dim, cfg.num_global_key_value_heads, cfg.attention_k_eq_v) == (32, 2, False)
    assert cfg.sliding_windows == (WINDOW, WINDOW, None) and cfg.num_experts == 0
    assert cfg.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    assert cfg.rope_freq_factors == () and (cfg.rope_theta, cfg.local_rope_theta) == (1_000_000.0, 10_000.0)
    assert (cfg.attn_scale, cfg.final_logit_softcapping, cfg.tie_word_embeddings) == (1.0, 30.0, True)
    llm = LLM(path, **ENGINE)
    folder = gemma4_ggufs.folders["dense"]
    assert llm.get_tokenizer().encode(TEXT) == AutoTokenizer.from_pretrained(folder).encode(TEXT)
    _check(llm, _hf(folder, outtype == "f16"), _prompts(5))


@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_gemma4_moe_gguf_matches_transformers(outtype: str, gemma4_ggufs) -> None:  # noqa: ANN001
    """26B-A4B's shape from the file: per-layer kv heads ([2, 2, 1]), no ``attn_v`` on the global layer (values
    are the keys' projection), the experts' stacked gate_up split per expert, the router's scales and the
    per-expert scales; F16 experts held as F16 blocks, the router in float32."""
    path = gemma4_ggufs["moe", outtype]
    cfg = load_model_config(path)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (4, 2, 32, True)
    assert (cfg.attention_k_eq_v, cfg.attention_shape(0), cfg.attention_shape(2)) == (True, (2, 16), (1, 32))
    assert cfg.dense_layers == ()
    llm = LLM(path, **ENGINE)
    layer = llm.llm_engine.model_runner.model.model.layers[2]
    assert layer.self_attn.v_proj is None and layer.self_attn.kv_repeat == 2
    assert layer.experts.gate_up.out_features == 4 * 2 * 32
    if outtype == "f16":
        assert layer.experts.gate_up.quant_method.name == "gguf-f16"
        assert layer.experts.down.qweight.dtype == torch.uint8
    _check(llm, _hf(gemma4_ggufs.folders["moe"], outtype == "f16"), _prompts(9))


# --- what the reader refuses, on metadata-only files (no conversion) ---------------------------------------------

_KEYS = dict(block_count=2, embedding_length=64, feed_forward_length=96, vocab_size=8, **{
    "attention.head_count": 4, "attention.head_count_kv": [2, 1], "attention.key_length": 32,
    "attention.key_length_swa": 16, "attention.sliding_window": 8, "attention.sliding_window_pattern": [True, False],
    "rope.freq_base": 1_000_000.0, "rope.freq_base_swa": 10_000.0, "rope.dimension_count_swa": 16,
})


def _metadata_file(path: str, keys: dict, rope_freqs: list[float]) -> str:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path, "gemma4")
    for name, value in keys.items():
        if value is None:
            continue
        full = f"gemma4.{name}"
        if isinstance(value, list):
            writer.add_array(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        else:
            writer.add_uint32(full, value)
    writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


_ROPE_FREQS = [1.0] * 4 + [1e30] * 12


@pytest.mark.parametrize(("overrides", "rope_freqs", "message"), [
    ({"embedding_length_per_layer_input": 256}, _ROPE_FREQS, "per-layer embeddings"),
    ({"attention.shared_kv_layers": 1}, _ROPE_FREQS, "KV sharing"),
    ({"feed_forward_length": [96, 192]}, _ROPE_FREQS, "per-layer MLP widths"),
    ({"attention.sliding_window_pattern": [True]}, _ROPE_FREQS, "one bool per layer"),
    ({"attention.key_length_swa": None}, _ROPE_FREQS, "key_length_swa"),
    ({"rope.dimension_count_swa": 8}, _ROPE_FREQS, "dimension_count_swa"),
    ({}, [1.0] * 4 + [2.0] * 12, "ones"),
    ({}, [1.0] * 8, "pairs"),
])
def test_gemma4_gguf_refuses_what_it_does_not_compute(overrides: dict, rope_freqs: list[float], message: str,
                                                      tmp_path) -> None:  # noqa: ANN001
    """Each Gemma 4 feature not computed here (E2B/E4B's per-layer embeddings, KV sharing, per-layer MLP widths)
    and metadata that cannot be a Gemma 4 file's: a ValueError naming it."""
    path = _metadata_file(str(tmp_path / "gemma4.gguf"), {**_KEYS, **overrides}, rope_freqs)
    with pytest.raises(ValueError, match=message):
        load_model_config(path)


def test_gemma4_gguf_metadata_reads_both_shapes(tmp_path) -> None:  # noqa: ANN001
    """The same metadata unchanged: the sliding layer's 2 kv heads of 16, the global layer's 1 of 32, a window
    of 8 on the sliding layer only, a quarter of the global head rotated (4 of its 16 pairs)."""
    cfg = load_model_config(_metadata_file(str(tmp_path / "gemma4.gguf"), _KEYS, _ROPE_FREQS))
    assert (cfg.attention_shape(0), cfg.attention_shape(1), cfg.sliding_windows) == ((2, 16), (1, 32), (8, None))
    assert cfg.layer_types == ("sliding_attention", "full_attention")
    assert cfg.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    assert cfg.attention_k_eq_v  # the file has no attn_v for its global layer
