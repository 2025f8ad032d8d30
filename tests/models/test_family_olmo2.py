"""OLMo 2 (``Olmo2ForCausalLM``, GGUF ``olmo2``) against transformers on the same tiny random weights.

What sets it apart is checked where it can fail: the branches read the
residual stream un-normed and their outputs are normed (a pre-norm layout
would give other tokens), and q/k are RMS-normed over the whole projection
(a per-head norm gives another mean square per head). The norm weights are
drawn at random (transformers starts them at one), so that a norm loaded
into the wrong place changes the result.

The folder runs with the native kernels (float32, the default) and the
torch layers; the files of llama.cpp's own converter (F32, F16) on float32
activations and KV cache must give transformers' greedy tokens and its
logprobs within ``LOGPROB_TOL`` (transformers runs the weights rounded as
the file stores them: only summation order differs, measured ~1e-5).
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import hf_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.distributed.shard_plan import ShardPlan
from pagedllm.kernels import load_kernels
from pagedllm.layers.attention import make_backend
from pagedllm.layers.decoder import DecoderLayerSpec
from pagedllm.layers.native_ops import NativeOps
from pagedllm.layers.norm import NormSpec, RMSNorm
from pagedllm.layers.qk_rotary import QKNormRotary
from pagedllm.layers.rotary import RopeSpec, RotaryEmbedding, RotaryTables
from pagedllm.layers.self_attention import AttentionSpec, SelfAttention
from pagedllm.loader import load_model_config
from pagedllm.loader.model_config import from_hf_config
from pagedllm.models.olmo2 import Olmo2ForCausalLM

LOGPROB_TOL = 1e-4
GENERATED = 16
ENGINE = dict(max_model_len=256, num_kv_blocks=64, block_size=8, kv_cache_dtype="float32")


def _tiny_olmo2_config():  # noqa: ANN202
    from transformers import Olmo2Config

    # conftest's tiny shapes (GQA: 4 query heads on 2 KV heads), Olmo2's own eps default (1e-5, left out)
    return Olmo2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                       pad_token_id=0, rope_theta=10000.0)


@pytest.fixture(scope="session")
def olmo2_dir(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> str:  # noqa: ANN001
    """A tiny random OLMo 2 saved as a safetensors folder, norm weights drawn from [0.5, 1.5)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(_tiny_olmo2_config(), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("tiny-olmo2")
    model.save_pretrained(path, safe_serialization=True)
    smollm_tokenizer.save_pretrained(path)
    return str(path)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in (40, 9)]


def _hf(path: str, round_matrices_to_f16: bool = False):  # noqa: ANN202
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if round_matrices_to_f16:  # the converter writes matrices in the outtype, vectors in F32
        with torch.no_grad():
            for p in hf.parameters():
                if p.dim() == 2:
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


def _check_against_transformers(llm: LLM, hf, prompts: list[list[int]], logprobs: bool = True) -> None:  # noqa: ANN001
    """Greedy tokens equal transformers'; with ``logprobs``, every reported logprob within LOGPROB_TOL of its."""
    top = 5 if logprobs else None
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True, logprobs=top, prompt_logprobs=top)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, GENERATED)
        if logprobs:
            assert _max_logprob_error(hf, out) < LOGPROB_TOL


@pytest.mark.parametrize("native", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_olmo2_folder_matches_transformers(native: bool, olmo2_dir: str) -> None:
    """The folder's model, native kernels or torch layers: transformers' tokens (and, in the slow tier, its
    logprobs); its layers are post-normed (no input or pre-MLP norm) with q/k norms over whole projections."""
    cfg = load_model_config(olmo2_dir)
    assert cfg.architecture == "olmo2" and cfg.qk_norm and cfg.rms_norm_eps == 1e-5  # Olmo2Config's default
    hf = _hf(olmo2_dir)
    # native: decode steps traced and replayed from the first one (the projection norms' copies included)
    llm = LLM(olmo2_dir, **ENGINE, capture_min_decode_steps=0 if native else 512)
    model = llm.llm_engine.model_runner.model
    layer = model.model.layers[0]
    assert isinstance(model, Olmo2ForCausalLM)
    assert not hasattr(layer, "input_layernorm") and not hasattr(layer, "pre_feedforward_layernorm")
    assert layer.self_attn.q_norm.weight.shape == (4 * 16,) and layer.self_attn.k_norm.weight.shape == (2 * 16,)
    assert layer.self_attn.native is not None  # float32: the native path
    if not native:
        model.use_native_ops(None)
    _check_against_transformers(llm, hf, _prompts(5)[:1] if native else _prompts(5), logprobs=not native)
    if native:
        captured = llm.llm_engine.model_runner.captured_decode
        assert captured.failed is None and captured.graphs
    assert llm.llm_engine.block_manager.num_free_blocks == ENGINE["num_kv_blocks"]


@pytest.mark.parametrize("rotate", [True, False])
def test_qk_norm_over_the_projection_in_either_implementation(rotate: bool) -> None:
    """q and k each RMS-normed over a token's whole projection, then rotated: torch and native agree with the
    reference; a per-head norm would not."""
    gen = torch.Generator().manual_seed(7)
    num_heads, num_kv_heads, head_dim, rows = 4, 2, 16, 6
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    norms = (RMSNorm(q_size, 1e-5), RMSNorm(kv_size, 1e-5))
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(torch.rand(norm.weight.shape, generator=gen) + 0.5)
    layer = QKNormRotary(num_heads, num_kv_heads, head_dim, *norms, rotate=rotate, whole_projection=True)
    # rows of very different scale per head, so that per-head and whole-projection norms differ
    qkv = torch.randn(rows, q_size + 2 * kv_size, generator=gen) * torch.linspace(0.1, 4.0, q_size + 2 * kv_size)
    tables = RotaryTables({"default": RopeSpec(head_dim, 64, 10000.0)})
    cos_sin = tables.cos_sin(torch.arange(3, 3 + rows), torch.float32)["default"] if rotate else None

    def ref_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # transformers' Olmo2RMSNorm
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))

    q = ref_norm(qkv[:, :q_size], norms[0].weight.detach()).view(rows, num_heads, head_dim)
    k = ref_norm(qkv[:, q_size : q_size + kv_size], norms[1].weight.detach()).view(rows, num_kv_heads, head_dim)
    if rotate:
        q, k = RotaryEmbedding.apply(q, cos_sin), RotaryEmbedding.apply(k, cos_sin)
    with torch.no_grad():  # as the engine runs (the norms' weights are parameters)
        got_q, got_k = layer(qkv.clone(), cos_sin)
    torch.testing.assert_close(got_q, q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, k, rtol=1e-6, atol=1e-6)
    lib = load_kernels()
    assert lib is not None, "the native kernels must build on the test machine"
    layer.select_impl(NativeOps(lib))
    before = qkv.clone()
    with torch.no_grad():
        native_q, native_k = layer(qkv, cos_sin)
    torch.testing.assert_close(native_q, q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native_k, k, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, q_size + kv_size :], before[:, q_size + kv_size :])  # v untouched
    per_head = ref_norm(before[:, :q_size].view(rows, num_heads, head_dim), norms[0].weight.detach()[:head_dim])
    assert not torch.allclose(per_head.view(rows, -1), ref_norm(before[:, :q_size], norms[0].weight.detach()))


class _OtherRankSums:
    """Stands in for a two-rank group: ``all_reduce_`` adds the other rank's sums of squares ``[rows, 2]``."""

    size = 2

    def __init__(self, other: torch.Tensor) -> None:
        self.other = other

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(self.other)


def test_qk_norm_over_a_projection_split_over_ranks_in_either_implementation() -> None:
    """Each of two ranks' layers (2 of 4 q heads, 1 of 2 KV heads, its slices of the norm weights), given the
    other rank's sums of squares, gives its heads of the whole layer's q and k, torch and native alike."""
    from pagedllm.layers.parallel import ParallelRMSNorm

    gen = torch.Generator().manual_seed(11)
    head_dim, rows, eps = 16, 5, 1e-5
    qkv = torch.randn(rows, 8 * head_dim, generator=gen) * torch.linspace(0.1, 4.0, 8 * head_dim)
    q_all, k_all, v_all = qkv.split([4 * head_dim, 2 * head_dim, 2 * head_dim], dim=1)
    q_weight, k_weight = torch.rand(4 * head_dim, generator=gen) + 0.5, torch.rand(2 * head_dim, generator=gen) + 0.5
    tables = RotaryTables({"default": RopeSpec(head_dim, 64, 10000.0)})
    cos_sin = tables.cos_sin(torch.arange(2, 2 + rows), torch.float32)["default"]

    def whole(x: torch.Tensor, w: torch.Tensor, heads: int) -> torch.Tensor:  # transformers' Olmo2RMSNorm, rotated
        normed = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
        return RotaryEmbedding.apply(normed.view(rows, heads, head_dim), cos_sin)

    want_q, want_k = whole(q_all, q_weight, 4), whole(k_all, k_weight, 2)
    lib = load_kernels()
    for rank in (0, 1):
        q_cols, k_cols = slice(32 * rank, 32 * rank + 32), slice(16 * rank, 16 * rank + 16)
        q_other = q_all.square().sum(-1, keepdim=True) - q_all[:, q_cols].square().sum(-1, keepdim=True)
        k_other = k_all.square().sum(-1, keepdim=True) - k_all[:, k_cols].square().sum(-1, keepdim=True)
        group = _OtherRankSums(torch.cat([q_other, k_other], dim=1))
        norms = (ParallelRMSNorm(NormSpec(eps), 32, group, 32 * rank, 64),
                 ParallelRMSNorm(NormSpec(eps), 16, group, 16 * rank, 32))
        with torch.no_grad():
            norms[0].weight.copy_(norms[0].checkpoint_slice("weight", q_weight))
            norms[1].weight.copy_(norms[1].checkpoint_slice("weight", k_weight))
        layer = QKNormRotary(2, 1, head_dim, *norms, whole_projection=True)
        local = torch.cat([q_all[:, q_cols], k_all[:, k_cols], v_all[:, k_cols]], dim=1)
        for ops in (None, NativeOps(lib) if lib is not None else None):
            layer.select_impl(ops)
            with torch.no_grad():
                got_q, got_k = layer(local.clone(), cos_sin)
            torch.testing.assert_close(got_q, want_q[:, 2 * rank : 2 * rank + 2], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_k, want_k[:, rank : rank + 1], rtol=1e-5, atol=1e-5)


def test_olmo2_blocks_refuse_what_they_cannot_compute() -> None:
    """A layer with no norm at all, an unknown q/k-norm span, and a tensor-parallel rank's whole-projection norm
    given a checkpoint weight that is not the whole projection's are ValueErrors."""
    norm = NormSpec(1e-5)
    attention = AttentionSpec(64, 4, 2, 16, qk_norm=norm, qk_norm_span="projection")
    with pytest.raises(ValueError, match="pre_norms"):
        DecoderLayerSpec(attention, 128, "silu", norm, pre_norms=False, post_norms=False)
    with pytest.raises(ValueError, match="qk_norm_span"):
        AttentionSpec(64, 4, 2, 16, qk_norm=norm, qk_norm_span="group")
    cfg = from_hf_config(_tiny_olmo2_config().to_dict())
    tp = TensorParallelGroup(ShardPlan.make(cfg, 0, 2))
    backend = make_backend("reference", "cpu", torch.float32)
    local = AttentionSpec(64, 2, 1, 16, qk_norm=norm, qk_norm_span="projection")
    with pytest.raises(ValueError, match="whole projection"), torch.device("meta"):
        # a rank's whole-projection norm takes its slice of the checkpoint's weight, of the whole size only
        SelfAttention(local, backend, tp).q_norm.checkpoint_slice("weight", torch.ones(32))


def test_olmo2_ranks_hold_their_heads_slice_of_the_qk_norms() -> None:
    """Over 2 ranks a layer's q/k norms are ParallelRMSNorms of its heads' features (2 of 4 q heads, 1 of 2 KV
    heads), each taking those features of the checkpoint's whole weight."""
    from pagedllm.layers.parallel import ParallelRMSNorm

    cfg = from_hf_config(_tiny_olmo2_config().to_dict())
    backend = make_backend("reference", "cpu", torch.float32)
    local = AttentionSpec(64, 2, 1, 16, qk_norm=NormSpec(1e-5), qk_norm_span="projection")
    whole_q, whole_k = torch.arange(64.0), torch.arange(32.0)
    for rank in (0, 1):
        attn = SelfAttention(local, backend, TensorParallelGroup(ShardPlan.make(cfg, rank, 2)))
        assert isinstance(attn.q_norm, ParallelRMSNorm) and isinstance(attn.k_norm, ParallelRMSNorm)
        assert (attn.q_norm.start, attn.q_norm.total_dim, attn.k_norm.start, attn.k_norm.total_dim) == (
            32 * rank, 64, 16 * rank, 32)
        assert attn.q_norm.checkpoint_slice("weight", whole_q).tolist() == list(range(32 * rank, 32 * rank + 32))
        assert attn.k_norm.checkpoint_slice("weight", whole_k).tolist() == list(range(16 * rank, 16 * rank + 16))


@pytest.mark.slow  # converts the checkpoint in subprocesses (seconds each)
# F16 only: the converter writes this family's own tensors (vectors, norms, the q/k norms) in F32 in either outtype, so
# its F16 file holds both types; an all-F32 file's matrices are read as any family's (tests/models/
# test_gguf_converted.py's Llama F32 file)
@pytest.mark.parametrize("outtype", ["f16"])
def test_olmo2_converter_gguf_matches_transformers(outtype: str, olmo2_dir: str, tmp_path_factory,  # noqa: ANN001
                                                  gguf_converter) -> None:  # noqa: ANN001
    """llama.cpp's converter writes OLMo 2 as architecture 'olmo2' (q/k rows unpermuted, post_attention_norm,
    post_ffw_norm, whole-projection q/k norms): transformers' tokens and logprobs on float32 activations."""
    path = gguf_converter.convert(olmo2_dir, outtype, str(tmp_path_factory.mktemp("olmo2-gguf") / f"olmo2-{outtype}.gguf"))
    cfg = load_model_config(path)
    assert (cfg.architecture, cfg.qk_norm, cfg.checkpoint_format) == ("olmo2", True, "gguf")
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    llm = LLM(path, **ENGINE, gguf_activations="float32")
    assert isinstance(llm.llm_engine.model_runner.model, Olmo2ForCausalLM)
    _check_against_transformers(llm, _hf(olmo2_dir, round_matrices_to_f16=outtype == "f16"), _prompts(9))
