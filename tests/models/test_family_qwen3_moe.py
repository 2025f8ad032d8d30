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


def _tiny_config():  # noqa: ANN202
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True,
                          mlp_only_layers=[1], max_position_embeddings=1024, initializer_range=0.2,
                          tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="session")
def qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> str:  # noqa: ANN001
    """A tiny random Qwen3-MoE saved as a safetensors folder, norm weights drawn from [0.5, 1.5)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(4321)
    model = AutoModelForCausalLM.from_config(_tiny_config(), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    model.save_pretrained(path, safe_serialization=True)
    smollm_tokenizer.save_pretrained(path)
    return str(path)


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
