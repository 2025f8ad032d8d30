"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet hybrids) against transformers on tiny random weights.

Tiny random checkpoints of transformers' own config classes
(``Qwen3NextConfig``, ``Qwen3_5TextConfig``, ``Qwen3_5MoeTextConfig``):
hidden 64, four layers, the fourth full (gated) attention and the other
three Gated DeltaNet (2 key heads, 4 value heads of 16, conv of 4); the MoE
ones with 4 experts, 2 per token, and a gated shared expert in every layer
(llama.cpp's ``qwen3next`` files have no dense MLP). Weights drawn wide
(``initializer_range`` 0.2), norms and the decay parameters at random, so
that a wrong gate, norm, decay or state changes the greedy tokens. The
Qwen3.5-MoE config has no dense ``intermediate_size``, as Qwen3.5-35B-A3B's
has none (so its converted file has no ``feed_forward_length``).

From each folder, on the native kernels with float32 activations: greedy
tokens equal transformers' (its own cache: recurrent decode) and every
logprob within ``LOGPROB_TOL`` of transformers' in float64; prompts cut into chunks of 16 and 64
tokens, and a prompt's next turn hitting its cached blocks and state snapshot,
give the whole prompt's tokens.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import hf_greedy, spread_gated_delta_params

from pagedllm import LLM, SamplingParams

# logprobs are compared with transformers' in float64: ours stay within 4.5e-4 of them (measured), while
# transformers' own float32 ones are up to 2.4e-3 away on these wide weights (70 tokens through three states)
LOGPROB_TOL = 1e-3
GENERATED = 10
ENGINE = dict(max_model_len=256, num_kv_blocks=64, block_size=8, kv_cache_dtype="float32", max_num_seqs=4)
COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
              max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def _config(family: str):  # noqa: ANN202
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(**COMMON, **MOE, norm_topk_prob=True)
    if family == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(**COMMON)
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**{k: v for k, v in COMMON.items() if k != "intermediate_size"}, **MOE)


def _save(family: str, path, tokenizer) -> str:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    torch.manual_seed(len(family))
    model = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32)
    spread_gated_delta_params(model)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


FAMILIES = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> dict[str, str]:  # noqa: ANN001
    return {f: _save(f, tmp_path_factory.mktemp(f"tiny-{f}"), smollm_tokenizer) for f in FAMILIES}


@pytest.fixture(scope="module")
def hf_models(folders: dict[str, str]) -> dict:
    """transformers' models in float32 (the greedy tokens) and float64 (the logprobs: ``(family, "f64")``)."""
    from transformers import AutoModelForCausalLM

    models = {f: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for f, p in folders.items()}
    for f, p in folders.items():  # grouped_mm has no float64: the experts' eager loop
        models[f, "f64"] = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float64,
                                                                experts_implementation="eager").eval()
    return models


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in lengths]


# every test's prompts: one over 64 tokens (two chunks of the prompt kernel), and its next turn (9 tokens more),
# which hits the state snapshot kept at the first prompt's last full block (8 blocks of 8: 64 tokens)
_LONG, _TAIL = _prompts([70, 9], seed=1)
PROMPTS = [_LONG, _LONG + _TAIL]
PREFIX_HIT = 64


@pytest.fixture(scope="module")
def hf_tokens(hf_models: dict) -> dict:
    """transformers' greedy tokens of ``PROMPTS`` per family, computed on first use."""

    class Tokens(dict):
        def __missing__(self, family: str) -> list[list[int]]:
            self[family] = [hf_greedy(hf_models[family], p, GENERATED) for p in PROMPTS]
            return self[family]

    return Tokens()


def _max_logprob_error(hf, out) -> float:  # noqa: ANN001
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    with torch.inference_mode():
        want = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)  # float64 model
    prompt_len = len(out.prompt_token_ids)
    rows = [(i - 1, lps) for i, lps in enumerate(out.prompt_logprobs) if lps is not None]
    rows += [(prompt_len - 1 + i, lps) for i, lps in enumerate(out.outputs[0].logprobs)]
    return max(abs(lp.logprob - float(want[row, token])) for row, lps in rows for token, lp in lps.items())


def _generate(llm: LLM, prompts: list[list[int]], logprobs: bool = False) -> list:  # noqa: ANN001
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True,
                            logprobs=5 if logprobs else None, prompt_logprobs=5 if logprobs else None)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_folder_matches_transformers(family: str, folders: dict[str, str], hf_models: dict,
                                     hf_tokens: dict) -> None:
    """Greedy tokens and logprobs of the two prompts batched, from the folder on the native kernels."""
    llm = LLM(folders[family], **ENGINE)
    outs = _generate(llm, PROMPTS, logprobs=True)
    assert [out.outputs[0].token_ids for out in outs] == hf_tokens[family]
    for out in outs:
        assert _max_logprob_error(hf_models[family, "f64"], out) < LOGPROB_TOL


@pytest.mark.parametrize(("family", "chunk"), [("qwen3_5", 16), ("qwen3_next", 64)])
def test_chunked_prompts_and_a_prefix_hit_give_the_whole_prompts_tokens(family: str, chunk: int,
                                                                        folders: dict[str, str],
                                                                        hf_tokens: dict) -> None:
    """Prompts cut into chunks of ``chunk`` tokens (each continuing the conv and delta-rule states), the second
    (the first's next turn) after the first has finished: it hits the first's 8 full blocks and the state
    snapshot kept after them (docs/hybrid-models.md), then computes only its last 15 tokens."""
    llm = LLM(folders[family], **ENGINE, max_num_batched_tokens=chunk)
    first = _generate(llm, PROMPTS[:1])
    second = _generate(llm, PROMPTS[1:])
    assert second[0].num_cached_tokens == PREFIX_HIT
    assert [out.outputs[0].token_ids for out in first + second] == hf_tokens[family]


@pytest.fixture(scope="module")
def ggufs(folders: dict[str, str], tmp_path_factory: pytest.TempPathFactory, gguf_converter) -> dict:  # noqa: ANN001
    """Each folder converted by llama.cpp's converter, per (family, outtype), on first use."""
    out = tmp_path_factory.mktemp("qwen35-gguf")

    class Files(dict):
        def __missing__(self, key: tuple[str, str]) -> str:
            family, outtype = key
            self[key] = gguf_converter.convert(folders[family], outtype, str(out / f"{family}-{outtype}.gguf"))
            return self[key]

    return Files()


def _rounded_to_f16(hf):  # noqa: ANN001, ANN202
    """transformers' model with the matrices the converter writes in F16 rounded so (vectors, norms, the router
    and the conv stay F32 in the file)."""
    import copy

    model = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "conv1d" not in name and not name.endswith("mlp.gate.weight"):
                p.copy_(p.half().to(p.dtype))
    return model


@pytest.mark.slow  # converts the checkpoints in subprocesses (seconds each)
@pytest.mark.parametrize(("family", "outtype"), [("qwen3_next", "f32"), ("qwen3_5", "f16"), ("qwen3_5_moe", "f32")])
def test_converted_gguf_matches_transformers(family: str, outtype: str, ggufs: dict, hf_models: dict) -> None:
    """llama.cpp's files (qwen3next, qwen35, qwen35moe: without feed_forward_length, its config having no
    dense width): the ssm_* tensors, -exp(A_log), 1 + w norms and the value heads reordered to tiled order
    (qwen35*: 4 value heads over 2 key heads) read back; transformers' greedy tokens and logprobs on float32
    activations (F16: on the weights rounded as the file holds them)."""
    from pagedllm.loader import load_model_config

    path = ggufs[family, outtype]
    cfg = load_model_config(path)
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim) == (2, 4, 16)
    hf, hf64 = hf_models[family], hf_models[family, "f64"]
    if outtype == "f16":
        hf, hf64 = _rounded_to_f16(hf), _rounded_to_f16(hf64)
    llm = LLM(path, **ENGINE, gguf_activations="float32")
    for prompt, out in zip(PROMPTS, _generate(llm, PROMPTS, logprobs=True), strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, GENERATED)
        assert _max_logprob_error(hf64, out) < LOGPROB_TOL


@pytest.mark.slow  # a converter run
def test_q8_0_file_kept_in_blocks_matches_it_dequantized(ggufs: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q8_0 ``qwen35`` file (4 value heads tiled over 2 key heads): the full-attention layer's fused ``qkv_proj``
    holds the file's blocks (``attn_q``'s query and gate rows split in whole rows), and so does ``out_proj``,
    whose columns stay in the file's tiled order (the layer hands it its heads in that order); tokens and
    logprobs are those of the same file dequantized whole (finite: moving half blocks made NaNs once)."""
    from pagedllm.loader.gguf_loader import GGUFWeights

    path = ggufs["qwen3_5", "q8_0"]
    llm = LLM(path, **ENGINE, gguf_activations="float32")
    layers = llm.llm_engine.model_runner.model.model.layers
    assert layers[3].self_attn.qkv_proj.quant_method.name == "gguf-q8_0"
    assert layers[0].linear_attn.in_proj.quant_method.name == "gguf-q8_0"
    assert layers[0].linear_attn.out_proj.quant_method.name == "gguf-q8_0"
    assert layers[0].linear_attn.spec.out_proj_tiled
    kept = _generate(llm, PROMPTS[:1], logprobs=True)[0]
    del llm, layers
    init = GGUFWeights.__init__

    def dequantize_all(self: GGUFWeights, *args: object) -> None:  # no tensor taken as stored: all float32
        init(self, *args)
        self.quantized.clear()

    monkeypatch.setattr(GGUFWeights, "__init__", dequantize_all)
    whole_llm = LLM(path, **ENGINE, gguf_activations="float32")
    assert type(whole_llm.llm_engine.model_runner.model.model.layers[0].linear_attn.out_proj.quant_method).__name__ \
        != "GGUFLinearMethod"
    whole = _generate(whole_llm, PROMPTS[:1], logprobs=True)[0]
    assert kept.outputs[0].token_ids == whole.outputs[0].token_ids
    errors = [abs(got[t].logprob - want[t].logprob) for got, want in zip(kept.outputs[0].logprobs,
                                                                          whole.outputs[0].logprobs, strict=True)
              for t in want if t in got]
    assert errors and max(errors) < 1e-4  # NaN fails this too


@pytest.mark.slow  # a converter run
def test_q8_0_files_out_proj_moved_back_to_grouped_columns_for_tensor_parallelism(ggufs: dict) -> None:
    """``GGUFWeights.untile_out_proj`` (a tensor-parallel rank's heads must be one run of columns): the Q8_0
    ``ssm_out``, whose heads of 16 columns are half a block, comes out dequantized with its value heads grouped
    by key head again: the tiled columns it is read with otherwise, moved (head ``k * group + g`` from tiled
    position ``g * num_k_heads + k``)."""
    from pagedllm.loader import load_model_config
    from pagedllm.loader.gguf_loader import iter_weights

    path = ggufs["qwen3_5", "q8_0"]
    config = load_model_config(path)
    assert config.linear_out_proj_tiled and (config.linear_num_key_heads, config.linear_num_value_heads) == (2, 4)
    name = "model.layers.0.linear_attn.out_proj.weight"
    tiled = dict(iter_weights(path, config))[name]  # nothing kept as stored: every tensor float32
    weights = iter_weights(path, config)
    weights.untile_out_proj()
    assert name not in weights.quantized  # half-block heads: dequantized, never moved as bytes
    grouped = dict(weights)[name]
    hidden, dv = tiled.shape[0], config.linear_value_head_dim
    want = tiled.view(hidden, 2, 2, dv).transpose(1, 2).reshape(hidden, -1)  # [g, k] -> [k, g]
    assert torch.equal(grouped, want)


def _script_shape(family: str):  # noqa: ANN202
    """benchmarks/real_size_hybrid_gguf.py's shape of this module's tiny config of ``family``; the MoE one
    eight layers long, cut to the first four as ``--layers 4`` does."""
    from benchmarks.real_size_hybrid_gguf import ExpertShape, HybridShape, first_layers

    if family == "qwen3_5":
        return HybridShape(64, 4, 96, 4, 2, 16, 2, 4, 16, 16, 4, 49152, False, rope_theta=10000.0, context_len=1024)
    experts = ExpertShape(MOE["num_experts"], MOE["num_experts_per_tok"], MOE["moe_intermediate_size"],
                          MOE["shared_expert_intermediate_size"])
    return first_layers(HybridShape(64, 8, None, 4, 2, 16, 2, 4, 16, 16, 4, 49152, False, rope_theta=10000.0,
                                    context_len=1024, experts=experts), 4)


def _gguf_fields(reader) -> dict:  # noqa: ANN001
    """A file's metadata but its name, size label and the bundled tokenizer's two flags more; the tokenizer's
    values aside (the script's are the bundled file's)."""
    skipped = ("GGUF.kv_count", "general.name", "general.size_label", "tokenizer.ggml.add_space_prefix",
               "tokenizer.ggml.add_bos_token")
    return {f.name: (f.types, None if f.name.startswith("tokenizer.") else f.contents())
            for f in reader.fields.values() if f.name not in skipped}


@pytest.fixture(scope="module")
def script_ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """benchmarks/real_size_hybrid_gguf.py's F16 file of ``_script_shape(family)``, per family, written on first
    use and read by the tests below (none writes to it)."""
    from benchmarks.real_size_hybrid_gguf import write_f16

    out = tmp_path_factory.mktemp("qwen35-script-gguf")

    class Files(dict):
        def __missing__(self, family: str) -> str:
            path = out / f"{family}.gguf"
            write_f16(_script_shape(family), path, "tiny")
            self[family] = str(path)
            return self[family]

    return Files()


@pytest.mark.slow  # a converter run
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_real_size_script_writes_the_converters_layout(family: str, ggufs: dict, script_ggufs: dict) -> None:
    """benchmarks/real_size_hybrid_gguf.py at this module's tiny config (``qwen35``; ``qwen35moe``: stacked
    experts, F32 routers, the ``expert_*`` keys and no ``feed_forward_length``): the converter's F16 file's
    metadata keys with the same values, tensor names, shapes, types and order."""
    from gguf import GGUFReader

    ours = GGUFReader(script_ggufs[family])
    theirs = GGUFReader(ggufs[family, "f16"])
    assert list(_gguf_fields(ours).items()) == list(_gguf_fields(theirs).items())
    assert [(t.name, list(t.shape), t.tensor_type) for t in ours.tensors] == \
        [(t.name, list(t.shape), t.tensor_type) for t in theirs.tensors]


@pytest.mark.slow  # loads a model
def test_real_size_script_moe_file_loads_and_generates(script_ggufs: dict) -> None:
    """The script's ``qwen35moe`` file (random weights, ``--layers 4`` of the tiny shape): read as the
    converter's file of the same config is (the layout test above; test_converted_gguf_matches_transformers
    checks that reading against transformers), with every layer's experts and shared expert, and generates
    finite logprobs on the native kernels."""
    from pagedllm.loader import load_model_config

    path = script_ggufs["qwen3_5_moe"]  # the layout test's file, written once
    cfg = load_model_config(path)
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size, cfg.dense_layers) == (4, 4, 2, 32, 48, ())
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    out = _generate(LLM(path, **ENGINE, gguf_activations="float32"), PROMPTS[:1], logprobs=True)[0]
    assert len(out.outputs[0].token_ids) == GENERATED
    assert all(math.isfinite(lp.logprob) for lps in out.outputs[0].logprobs for lp in lps.values())


def _with_vector_shared_expert_gates(src: str, dst: str) -> None:
    """``src`` (an F32 file) rewritten with every ``ffn_gate_inp_shexp`` a vector of ``hidden`` values, as
    llama-quantize writes it (ggml drops a shape's trailing 1s), where the converter writes ``[1, hidden]``."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for f in reader.fields.values():
        if not f.name.startswith("GGUF.") and f.name != "general.architecture":
            sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data).reshape(-1) if t.name.endswith("gate_inp_shexp.weight") else t.data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow  # a converter run
def test_quantized_files_vector_shared_expert_gate_is_read_as_its_row(ggufs: dict, hf_models: dict,
                                                                      tmp_path) -> None:  # noqa: ANN001
    """llama-quantize's files (every published Qwen3.5-MoE one) hold the shared expert's gate as a vector; read
    as the ``[1, hidden]`` row it is, the converter's file so rewritten gives transformers' greedy tokens."""
    from gguf import GGUFReader

    path = str(tmp_path / "vector-gates.gguf")
    _with_vector_shared_expert_gates(ggufs["qwen3_5_moe", "f32"], path)
    assert {tuple(t.shape) for t in GGUFReader(path).tensors if t.name.endswith("gate_inp_shexp.weight")} == {(64,)}
    out = _generate(LLM(path, **ENGINE, gguf_activations="float32"), PROMPTS[:1])[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_models["qwen3_5_moe"], PROMPTS[0], GENERATED)
