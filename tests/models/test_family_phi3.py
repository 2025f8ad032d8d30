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
converter's files do (``attn_qkv``, ``ffn_up``). The original context is 32
positions, so that "long" is a short prompt. transformers chooses longrope's
factors per forward (its largest position + 1 past the original length: the
long ones), keeping cached keys as they were rotated; pagedllm chooses per
token as it would (``layers/rotary.py``). Prompts of 40-60 tokens run long,
prompts of 12-20 tokens (and what they generate) short, a prompt of 28 crosses
while it generates, and a batch mixes them: pagedllm's greedy tokens must be
transformers' (its own KV-cached decoding, ``hf_greedy``), and every logprob
it reports (prompt and output, top 5) within ``LOGPROB_TOL`` of transformers'
one-forward logprobs where one forward takes the same factors (float32 on
both sides; F16 files against transformers on the same float16-rounded
weights). Each case is also shown to differ from transformers with the other
set of factors, so the checks discriminate.
"""

from __future__ import annotations

import json
import math
import os
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import hf_greedy
from gguf_convert import read_gguf

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.shard_plan import ShardPlan
from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.sequence import Sequence
from pagedllm.layers.rotary import RotaryEmbedding, longrope_rows, rope_parameters
from pagedllm.layers.weights import split_fused_checkpoint
from pagedllm.loader import load_model_config
from pagedllm.loader.model_config import from_hf_config
from pagedllm.runner.input_batch import InputBatch
from pagedllm.step_record import SamplingSpec, SequenceStep

# float32 activations and KV cache on both sides: only summation order differs (measured ~1e-5)
LOGPROB_TOL = 1e-4
ORIGINAL = 32
GENERATED = 20
WINDOW = 24
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


def _hf(path: str, gguf_path: str | None = None, only: str | None = None):  # noqa: ANN202
    """transformers' model of the folder (float32); with ``gguf_path`` its matrices rounded as the file stores
    them; ``only`` "long" / "short": both factor sets replaced by that one (every length takes it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if only is not None:
        factors = config.rope_parameters[f"{only}_factor"]
        config.rope_parameters = {**config.rope_parameters, "short_factor": factors, "long_factor": factors}
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


def _check_against(llm: LLM, hf, prompts: list[list[int]], max_tokens: int, logprobs: bool = True):  # noqa: ANN001, ANN202
    """pagedllm's greedy tokens equal ``hf``'s and (with ``logprobs``) its logprobs are within LOGPROB_TOL of
    ``hf``'s one forward; returns the tokens of each prompt."""
    top = 5 if logprobs else None
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=top, prompt_logprobs=top)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = []
    for prompt, out in zip(prompts, outs):
        got = out.outputs[0].token_ids
        assert got == hf_greedy(hf, prompt, max_tokens)
        if logprobs:
            assert _max_logprob_error(out, hf, prompt + got) < LOGPROB_TOL
        tokens.append(got)
    return tokens


def test_phi3_config_and_rope_tables(phi3_dirs: dict[str, str]) -> None:
    """The folders read as transformers' Phi3Config does: longrope with the top-level original context, the
    partial rotation, the window; the RoPE frequencies and attention factor are transformers' short and long
    ones, and the table's rows are its rotary embedding's: positions below the original length with the short
    factors, then every position with the long ones."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    for name, rotated in (("phi35", 16), ("phi4mini", 12)):
        cfg = load_model_config(phi3_dirs[name])
        assert cfg.architecture == "phi3" and cfg.rope_scaling["rope_type"] == "longrope"
        assert cfg.rope_scaling["original_max_position_embeddings"] == ORIGINAL == cfg.longrope_switch_len
        assert int(cfg.head_dim * cfg.partial_rotary_factor) == rotated
        assert cfg.tie_word_embeddings == (name == "phi4mini")
        assert cfg.sliding_windows == ((WINDOW, WINDOW) if name == "phi35" else ())
        hf_config = AutoConfig.from_pretrained(phi3_dirs[name])
        args = (cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        for long_factors, seq_len in ((False, None), (True, ORIGINAL + 1)):
            want_freq, want_factor = ROPE_INIT_FUNCTIONS["longrope"](hf_config, torch.device("cpu"), seq_len=seq_len)
            inv_freq, factor = rope_parameters(*args, partial_rotary_factor=cfg.partial_rotary_factor,
                                               long_factors=long_factors)
            assert inv_freq.shape == (rotated // 2,)
            torch.testing.assert_close(inv_freq, want_freq, rtol=0, atol=0)
            assert factor == want_factor == pytest.approx(math.sqrt(1 + math.log(1024 / ORIGINAL) / math.log(ORIGINAL)))
        table = RotaryEmbedding(*args, partial_rotary_factor=cfg.partial_rotary_factor)
        table.build_tables(ENGINE["max_model_len"])
        assert table.switch_len == ORIGINAL and table.cos.shape == (ORIGINAL + ENGINE["max_model_len"], rotated)
        hf_rotary = Phi3RotaryEmbedding(hf_config)
        sign = torch.cat([-torch.ones(rotated // 2), torch.ones(rotated // 2)])
        with torch.inference_mode():  # one call per set: its largest position chooses the factors
            for rows, num_positions in ((slice(0, ORIGINAL), ORIGINAL), (slice(ORIGINAL, None), 256)):
                cos, sin = hf_rotary(torch.zeros(1), torch.arange(num_positions).unsqueeze(0))
                assert torch.equal(table.cos[rows], cos[0]) and torch.equal(table.sin[rows], sin[0] * sign)


def test_longrope_rows_are_each_tokens_own() -> None:
    """A token takes the long rows when its sequence's prompt is longer than the original length or its own
    position reaches it, the short rows otherwise; the runner's rows come from its sequences' prompt lengths."""
    positions = np.array([0, 5, 31, 0, 31, 32, 33, 31])
    num_prompt = np.array([20, 20, 20, 33, 33, 20, 40, 32])
    assert longrope_rows(positions, num_prompt, 32).tolist() == [0, 5, 31, 32, 63, 64, 65, 31]
    spec = SamplingSpec(0.0, 0, 1.0, 0.0, None)
    # a chunk of a 40-token prompt below the original length, and a short prompt's decode past it
    steps = [SequenceStep("a", 8, (1,) * 4, (0, 1, 2), spec, num_prompt_tokens=40),
             SequenceStep("b", 32, (7,), (3, 4, 5, 6, 7), spec, num_prompt_tokens=20)]
    batch = InputBatch(8, torch.device("cpu"), longrope_switch_len=ORIGINAL)
    _, positions, _ = batch.build(steps)
    assert positions.tolist() == [8, 9, 10, 11, 32]
    assert batch.rope_rows(steps, positions).tolist() == [40, 41, 42, 43, 64]
    assert InputBatch(8, torch.device("cpu")).rope_rows(steps, positions) is positions  # one set: the positions


def test_long_prompts_hash_their_own_prefix_chain() -> None:
    """A long prompt's blocks (long factors at every position) are never a short prompt's cache hit, nor the
    other way round; prompts of one kind share blocks as before."""
    short, long_ = list(range(100, 108)), list(range(100, 112))  # 8 tokens (short), 12 (long), same start
    managers = {}
    for switch_len in (8, None):
        bm = managers[switch_len] = BlockManager(16, 4, longrope_switch_len=switch_len)
        first = Sequence(short + [1], 4)  # 9 tokens: long too; its blocks of the short tokens are long ones
        bm.allocate(first)
        bm.cache_full_blocks(first, len(first))
    assert managers[8].num_cached_prefix_tokens(Sequence(long_, 4)) == 8  # long meets long
    assert managers[8].num_cached_prefix_tokens(Sequence(short, 4)) == 0  # short does not meet long
    assert managers[None].num_cached_prefix_tokens(Sequence(short, 4)) == 4  # without the switch: one chain


@pytest.fixture(scope="module")
def phi35_engine(phi3_dirs: dict[str, str]) -> LLM:
    """Phi-3.5's shape (whole-head rotation: the native q/k pass), decode steps captured from the first, and
    prompts prefilled in chunks of 16 tokens (a long prompt's first chunks lie below the original length)."""
    return LLM(phi3_dirs["phi35"], **ENGINE, capture_min_decode_steps=0, max_num_batched_tokens=16)


def test_longrope_factors_per_sequence_match_transformers(phi3_dirs: dict[str, str], phi35_engine: LLM) -> None:
    """(a) a short prompt, (b) a long one, (c) both in one batch with a prompt that crosses the original length
    while it generates: each gets transformers' tokens (and logprobs, but for the crossing one, which one
    forward cannot give); a short prompt is cached before the long one that starts with it, which must not
    reuse its blocks. Each differs from transformers with the other factors."""
    llm, hf = phi35_engine, _hf(phi3_dirs["phi35"])
    runner = llm.llm_engine.model_runner
    assert runner.model.model.layers[0].self_attn.native is not None  # float32: the native q/k pass
    assert runner.model.model.rotary.switch_len == ORIGINAL
    short, long_, crossing = _prompts([17, 60, 28], seed=11)
    long_ = short + long_[17:]  # starts with the short prompt's two full blocks
    want_short = _check_against(llm, hf, [short], 8)  # (a): 25 positions, all short; its blocks cached
    # (b): chunked, all long; first without prompt logprobs, so that a wrong prefix-cache hit could happen
    assert _check_against(llm, hf, [long_], 8, logprobs=False) == _check_against(llm, hf, [long_], 8)
    assert llm.llm_engine.block_manager.num_prefix_hits == 0
    want_long = hf_greedy(hf, long_, 8)
    assert want_short[0] != hf_greedy(_hf(phi3_dirs["phi35"], only="long"), short, 8)
    assert want_long != hf_greedy(_hf(phi3_dirs["phi35"], only="short"), long_, 8)
    # (c): the same in one batch, each now hitting its own cached blocks
    assert _check_against(llm, hf, [short, long_], 8, logprobs=False) == [want_short[0], want_long]
    assert llm.llm_engine.block_manager.num_prefix_hits > 0
    # and a prompt crossing the original length at its 5th token, beside a short one
    ours = _check_against(llm, hf, [crossing, short], 10, logprobs=False)[0]
    assert ours != hf_greedy(_hf(phi3_dirs["phi35"], only="short"), crossing, 10)
    captured = runner.captured_decode
    assert captured.failed is None and captured.graphs  # the decode steps ran from the captured graph
    assert llm.llm_engine.block_manager.num_used_blocks == 0


def test_phi4mini_folder_matches_transformers(phi3_dirs: dict[str, str]) -> None:
    """The fast tier's case: partial rotation (torch), tied head, fused projections split, longrope past the
    original context; transformers' greedy tokens and logprobs."""
    llm = LLM(phi3_dirs["phi4mini"], **ENGINE)
    assert llm.llm_engine.model_runner.model.model.layers[0].self_attn.native is None  # partial: torch
    _check_against(llm, _hf(phi3_dirs["phi4mini"]), _prompts([40], seed=6), 8)


@pytest.mark.slow  # two engines, generations with prompt logprobs (~30 s on two busy cores)
def test_phi3_folders_match_transformers(phi3_dirs: dict[str, str]) -> None:
    """Both folders: transformers' greedy tokens and logprobs past the original context (the long factors, the
    window, the partial rotation in torch, the fused projections split) and within it (the short factors)."""
    for name in ("phi35", "phi4mini"):
        hf = _hf(phi3_dirs[name])
        llm = LLM(phi3_dirs[name], **ENGINE)
        layer = llm.llm_engine.model_runner.model.model.layers[0].self_attn
        # a partial rotation runs in torch (the native pass rotates whole heads); a whole one natively where built
        assert layer.qk_norm_rope.rotary_dim == (12 if name == "phi4mini" else 16)
        if name == "phi4mini":
            assert layer.native is None
        assert layer.sliding_window == (WINDOW if name == "phi35" else None)
        _check_against(llm, hf, _prompts([50, 40, 12], seed=7), GENERATED)


def test_phi3_bad_configs_are_refused() -> None:
    """A RoPE type Phi-3 does not take, and a partial rotation of an odd number of dimensions, are ValueErrors;
    a fused tensor of the wrong rows is one too; a tensor-parallel rank splits by the whole model's rows."""
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
    # a tensor-parallel rank (its config holds 2 of the 4 heads) splits by the whole model's rows, its plan's
    plan = ShardPlan.make(cfg, 1, 2)
    rank = SimpleNamespace(config=plan.local_config(cfg), tp=SimpleNamespace(plan=plan))
    qkv = torch.arange(192.0).view(192, 1)  # q, k, v of 4 heads of 16
    split = dict(Phi3ForCausalLM._split(rank, [("l.self_attn.qkv_proj.weight", qkv)]))
    assert [split[f"l.self_attn.{p}_proj.weight"][0, 0].item() for p in "qkv"] == [0.0, 64.0, 128.0]


@pytest.mark.slow  # converts the checkpoints in subprocesses (seconds each), fetches the converter once
def test_phi3_converted_gguf_match_transformers(phi3_dirs: dict[str, str], tmp_path_factory, gguf_converter) -> None:  # noqa: ANN001
    """llama.cpp's converter's files (attn_qkv, ffn_up, rope_factors_short/long, attn_factor,
    rope.dimension_count, sliding_window): transformers' tokens and logprobs on the file's weights. Phi-3.5's
    F32 file and Phi-4-mini's F16 one: each checkpoint's fields and each outtype's weights (the F16 fused
    tensors split by rows of blocks), the fields being stored alike in either outtype."""
    from gguf_convert import ConvertedModels

    converted = ConvertedModels(phi3_dirs, tmp_path_factory.mktemp("phi3-gguf"), gguf_converter)
    folder_configs = {name: load_model_config(path) for name, path in phi3_dirs.items()}
    prompts = _prompts([50, 12], seed=9)
    for name, outtype in (("phi35", "f32"), ("phi4mini", "f16")):
        hf_folder = phi3_dirs[name]
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
