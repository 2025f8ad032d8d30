"""Qwen3-MoE (``Qwen3MoeForCausalLM``, GGUF ``qwen3moe``) against transformers on the same tiny random weights.

A tiny random checkpoint of transformers' own ``Qwen3MoeConfig``: 8 experts,
4 per token (renormalised, ``norm_topk_prob``, as Qwen3-30B-A3B and as
llama.cpp's ``qwen3moe`` graph always does), hidden 64, experts of 32, two
layers of which the second is dense (``mlp_only_layers``). The weights are
drawn wide (``initializer_range`` 0.2) and the norms at random, so that the
router's choices differ from token to token and a wrong expert, slot weight
or norm changes the greedy tokens.

The folder (transformers 5 saves the experts per expert,
``mlp.experts.{e}.gate_proj.weight``; its in-memory fused 3-D form loads
too) runs with the native kernels on float32 activations: transformers'
greedy tokens and logprobs within ``LOGPROB_TOL`` (only summation order
differs, measured ~1e-5). The files of llama.cpp's own converter (F32, F16:
the experts as 3-D ``ffn_*_exps`` tensors; Q8_0: blocks kept as stored)
load without widening the experts to float and give transformers' tokens on
float32 activations (Q8_0 against the dequantized weights, within
``Q8_LOGPROB_TOL``).
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import hf_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.layers.fused_moe import MoEBlock
from pagedllm.loader import load_model_config
from pagedllm.models.qwen3_moe import Qwen3MoeForCausalLM

LOGPROB_TOL = 1e-4
GENERATED = 12
ENGINE = dict(max_model_len=256, num_kv_blocks=64, block_size=8, kv_cache_dtype="float32")
NUM_EXPERTS, TOP_K = 8, 4


def _tiny_config(**overrides: object):  # noqa: ANN202
    from transformers import Qwen3MoeConfig

    fields = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True, mlp_only_layers=[1],
                  max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    return Qwen3MoeConfig(**{**fields, **overrides})


def _save(config, path, tokenizer, seed: int) -> str:  # noqa: ANN001
    """A tiny random model of ``config`` saved as a safetensors folder, norm weights drawn from [0.5, 1.5)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> str:  # noqa: ANN001
    """Layer 0 sparse (8 experts, top 4), layer 1 dense (``mlp_only_layers``)."""
    return _save(_tiny_config(), tmp_path_factory.mktemp("tiny-qwen3-moe"), smollm_tokenizer, 4321)


@pytest.fixture(scope="session")
def qwen3_moe_sparse_dir(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> str:  # noqa: ANN001
    """Both layers sparse, top 2 of 8: what llama.cpp's converter and its ``qwen3moe`` graph take (the
    converter cannot name a dense layer's MLP in a qwen3moe file)."""
    config = _tiny_config(mlp_only_layers=[], num_experts_per_tok=2)
    return _save(config, tmp_path_factory.mktemp("tiny-qwen3-moe-sparse"), smollm_tokenizer, 8765)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in (33, 7)]


def _hf(path: str, round_matrices_to_f16: bool = False):  # noqa: ANN202
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if round_matrices_to_f16:  # the converter writes matrices (experts included) in the outtype, vectors in F32
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if p.dim() >= 2 and not name.endswith("mlp.gate.weight"):
                    p.copy_(p.half().float())
    return hf


def _max_logprob_error(hf, out) -> float:  # noqa: ANN001
    """Largest gap between pagedllm's logprobs (prompt and output, top 5 and chosen) and transformers'."""
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    with torch.inference_mode():
        want = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)
    prompt_len = len(out.prompt_token_ids)
    rows = [(i - 1, lps) for i, lps in enumerate(out.prompt_logprobs) if lps is not None]
    rows += [(prompt_len - 1 + i, lps) for i, lps in enumerate(out.outputs[0].logprobs)]
    return max(abs(lp.logprob - float(want[row, token])) for row, lps in rows for token, lp in lps.items())


def _check_against_transformers(llm: LLM, hf, prompts: list[list[int]], tol: float = LOGPROB_TOL) -> None:  # noqa: ANN001
    """Greedy tokens equal transformers'; every reported logprob within ``tol`` of its."""
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, GENERATED)
        assert _max_logprob_error(hf, out) < tol


def test_qwen3_moe_folder_matches_transformers(qwen3_moe_dir: str) -> None:
    """The folder's model on the native kernels: transformers' tokens and logprobs; layer 0 sparse (8 experts,
    top 4, renormalised), layer 1 dense (``mlp_only_layers``)."""
    cfg = load_model_config(qwen3_moe_dir)
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3_moe", NUM_EXPERTS, TOP_K)
    assert (cfg.moe_intermediate_size, cfg.dense_layers, cfg.norm_topk_prob, cfg.qk_norm) == (32, (1,), True, True)
    llm = LLM(qwen3_moe_dir, **ENGINE)
    model = llm.llm_engine.model_runner.model
    assert isinstance(model, Qwen3MoeForCausalLM)
    block = model.model.layers[0].mlp
    assert isinstance(block, MoEBlock) and not isinstance(model.model.layers[1].mlp, MoEBlock)
    assert block.experts.gate_up.out_features == NUM_EXPERTS * 2 * 32
    assert block.experts.down.out_features == NUM_EXPERTS * 64
    _check_against_transformers(llm, _hf(qwen3_moe_dir), _prompts(5))
    assert llm.llm_engine.block_manager.num_free_blocks == ENGINE["num_kv_blocks"]
    # float experts take the per-expert loop, which reads the offsets into Python: not captured (not tried)
    assert llm.llm_engine.model_runner.captured_decode is None


@pytest.fixture(scope="module")
def qwen3_moe_ggufs(qwen3_moe_sparse_dir: str, tmp_path_factory, gguf_converter) -> dict[str, str]:  # noqa: ANN001
    """The folder converted by llama.cpp's converter, once per outtype (made on first use)."""
    out = tmp_path_factory.mktemp("qwen3-moe-gguf")
    made: dict[str, str] = {}

    class Files(dict):
        def __missing__(self, outtype: str) -> str:
            made[outtype] = gguf_converter.convert(qwen3_moe_sparse_dir, outtype, str(out / f"qwen3moe-{outtype}.gguf"))
            self[outtype] = made[outtype]
            return made[outtype]

    return Files()


@pytest.mark.slow  # converts the checkpoint in a subprocess (seconds)
@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_qwen3_moe_converter_gguf_matches_transformers(outtype: str, qwen3_moe_sparse_dir: str,
                                                      qwen3_moe_ggufs: dict[str, str]) -> None:
    """llama.cpp's converter writes architecture 'qwen3moe' with the experts as 3-D ``ffn_*_exps`` tensors and the
    router ``ffn_gate_inp`` (kept F32): transformers' tokens and logprobs on float32 activations. F16 experts are
    held as F16 blocks (never widened), the router in float32."""
    from gguf_convert import read_gguf

    path = qwen3_moe_ggufs[outtype]
    names = {t.name for t in read_gguf(path).tensors}
    assert {"blk.1.ffn_gate_inp.weight", "blk.1.ffn_gate_exps.weight", "blk.1.ffn_down_exps.weight"} <= names
    cfg = load_model_config(path)
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        "qwen3moe", NUM_EXPERTS, 2, 32)
    assert cfg.dense_layers == () and cfg.norm_topk_prob and cfg.qk_norm
    llm = LLM(path, **ENGINE, gguf_activations="float32")
    block = llm.llm_engine.model_runner.model.model.layers[0].mlp
    if outtype == "f16":
        assert block.experts.gate_up.quant_method.name == "gguf-f16"
        assert block.experts.down.qweight.dtype == torch.uint8
    _check_against_transformers(llm, _hf(qwen3_moe_sparse_dir, round_matrices_to_f16=outtype == "f16"), _prompts(9))


def _q8_0_rounded(w: torch.Tensor) -> torch.Tensor:
    """``w`` as Q8_0 holds it (llama.cpp's reference quantizer, in float32): per run of 32 weights of a row,
    ``d = max |w| / 127``, ``q = roundf(w * (1 / d))`` (halves away from zero), ``d`` stored as float16; read
    back as ``d16 * q``."""
    blocks = w.float().reshape(*w.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    scaled = blocks * torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    return (d.half().float() * q).reshape(w.shape)


@pytest.mark.slow  # converts the checkpoint in a subprocess (seconds)
def test_qwen3_moe_q8_0_gguf_keeps_its_blocks_and_is_batch_invariant(qwen3_moe_sparse_dir: str,
                                                                    qwen3_moe_ggufs: dict[str, str]) -> None:
    """A Q8_0 file's experts stay Q8_0 blocks (never widened). On float32 activations: transformers' tokens and
    logprobs on the weights rounded as Q8_0 rounds them. On the default 8-bit activations (interleaved x16
    experts): a needle request's tokens and logprobs are the same bits alone and among other requests."""
    path = qwen3_moe_ggufs["q8_0"]
    llm = LLM(path, **ENGINE, gguf_activations="float32")
    experts = llm.llm_engine.model_runner.model.model.layers[0].mlp.experts
    assert experts.gate_up.quant_method.name == "gguf-q8_0" and experts.down.quant_method.name == "gguf-q8_0"
    assert experts.gate_up.qweight.shape == (NUM_EXPERTS * 2 * 32, 64 // 32 * 34)
    hf = _hf(qwen3_moe_sparse_dir)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2 and not name.endswith("mlp.gate.weight"):  # the router stays F32 in the file
                p.copy_(_q8_0_rounded(p))
    _check_against_transformers(llm, hf, _prompts(11))
    del llm
    llm = LLM(path, **ENGINE)  # gguf_activations="int8", the default
    assert llm.llm_engine.model_runner.model.model.layers[1].mlp.experts.down.quant_method.name == "gguf-q8_0-x16"
    needle, others = _prompts(3)[0], _prompts(4) + _prompts(6)
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True, logprobs=3)
    alone = llm.generate([{"prompt_token_ids": needle}], params, use_tqdm=False)[0].outputs[0]
    crowd = llm.generate([{"prompt_token_ids": p} for p in (others[0], needle, *others[1:])], params,
                         use_tqdm=False)[1].outputs[0]
    assert crowd.token_ids == alone.token_ids
    assert [{t: lp.logprob for t, lp in d.items()} for d in crowd.logprobs] == \
        [{t: lp.logprob for t, lp in d.items()} for d in alone.logprobs]


def test_stacked_3d_experts_load_as_the_per_expert_folder(qwen3_moe_dir: str, tmp_path) -> None:  # noqa: ANN001
    """transformers 5's in-memory experts (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``)
    written as they are load as the per-expert tensors a saved folder holds: the same greedy tokens and logprobs."""
    import shutil

    from safetensors.torch import save_file

    from pagedllm.loader.hf_loader import iter_weights

    fused = tmp_path / "fused"
    shutil.copytree(qwen3_moe_dir, fused)
    hf = _hf(qwen3_moe_dir)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (NUM_EXPERTS, 64, 64)
    for f in fused.glob("*.safetensors"):
        f.unlink()
    save_file(state, str(fused / "model.safetensors"))
    assert not any(".experts.0." in name for name, _ in iter_weights(str(fused)))
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True, logprobs=2)
    prompt = [{"prompt_token_ids": _prompts(13)[1]}]
    want = LLM(qwen3_moe_dir, **ENGINE).generate(prompt, params, use_tqdm=False)[0].outputs[0]
    got = LLM(str(fused), **ENGINE).generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert [{t: lp.logprob for t, lp in d.items()} for d in got.logprobs] == \
        [{t: lp.logprob for t, lp in d.items()} for d in want.logprobs]


@pytest.mark.parametrize(("fields", "message"), [
    ({"shared_expert_intermediate_size": 128}, "shared_expert_intermediate_size=128, which the 'qwen3_moe'"),
    ({"routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5"),
    ({"scoring_func": "sigmoid"}, "scoring_func"),
    ({"n_group": 4}, "n_group=4"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok must be between 1 and num_experts=8"),
    ({"num_experts_per_tok": None}, "num_experts_per_tok must be a positive integer"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer"),
    ({"mlp_only_layers": "1"}, "mlp_only_layers must be a list"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
])
def test_qwen3_moe_fields_it_does_not_compute_are_refused_by_name(fields: dict, message: str) -> None:
    """Experts' fields of other families (shared experts, scaled, sigmoid or grouped routers) and bad values."""
    from pagedllm.loader.model_config import from_hf_config

    with pytest.raises(ValueError, match=message):
        from_hf_config({**_tiny_config().to_dict(), "architectures": ["Qwen3MoeForCausalLM"], **fields})


def test_qwen3_moe_dense_layers_follow_decoder_sparse_step_and_mlp_only_layers() -> None:
    """Layer i is sparse unless listed in mlp_only_layers or (i + 1) % decoder_sparse_step != 0
    (``Qwen3MoeDecoderLayer``); the window of use_sliding_window applies to every layer."""
    from pagedllm.loader.model_config import from_hf_config

    base = {**_tiny_config().to_dict(), "num_hidden_layers": 6}
    cfg = from_hf_config({**base, "mlp_only_layers": [], "decoder_sparse_step": 2})
    assert cfg.dense_layers == (0, 2, 4) and [cfg.is_sparse(i) for i in range(6)] == [False, True] * 3
    cfg = from_hf_config({**base, "mlp_only_layers": [3], "decoder_sparse_step": 1, "use_sliding_window": True,
                          "sliding_window": 64})
    assert cfg.dense_layers == (3,) and cfg.sliding_windows == (64,) * 6
    spec = Qwen3MoeForCausalLM.decoder_spec(cfg)
    assert [layer.moe is not None for layer in spec.layers] == [True, True, True, False, True, True]
    assert spec.layers[0].moe.router.renormalize and spec.layers[0].moe.router.top_k == TOP_K


def test_a_split_of_the_experts_that_leaves_a_rank_nothing_is_refused_by_name() -> None:
    """Experts split over the ranks (tests/distributed/test_tensor_parallel_moe.py); the shard plan refuses, before
    any rank loads, a split that leaves a rank no row of an expert."""
    from pagedllm.distributed.shard_plan import ShardPlan
    from pagedllm.loader.model_config import from_hf_config

    cfg = from_hf_config({**_tiny_config(moe_intermediate_size=1).to_dict(), "architectures": ["Qwen3MoeForCausalLM"]})
    assert ShardPlan.make(cfg, 0, 1).size == 1
    with pytest.raises(ValueError, match="more than each expert's intermediate size holds"):
        ShardPlan.make(cfg, 0, 2)


def _generate_all(llm: LLM, prompts: list[list[int]]) -> list:  # noqa: ANN001
    """Greedy outputs (tokens and top-5 logprobs) of ``prompts`` together, then of the first alone."""
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True, logprobs=5)
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    alone = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in (*together, *alone)]


def _expert_counts(llm: LLM) -> list[list[int]]:
    model = llm.llm_engine.model_runner.model
    return [[*m.expert_tokens.tolist(), int(m.num_forwards)] for m in model.modules() if isinstance(m, MoEBlock)]


@pytest.mark.slow  # converts the checkpoint in a subprocess (seconds)
def test_qwen3_moe_gguf_decode_steps_are_captured_with_the_eager_bits(qwen3_moe_ggufs: dict[str, str]) -> None:
    """A Q8_0 file (the grouped op, interleaved x16 rows): its decode steps are traced and replayed (the routing
    in tensors), and give the eager model's tokens and logprobs bit for bit, a sequence's alike alone and beside
    others of other lengths (rows past a step's are never routed); the expert-load counters count what eager
    steps count, the captured steps' included."""
    path = qwen3_moe_ggufs["q8_0"]
    prompts = [*_prompts(11), [7, 8, 9]]  # 33, 7 and 3 tokens: steps of 3 rows, then the one alone
    eager = LLM(path, **ENGINE, enable_prefix_caching=False, enforce_eager=True)
    assert eager.llm_engine.model_runner.captured_decode is None
    want, want_counts = _generate_all(eager, prompts), _expert_counts(eager)
    del eager
    llm = LLM(path, **ENGINE, enable_prefix_caching=False, capture_min_decode_steps=0)
    captured = llm.llm_engine.model_runner.captured_decode
    assert captured is not None
    got = _generate_all(llm, prompts)
    assert captured.failed is None and captured.graphs
    assert got == want
    assert got[0] == got[-1]  # batch invariance: the first prompt alone as among the others
    assert _expert_counts(llm) == want_counts
    top_k = 2  # qwen3_moe_sparse_dir's
    num_tokens = sum(len(p) + GENERATED - 1 for p in (*prompts, prompts[0]))  # the last token is never fed
    assert all(sum(c[:-1]) == top_k * num_tokens for c in want_counts)
    assert llm.llm_engine.block_manager.num_free_blocks == ENGINE["num_kv_blocks"]
