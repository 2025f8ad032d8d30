"""Captured decode steps of hybrid models (state layers) give the eager model's tokens and logprobs, bit for bit.

One tiny random checkpoint per family whose decode is captured (dense MLPs:
a mixture of experts from a folder decodes eagerly): Qwen3.5 (Gated
DeltaNet: a causal conv then the gated delta rule), LFM2 (gated short
convs) and Granite 4.0-H without experts (Mamba-2: a causal conv then the
SSD scan), each beside attention layers. The same schedule of requests runs
twice on one engine, its decode steps first replayed from the captured
graph, then run eagerly: requests of different prompt lengths join at
different steps and leave at different lengths, one samples two outputs
(n=2, seeded, forked from its prompt's state), and the KV pool is too small
for all of them, so some are preempted and recomputed. Tokens and logprobs
must be equal, not close: a replayed step runs the same kernels on the same
rows as the eager one. A counter on the captured path makes the test fail
if capture fell back to eager steps.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.runner.capture.captured_decode import CapturedDecode
from pagedllm.runner.capture.decode_graph import PythonCall

ENGINE = dict(max_model_len=96, num_kv_blocks=14, block_size=8, kv_cache_dtype="float32", max_num_seqs=6,
              max_num_batched_tokens=32, enable_prefix_caching=False, capture_min_decode_steps=0)
COMMON = dict(vocab_size=49152, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=1024, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _config(family: str):  # noqa: ANN202
    if family == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(**COMMON, intermediate_size=96, head_dim=16, linear_num_key_heads=2,
                                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                 linear_conv_kernel_dim=4, tie_word_embeddings=False)
    if family == "lfm2":
        from transformers import Lfm2Config

        return Lfm2Config(**COMMON, intermediate_size=192, layer_types=["conv", "conv", "full_attention", "conv"],
                          conv_L_cache=3, block_multiple_of=32)
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(
        **COMMON, intermediate_size=32, tie_word_embeddings=False, layer_types=["mamba", "attention", "mamba", "mamba"],
        num_local_experts=0, shared_intermediate_size=48, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
        mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, embedding_multiplier=2.0,
        residual_multiplier=0.5, attention_multiplier=0.25, logits_scaling=2.0, position_embedding_type=None)


FAMILIES = ["qwen3_5", "lfm2", "granitemoehybrid"]
# the native ops of the state layers' decode that must be program nodes, not Python calls between programs
STATE_NODES = {"causal_conv1d_decode", "gated_delta_decode", "ssd_decode"}


@pytest.fixture(scope="module", params=FAMILIES)
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> str:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    torch.manual_seed(4321)
    model = AutoModelForCausalLM.from_config(_config(request.param), dtype=torch.float32)
    with torch.no_grad():  # norms, decays and steps at random: a wrong state changes the tokens
        for name, param in model.named_parameters():
            if "norm" in name:  # Qwen3.5's norms but the gated one multiply by 1 + w
                offset = request.param == "qwen3_5" and not name.endswith("linear_attn.norm.weight")
                param.uniform_(-0.5, 0.5) if offset else param.uniform_(0.5, 1.5)
            elif name.endswith(("A_log", "dt_bias")):
                param.uniform_(-1.0, 1.0)
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model.save_pretrained(path, safe_serialization=True)
    smollm_tokenizer.save_pretrained(path)
    return str(path)


class _Counting:
    """The runner's captured decode, counting the steps it replays (a fall back to eager steps leaves 0)."""

    def __init__(self, path: CapturedDecode) -> None:
        self.path = path
        self.rows: list[int] = []

    def accepts(self, meta: Any, num_tokens: int) -> bool:  # noqa: ANN401
        return self.path.accepts(meta, num_tokens)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:  # noqa: ANN401
        self.rows.append(input_ids.shape[0])
        return self.path(input_ids, positions, meta)


def _schedule() -> list[tuple[int, str, list[int], SamplingParams]]:
    """(engine step it joins at, id, prompt, params): lengths 1 to 37, 6 to 30 new tokens, one n=2 request.

    The one-token prompt (r5) joins among decodes: its step is one token per sequence like a decode step, but
    its row starts from a zero state, not from its slot's last owner's (the captured path leaves that step to
    the eager model; a slot read as a continuation would change r5's tokens)."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for i, (join, length, new) in enumerate([(0, 5, 30), (0, 23, 12), (3, 37, 20), (6, 9, 6), (9, 14, 25),
                                             (12, 1, 10)]):
        prompt = torch.randint(100, 40000, (length,), generator=gen).tolist()
        out.append((join, f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=2)))
    fork = torch.randint(100, 40000, (11,), generator=gen).tolist()
    out.append((4, "fork", fork, SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True,
                                                logprobs=1)))
    return out


def _run(llm: LLM) -> dict[str, list[tuple[list[int], Any]]]:  # noqa: ANN401
    """Each request's outputs' (tokens, logprobs), the requests joining at their steps."""
    engine = llm.llm_engine
    pending = _schedule()
    done: dict[str, list[tuple[list[int], Any]]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(list(c.token_ids), c.logprobs) for c in out.outputs]
        step += 1
    return done


def test_captured_hybrid_decode_equals_eager(folder: str) -> None:
    """Qwen3.5, LFM2 and Granite 4.0-H (no experts) folders: replayed decode steps give the eager tokens and
    logprobs exactly, through joins, leaves, an n=2 fork and preemptions."""
    _check_replayed_equals_eager(LLM(folder, **ENGINE))


@pytest.mark.slow  # converts the checkpoint in a subprocess
def test_captured_moe_hybrid_gguf_equals_eager(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer,  # noqa: ANN001
                                               gguf_converter) -> None:  # noqa: ANN001
    """Qwen3-Next (every MLP a mixture of experts) from llama.cpp's Q8_0 file: its experts are grouped GGUF
    blocks, whose routing stays in tensors, so its decode is captured too (a folder's experts are not)."""
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    cfg = Qwen3NextConfig(**COMMON, intermediate_size=96, head_dim=16, linear_num_key_heads=2,
                          linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                          linear_conv_kernel_dim=4, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=True)
    torch.manual_seed(4321)
    folder = tmp_path_factory.mktemp("tiny-qwen3_next")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder, safe_serialization=True)
    smollm_tokenizer.save_pretrained(folder)
    path = gguf_converter.convert(str(folder), "q8_0", str(folder / "qwen3_next-q8_0.gguf"))
    _check_replayed_equals_eager(LLM(path, **ENGINE, gguf_activations="float32"))


def _check_replayed_equals_eager(llm: LLM) -> None:
    """The schedule replayed, then eager on the same engine: equal outputs, steps really replayed."""
    runner = llm.llm_engine.model_runner
    captured = runner.captured_decode
    assert isinstance(captured, CapturedDecode) and captured.state_layers
    scheduler, bm = llm.llm_engine.scheduler, llm.llm_engine.block_manager
    counting = _Counting(captured)
    runner.captured_decode = counting
    replayed = _run(llm)
    preempted = scheduler.num_preemptions
    runner.captured_decode = None  # every step through the model's modules
    eager = _run(llm)
    runner.captured_decode = captured
    assert captured.failed is None and captured.num_traces >= 1
    # decode steps of several sizes were replayed (the sequences joined and left), and the pool was tight
    assert len(counting.rows) >= 20 and len(set(counting.rows)) >= 3, counting.rows
    assert preempted > 0 and scheduler.num_preemptions == 2 * preempted
    assert sorted(replayed) == sorted(eager) == ["fork", "r0", "r1", "r2", "r3", "r4", "r5"]
    assert len(replayed["fork"]) == 2 and replayed["fork"][0][0] != replayed["fork"][1][0]
    for rid in eager:
        assert replayed[rid] == eager[rid], rid
    # the state layers' decode kernels are nodes of the native programs, not Python calls between them
    for graph in captured.graphs.values():
        calls = {getattr(run.op, "_opname", str(run.op)) for run in graph.runs if isinstance(run, PythonCall)}
        assert not calls & STATE_NODES, calls
    assert bm.num_free_blocks == ENGINE["num_kv_blocks"]
