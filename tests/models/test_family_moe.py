"""Mixtral, Qwen2-MoE, OLMoE and GraniteMoE against transformers, from folders and llama.cpp's converter GGUFs.

The tiny checkpoints are ``tests/moe_models.py``'s (transformers' own config
classes, seeded; hidden 64, 2 layers, top-2 of 4 or 8 experts; Qwen2-MoE
with its gated shared expert, GraniteMoE's multipliers far from 1). The
oracle is transformers 5.25 on the same weights in float32 with its own KV
cache (``hf_greedy``) and one forward for logprobs; pagedllm runs float32
activations and a float32 KV cache, with the native kernels and again
through torch's layers. Greedy tokens must be equal and every reported
logprob (prompt and output, top 5) within ``LOGPROB_TOL``; the prompts
route tokens to every expert of every layer. Each family's routing is shown
to matter: transformers with another top-k, renormalisation or multiplier
gives logprobs far from pagedllm's.

The GGUF tests convert each folder with llama.cpp's ``convert_hf_to_gguf.py``
(``tests/gguf_convert.py``) to F32 and F16 and check what it writes
(Mixtral as architecture ``llama`` with ``expert_count``; ``qwen2moe``,
``olmoe``, ``granitemoe``; ``ffn_gate_inp``, ``ffn_*_exps``, ``ffn_*_shexp``,
``ffn_gate_inp_shexp``; routers kept in F32), the configuration read from it,
and the same tokens and logprobs against transformers on the weights as the
file stores them. Configuration tests need no model: each family's keys as
its transformers config class reads them (defaults included), llama.cpp's
GGUF keys, and the refusals by name.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from conftest import hf_greedy
from moe_models import GRANITEMOE_MULTIPLIERS, MOE_ARCHS, moe_config, save_tiny_moe
from test_gguf_converted import _hf_logprobs, _max_logprob_error

from pagedllm import LLM, SamplingParams
from pagedllm.layers.fused_moe import MoEBlock
from pagedllm.loader import load_model_config
from pagedllm.loader.model_config import ModelArchConfig, from_hf_config
from pagedllm.loader.moe_config import gguf_moe_fields
from pagedllm.loader.moe_families_config import gguf_moe_family_fields
from pagedllm.models.granitemoe import GraniteMoeForCausalLM
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.mixtral import MixtralForCausalLM
from pagedllm.models.olmoe import OlmoeForCausalLM
from pagedllm.models.qwen2_moe import Qwen2MoeForCausalLM
from pagedllm.models.registry import MODEL_REGISTRY

# float32 on both sides; measured worst gap ~5e-6 (the summation order of the kernels differs)
LOGPROB_TOL = 1e-4
GENERATED = 12
ENGINE = dict(max_model_len=256, num_kv_blocks=64, block_size=8, kv_cache_dtype="float32", enable_prefix_caching=False)
MODEL_CLASSES = {"mixtral": MixtralForCausalLM, "qwen2_moe": Qwen2MoeForCausalLM, "olmoe": OlmoeForCausalLM,
                 "granitemoe": GraniteMoeForCausalLM}
GGUF_ARCHITECTURES = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "olmoe": "olmoe", "granitemoe": "granitemoe"}
# transformers' model with one of the family's routing choices undone, far from pagedllm's logprobs
VARIANTS = {
    "mixtral": {"top-1": {"num_experts_per_tok": 1}},
    "qwen2_moe": {"renormalised": {"norm_topk_prob": True}},
    "olmoe": {"renormalised": {"norm_topk_prob": True}},
    "granitemoe": {name: {name: 1.0} for name in GRANITEMOE_MULTIPLIERS},
}

# per family: (num_experts, top_k, expert width, renormalised, shared expert width, q/k norm, attention bias)
ROUTING = {
    "mixtral": (4, 2, 96, True, 0, False, False),
    "qwen2_moe": (8, 2, 32, False, 48, False, True),
    "olmoe": (8, 2, 48, False, 0, True, False),
    "granitemoe": (4, 2, 64, True, 0, False, False),
}


@pytest.fixture(scope="session")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> dict[str, str]:  # noqa: ANN001
    """The four tiny folders (seeded random weights, SmolLM2's tokenizer)."""
    return {arch: save_tiny_moe(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), smollm_tokenizer) for arch in MOE_ARCHS}


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


def _record_routing(model) -> list[set[int]]:  # noqa: ANN001
    """Per layer, the experts its router chooses from now on (the router's ``route`` wrapped)."""
    chosen: list[set[int]] = []
    for layer in model.model.layers:
        seen: set[int] = set()
        route = layer.mlp.gate.route

        def recording(x: torch.Tensor, route=route, seen=seen) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
            weights, ids = route(x)
            seen.update(ids.flatten().tolist())
            return weights, ids

        layer.mlp.gate.route = recording
        chosen.append(seen)
    return chosen


def _check_spec(arch: str, model) -> None:  # noqa: ANN001
    """The family's blocks: every MLP a mixture of experts routed as transformers routes it."""
    assert type(model) is MODEL_CLASSES[arch]
    experts, top_k, width, renormalised, shared, _, _ = ROUTING[arch]
    for layer in model.spec.layers:
        moe = layer.moe
        assert moe is not None and (moe.num_experts, moe.router.top_k, moe.intermediate_size) == (experts, top_k,
                                                                                                    width)
        assert moe.router.order == ("topk_softmax" if arch == "granitemoe" else "softmax_topk")
        assert moe.router.renormalize == (renormalised and arch != "granitemoe")
        assert (moe.shared_expert_intermediate_size, moe.shared_expert_gate) == (shared, shared > 0)
    if arch == "olmoe":
        assert {layer.attention.qk_norm_span for layer in model.spec.layers} == {"projection"}
    assert all(isinstance(layer.mlp, MoEBlock) for layer in model.model.layers)


# the fast tier keeps the family with the most parts (shared expert, its gate, unnormalised top-k)
FOLDER_CASES = [pytest.param(arch, marks=() if arch == "qwen2_moe" else pytest.mark.slow) for arch in MOE_ARCHS]
# every family in F16 (its matrices rounded, routers kept F32); F32 for Mixtral's "llama" file
GGUF_CASES = [*((arch, "f16") for arch in MOE_ARCHS), ("mixtral", "f32")]


@pytest.mark.parametrize("arch", FOLDER_CASES)
def test_folder_matches_transformers_native_and_torch(arch: str, moe_dirs: dict[str, str]) -> None:
    """The folder's model: transformers' greedy tokens and logprobs with the native kernels and with torch's
    layers, every expert of every layer routed to; each routing choice of the family matters."""
    path = moe_dirs[arch]
    prompts = _prompts(seed=7)
    refs = _reference(_hf(path), prompts)
    llm = LLM(path, **ENGINE)
    model = llm.llm_engine.model_runner.model
    _check_spec(arch, model)
    chosen = _record_routing(model)
    outs = _generate(llm, prompts)
    _check_against(refs, outs)
    assert all(seen == set(range(ROUTING[arch][0])) for seen in chosen), chosen

    model.use_native_ops(None)  # the same engine through torch's norms, RoPE and activations
    llm.llm_engine.model_runner.captured_decode = None
    _check_against(refs, _generate(llm, prompts))
    assert llm.llm_engine.block_manager.num_free_blocks == ENGINE["num_kv_blocks"]

    ids = prompts[0] + outs[0].outputs[0].token_ids
    for name, overrides in VARIANTS[arch].items():
        gap = _max_logprob_error(outs[0], _hf_logprobs(_hf(path, **overrides), ids))
        assert gap > 100 * LOGPROB_TOL, (name, gap)


@pytest.mark.slow
def test_qwen2_moe_dense_layers_from_the_folder(tmp_path, smollm_tokenizer) -> None:  # noqa: ANN001
    """A Qwen2-MoE whose middle layer is dense (``mlp_only_layers``; llama.cpp's converter cannot write one):
    that layer is a dense MLP of ``intermediate_size``, the others sparse, and the tokens and logprobs are
    transformers'."""
    path = save_tiny_moe("qwen2_moe", tmp_path, smollm_tokenizer, num_hidden_layers=3, mlp_only_layers=[1])
    assert load_model_config(path).dense_layers == (1,)
    prompts = _prompts(seed=3)[:1]
    refs = _reference(_hf(path), prompts)
    llm = LLM(path, **ENGINE)
    layers = llm.llm_engine.model_runner.model.model.layers
    assert [isinstance(layer.mlp, MoEBlock) for layer in layers] == [True, False, True]
    assert layers[1].mlp.down_proj.in_features == 128
    _check_against(refs, _generate(llm, prompts))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mixtral", "granitemoe"])
def test_transformers_in_memory_experts_load_as_the_saved_folder(arch: str, moe_dirs: dict[str, str],
                                                                 tmp_path) -> None:  # noqa: ANN001
    """transformers 5's in-memory names (``mlp.experts.gate_up_proj``, GraniteMoE's
    ``block_sparse_moe.experts.*`` and ``router.weight``), written as they are, load as the saved folder:
    the same greedy tokens and logprobs."""
    import shutil

    from safetensors.torch import save_file

    fused = tmp_path / "fused"
    shutil.copytree(moe_dirs[arch], fused)
    state = {k: v.contiguous() for k, v in _hf(moe_dirs[arch]).state_dict().items()}
    assert any(name.endswith("experts.gate_up_proj") for name in state)
    save_file(state, str(fused / "model.safetensors"))
    prompts = _prompts(seed=5)[:1]
    want = _generate(LLM(moe_dirs[arch], **ENGINE), prompts)[0]
    got = _generate(LLM(str(fused), **ENGINE), prompts)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert [{t: lp.logprob for t, lp in d.items()} for d in got.outputs[0].logprobs] == \
        [{t: lp.logprob for t, lp in d.items()} for d in want.outputs[0].logprobs]


@pytest.fixture(scope="session")
def moe_gguf(moe_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory, gguf_converter):  # noqa: ANN001, ANN201
    """``(arch, outtype) -> path``: the folder converted by llama.cpp's converter, once per session."""
    from gguf_convert import ConvertedModels

    return ConvertedModels(moe_dirs, tmp_path_factory.mktemp("moe-gguf"), gguf_converter)


def _is_router(name: str) -> bool:
    """A router's (or Qwen2-MoE's shared-expert gate's) weight in transformers' names: kept F32 by the converter."""
    return name.endswith((".gate.weight", ".router.weight", ".shared_expert_gate.weight"))


def _hf_as_stored(path: str, gguf_path: str):  # noqa: ANN202
    """transformers' model of the folder, its matrices and stacked experts rounded as the GGUF file stores them."""
    from gguf_convert import read_gguf

    hf = _hf(path)
    types = {}
    for t in read_gguf(gguf_path).tensors:
        kind = "vector" if len(t.shape) == 1 else "router" if "ffn_gate_inp" in t.name else "matrix"
        types.setdefault(kind, set()).add(t.tensor_type.name)
    assert types["vector"] == {"F32"} and types["router"] == {"F32"} and len(types["matrix"]) == 1, types
    if types["matrix"] == {"F16"}:
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if p.dim() >= 2 and not _is_router(name):
                    p.copy_(p.half().float())
    return hf


def _check_file(arch: str, path: str) -> None:
    """What llama.cpp's converter wrote: the architecture name, the experts' tensors and their metadata."""
    from gguf_convert import read_gguf

    reader = read_gguf(path)
    gguf_arch = GGUF_ARCHITECTURES[arch]
    assert reader.fields["general.architecture"].contents() == gguf_arch
    experts, top_k, width, _, shared, _, _ = ROUTING[arch]
    assert reader.fields[f"{gguf_arch}.expert_count"].contents() == experts
    assert reader.fields[f"{gguf_arch}.expert_used_count"].contents() == top_k
    names = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors if t.name.startswith("blk.1.")}
    assert names["blk.1.ffn_gate_inp.weight"] == (64, experts)
    for part in ("gate", "up"):
        assert names[f"blk.1.ffn_{part}_exps.weight"] == (64, width, experts)  # ggml order: [cols, rows, experts]
    assert names["blk.1.ffn_down_exps.weight"] == (width, 64, experts)
    if shared:
        assert reader.fields[f"{gguf_arch}.expert_shared_feed_forward_length"].contents() == shared
        assert names["blk.1.ffn_gate_inp_shexp.weight"] == (64, 1)
        assert {f"blk.1.ffn_{part}_shexp.weight" for part in ("gate", "up", "down")} <= set(names)
    else:
        assert not any("shexp" in name for name in names)


@pytest.mark.slow  # a converter run per file
@pytest.mark.parametrize(("arch", "outtype"), GGUF_CASES)
def test_converted_gguf_matches_transformers(arch: str, outtype: str, moe_gguf, moe_dirs: dict[str, str]) -> None:  # noqa: ANN001
    """The converter's file: its names and metadata, the configuration read from it, and transformers' tokens and
    logprobs on the weights as the file stores them, on float32 activations."""
    path = moe_gguf(arch, outtype)
    _check_file(arch, path)
    cfg = load_model_config(path)
    assert (cfg.architecture, cfg.checkpoint_format) == (GGUF_ARCHITECTURES[arch], "gguf")
    assert _routing(cfg) == ROUTING[arch] and cfg.dense_layers == ()
    if arch == "granitemoe":  # the converter's granitemoe.*_scale keys, stored as float32
        f32 = {name: float(torch.tensor(v, dtype=torch.float32)) for name, v in GRANITEMOE_MULTIPLIERS.items()}
        assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attn_scale, cfg.logits_scaling) == (
            f32["embedding_multiplier"], f32["residual_multiplier"], f32["attention_multiplier"],
            f32["logits_scaling"])
    assert MODEL_REGISTRY.model_class(cfg) is MODEL_CLASSES[arch]
    prompts = _prompts(seed=13)[:1]  # 37 tokens: every expert of every layer chosen (the folder test checks)
    refs = _reference(_hf_as_stored(moe_dirs[arch], path), prompts)
    llm = LLM(path, **ENGINE, gguf_activations="float32")
    _check_spec(arch, llm.llm_engine.model_runner.model)
    _check_against(refs, _generate(llm, prompts))


def _q8_0_rounded(w: torch.Tensor) -> torch.Tensor:
    """``w`` as Q8_0 holds it (llama.cpp's reference quantizer, in float32): per run of 32 weights of a row,
    ``d = max |w| / 127``, ``q = roundf(w / d)`` (halves away from zero), ``d`` stored as float16."""
    blocks = w.float().reshape(*w.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    scaled = blocks * torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    return (d.half().float() * q).reshape(w.shape)


@pytest.mark.slow  # a converter run
def test_qwen2_moe_q8_0_gguf_keeps_its_blocks(moe_gguf, moe_dirs: dict[str, str]) -> None:  # noqa: ANN001
    """A Q8_0 file of Qwen2-MoE: experts and the shared expert's gate/up stay Q8_0 blocks, the routers F32 (the
    shared expert's down projection, 48 columns, is F16: not a whole number of 32-weight blocks). On float32
    activations: transformers' tokens and logprobs on the weights rounded as the file rounds them. On the default
    8-bit activations a needle request is the same bits alone and among others."""
    path = moe_gguf("qwen2_moe", "q8_0")
    llm = LLM(path, **ENGINE, gguf_activations="float32")
    block = llm.llm_engine.model_runner.model.model.layers[0].mlp
    assert {block.experts.gate_up.quant_method.name, block.experts.down.quant_method.name,
            block.shared_expert.gate_up_proj.quant_method.name} == {"gguf-q8_0"}
    hf = _hf(moe_dirs["qwen2_moe"])
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2 and not _is_router(name):
                p.copy_(_q8_0_rounded(p) if p.shape[-1] % 32 == 0 else p.half().float())
    prompts = _prompts(seed=11)[:1]
    _check_against(_reference(hf, prompts), _generate(llm, prompts))
    del llm
    llm = LLM(path, **ENGINE)  # gguf_activations="int8", the default
    needle, others = _prompts(seed=3)[0], _prompts(seed=4)
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True, logprobs=3)
    alone = llm.generate([{"prompt_token_ids": needle}], params, use_tqdm=False)[0].outputs[0]
    crowd = llm.generate([{"prompt_token_ids": p} for p in (others[0], needle, others[1])], params,
                         use_tqdm=False)[1].outputs[0]
    assert crowd.token_ids == alone.token_ids
    assert [{t: lp.logprob for t, lp in d.items()} for d in crowd.logprobs] == \
        [{t: lp.logprob for t, lp in d.items()} for d in alone.logprobs]


def test_registry_tells_mixtral_from_llama_in_gguf() -> None:
    """llama.cpp's "llama" runs as Mixtral with an expert count and as Llama without; experts under a GGUF
    architecture no MoE family runs are refused, naming the ones supported."""
    base = ModelArchConfig("llama", 100, 32, 64, 2, 4, 2, 8, 1e-6, 1e4, 64, False, checkpoint_format="gguf")
    assert MODEL_REGISTRY.model_class(base) is LlamaForCausalLM
    sparse = dataclasses.replace(base, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    assert MODEL_REGISTRY.model_class(sparse) is MixtralForCausalLM
    with pytest.raises(ValueError, match=r"architecture 'qwen2' with 4 experts .* supported: \[.*'granitemoe', "
                                         r"'llama', 'olmoe', 'qwen2moe', 'qwen35', 'qwen35moe', 'qwen3moe', 'qwen3next'\]"):
        MODEL_REGISTRY.model_class(dataclasses.replace(sparse, architecture="qwen2"))
    assert MODEL_REGISTRY.supported("hf", experts=True) == [
        "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration", "GptOssForCausalLM", "GraniteMoeForCausalLM",
        "GraniteMoeHybridForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
        "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"]


def _routing(cfg: ModelArchConfig) -> tuple:
    return (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob,
            cfg.shared_expert_intermediate_size, cfg.qk_norm, cfg.attention_bias)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_folder_config_is_read_as_transformers_reads_it(arch: str, moe_dirs: dict[str, str]) -> None:
    """The saved config.json: experts, top-k, expert widths, renormalisation, shared expert, q/k norms, biases,
    and Granite's multipliers."""
    cfg = load_model_config(moe_dirs[arch])
    assert (cfg.architecture, cfg.checkpoint_format) == (arch, "hf")
    assert _routing(cfg) == ROUTING[arch]
    assert cfg.dense_layers == () and cfg.sliding_windows == ()
    if arch == "granitemoe":
        assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attn_scale, cfg.logits_scaling) == (
            6.0, 0.4, 0.05, 3.0)
    else:
        assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attn_scale, cfg.logits_scaling) == (
            1.0, 1.0, None, 1.0)


def _dict(arch: str, **extra: object) -> dict:
    """A config.json of ``arch`` with only the keys every config needs (the class's defaults for the rest)."""
    name = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
            "granitemoe": "GraniteMoeForCausalLM"}[arch]
    experts = "num_local_experts" if arch in ("mixtral", "granitemoe") else "num_experts"
    return {"model_type": arch, "architectures": [name], "vocab_size": 100, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, experts: 8, **extra}


def test_config_class_defaults_where_keys_are_left_out() -> None:
    """What each config class assumes for a key config.json leaves out (top-k, widths, eps, theta, biases)."""
    mixtral = from_hf_config(_dict("mixtral"))
    assert (mixtral.num_experts_per_tok, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (2, 64, True)
    assert (mixtral.rms_norm_eps, mixtral.rope_theta) == (1e-5, 1e6)
    qwen = from_hf_config(_dict("qwen2_moe"))
    assert (qwen.num_experts_per_tok, qwen.moe_intermediate_size, qwen.shared_expert_intermediate_size) == (4, 1408,
                                                                                                            5632)
    assert (qwen.norm_topk_prob, qwen.attention_bias, qwen.rms_norm_eps) == (False, True, 1e-6)
    olmoe = from_hf_config(_dict("olmoe"))
    assert (olmoe.num_experts_per_tok, olmoe.norm_topk_prob, olmoe.qk_norm, olmoe.rms_norm_eps) == (8, False, True,
                                                                                                    1e-5)
    granite = from_hf_config(_dict("granitemoe"))
    assert (granite.num_experts_per_tok, granite.norm_topk_prob, granite.attn_scale) == (2, True, 1.0)
    # each config class's own transformers defaults agree with the reading's
    for arch in MOE_ARCHS:
        full = from_hf_config(moe_config(arch).to_dict())
        assert _routing(full) == ROUTING[arch], arch


def test_family_keys_are_honoured_or_refused_by_name() -> None:
    """Qwen2-MoE's dense layers (``mlp_only_layers``, ``decoder_sparse_step``) and ``qkv_bias``; Mixtral's window
    on every layer; what no family here computes (OLMoE's ``clip_qkv``, Qwen2-MoE's sliding window, a top-k
    over more experts than there are, Mixtral's ``attention_bias``) is refused, named."""
    dense = from_hf_config(_dict("qwen2_moe", mlp_only_layers=[0], decoder_sparse_step=2))
    assert dense.dense_layers == (0, 2)  # layer 0 listed, layers 0 and 2 off the step of 2
    # an index past the layers is no layer, as in Qwen2MoeDecoderLayer
    assert from_hf_config(_dict("qwen2_moe", mlp_only_layers=[3, 7])).dense_layers == (3,)
    assert from_hf_config(_dict("qwen2_moe", qkv_bias=False)).attention_bias is False
    assert from_hf_config(_dict("qwen2_moe", norm_topk_prob=True)).norm_topk_prob is True
    assert from_hf_config(_dict("qwen2_moe", sliding_window=0, use_sliding_window=False)).sliding_windows == ()
    windowed = from_hf_config(_dict("mixtral", sliding_window=16))
    assert windowed.sliding_windows == (16,) * 4
    assert from_hf_config(_dict("mixtral", sliding_window=4096, max_position_embeddings=4096)).sliding_windows == ()
    assert from_hf_config(_dict("olmoe", attention_bias=True)).attention_bias is True
    for arch, bad, name in (
        ("olmoe", {"clip_qkv": 8.0}, "clip_qkv"),
        ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
        ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ("mixtral", {"attention_bias": True}, "attention_bias"),
        ("qwen2_moe", {"decoder_sparse_step": -1}, "decoder_sparse_step"),
        ("qwen2_moe", {"moe_intermediate_size": -8}, "moe_intermediate_size"),
        ("qwen2_moe", {"mlp_only_layers": "0"}, "mlp_only_layers"),
        ("granitemoe", {"residual_multiplier": 0}, "residual_multiplier"),
        ("mixtral", {"embedding_multiplier": 2.0}, "embedding_multiplier"),
    ):
        with pytest.raises(ValueError, match=name):
            from_hf_config(_dict(arch, **bad))


def test_gguf_routing_keys_as_llama_cpp_reads_them() -> None:
    """expert_used_count is the top-k; expert_feed_forward_length the experts' width where given (else
    feed_forward_length); renormalised as llama.cpp's graph of the architecture does unless
    expert_weights_norm says; a file with experts but no expert_used_count is refused."""
    def read(arch: str, **keys: object) -> ModelArchConfig:
        routers = [f"blk.{i}.ffn_gate_inp.weight" for i in range(2)]
        fields = gguf_moe_fields(keys.get, arch, 4, 2, 96, routers)
        base = ModelArchConfig(arch, 100, 32, 96, 2, 4, 2, 8, 1e-6, 1e4, 64, False, checkpoint_format="gguf",
                               num_experts=4, **fields)
        return gguf_moe_family_fields(base, keys.get)

    mixtral = read("llama", expert_used_count=2)
    assert (mixtral.num_experts_per_tok, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (2, 96, True)
    qwen = read("qwen2moe", expert_used_count=2, expert_feed_forward_length=32, expert_shared_feed_forward_length=48)
    assert (qwen.moe_intermediate_size, qwen.shared_expert_intermediate_size, qwen.norm_topk_prob) == (32, 48, False)
    assert read("olmoe", expert_used_count=2).norm_topk_prob is False
    assert read("granitemoe", expert_used_count=2).norm_topk_prob is True
    assert read("qwen2moe", expert_used_count=2, expert_weights_norm=True).norm_topk_prob is True
    dense = ModelArchConfig("llama", 100, 32, 96, 2, 4, 2, 8, 1e-6, 1e4, 64, False, checkpoint_format="gguf")
    assert gguf_moe_family_fields(dense, {}.get) is dense
    assert read("llama", expert_used_count=2, expert_weights_norm=False).norm_topk_prob is False
    with pytest.raises(ValueError, match="expert_used_count"):
        read("olmoe")
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        read("olmoe", expert_used_count=5)


def test_granitemoe_multipliers_match_granite() -> None:
    """GraniteMoE reads Granite's four multipliers under its own model_type (``granitemoe``)."""
    cfg = from_hf_config(_dict("granitemoe", **GRANITEMOE_MULTIPLIERS))
    assert dataclasses.astuple(cfg)[0] == "granitemoe"
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attn_scale, cfg.logits_scaling) == (
        6.0, 0.4, 0.05, 3.0)
