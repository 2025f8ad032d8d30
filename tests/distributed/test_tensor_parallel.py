"""Tensor parallelism: the shard plan, and two real ranks (gloo, processes) against one process and transformers.

Every engine here has ``tensor_parallel_size=2`` with one thread per rank:
rank 0 is this test process, rank 1 a process it spawns. One
tensor-parallel engine may live in a process at a time. The tests that only
generate and compare share one engine per configuration (``two_ranks``:
consecutive tests asking for the same settings get the same engine, asked
for other settings it shuts the engine down and starts the next); a test
about start-up, shutdown or a failing rank starts its own (``two_ranks.own``,
which shuts the shared one down first).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import FLOAT_ACTIVATIONS, assert_greedy_within_q8_noise, hf_greedy
from server_helpers import free_port

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.distributed.cpu_bind import parse_cpu_bind
from pagedllm.distributed.group import DistributedError
from pagedllm.distributed.launch import pin_rank, rank_threads
from pagedllm.distributed.shard_plan import ShardPlan, split_evenly
from pagedllm.loader import bundled_model_path, load_model_config

PROMPTS = ["The capital of France is", "Write a list of colors:", "def fibonacci(n):", "Once upon a time, in a"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
ORACLE_TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    """Rank 0 sizes this process's thread pool and may bind its cores: put both back."""
    threads, cores = torch.get_num_threads(), os.sched_getaffinity(0)
    yield
    torch.set_num_threads(threads)
    os.sched_setaffinity(0, cores)


ONE_PROCESS_KV = {"kv_cache_dtype": "float32"}


def _tp(path: str | None, size: int, **kwargs: object) -> LLM:
    kwargs.setdefault("num_kv_blocks", 128)
    kwargs.setdefault("max_model_len", 256)
    # ranks and one process agree to float rounding (conftest): a rank's slice of a sum is rounded on its own,
    # so two ranks are not one process's bits, whatever the mode (batch_invariant holds within one engine)
    # and a float32 cache (ONE_PROCESS_KV): a float16 one, the GGUF default, would round those sums again,
    # now and then across a float16 step
    for key, value in {**FLOAT_ACTIVATIONS, **ONE_PROCESS_KV}.items():
        kwargs.setdefault(key, value)
    return LLM(path, tensor_parallel_size=size, num_threads=1, **kwargs)


def _tokens(outs: list) -> list[list[int]]:
    return [list(c.token_ids) for o in outs for c in o.outputs]


class TwoRankEngines:
    """The two-rank engines of this module, one alive at a time (one tensor-parallel group per process).

    ``shared``: the engine of these settings, kept for the next test that asks for the same ones (a test
    hands it back with no request unfinished and no KV block in use: checked when it is handed out again
    and at the end). ``own``: a fresh engine the test shuts down itself (start-up, shutdown, a failing rank).
    """

    def __init__(self) -> None:
        self._settings: tuple | None = None
        self._llm: LLM | None = None

    def shared(self, path: str | None, **kwargs: object) -> LLM:
        """The shared engine of ``_tp(path, 2, **kwargs)``, started if the last one had other settings."""
        settings = (path, sorted(kwargs.items()))
        if self._llm is None or settings != self._settings:
            self.close()
            self._llm, self._settings = _tp(path, 2, **kwargs), settings
        else:
            self._check_idle(self._llm)
            # _restore_threads put this process's thread pool back after the last test: rank 0's again
            pin_rank(None, rank_threads(1, None, 2))
        return self._llm

    def own(self, path: str | None, **kwargs: object) -> LLM:
        """A new engine of ``_tp(path, 2, **kwargs)`` for the caller alone (the shared one is shut down first)."""
        self.close()
        return _tp(path, 2, **kwargs)

    def close(self) -> None:
        """Shut the shared engine down (checking that it was left idle), if one is up."""
        llm, self._llm, self._settings = self._llm, None, None
        if llm is not None:
            try:
                self._check_idle(llm)
            finally:
                llm.shutdown()

    @staticmethod
    def _check_idle(llm: LLM) -> None:
        engine = llm.llm_engine
        if engine.has_unfinished_requests() or engine.block_manager.num_used_blocks:
            raise AssertionError(f"a test left the shared engine busy: {engine.block_manager.num_used_blocks} "
                                 "KV blocks in use")


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[TwoRankEngines]:
    """This module's two-rank engines; at its end the shared one is shut down and no worker process is left."""
    engines = TwoRankEngines()
    yield engines
    engines.close()
    assert multiprocessing.active_children() == []


# --- the plan (no processes) ---------------------------------------------------------


def test_split_evenly_gives_the_remainder_to_the_first_parts() -> None:
    assert split_evenly(9, 2) == [(0, 5), (5, 4)]
    assert split_evenly(8, 4) == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert split_evenly(3, 3) == [(0, 1), (1, 1), (2, 1)]


def test_smollm2_heads_split_by_kv_group() -> None:
    """9 query heads on 3 KV heads over 2 ranks: 2 + 1 groups, so 6 + 3 query heads; nothing else uneven."""
    cfg = load_model_config(bundled_model_path())
    plans = [ShardPlan.make(cfg, r, 2) for r in range(2)]
    assert [p.kv_heads for p in plans] == [(0, 2), (2, 1)]
    assert [p.q_heads for p in plans] == [(0, 6), (6, 3)]
    assert [p.q_rows for p in plans] == [(0, 6 * 64), (6 * 64, 3 * 64)]
    assert [p.intermediate for p in plans] == [(0, 768), (768, 768)]
    assert [p.vocab for p in plans] == [(0, 24576), (24576, 24576)]
    local = plans[1].local_config(cfg)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (3, 1, 768)
    assert local.hidden_size == cfg.hidden_size and local.vocab_size == cfg.vocab_size


def test_more_ranks_than_kv_heads_is_refused() -> None:
    cfg = load_model_config(bundled_model_path())
    with pytest.raises(ValueError, match="more than the model's 3 KV heads"):
        ShardPlan.make(cfg, 0, 4)


def test_cpu_bind_lists() -> None:
    assert parse_cpu_bind("0-3|4-7", 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parse_cpu_bind("0,2|1,3", 2) == [[0, 2], [1, 3]]
    assert parse_cpu_bind(None, 2) is None
    with pytest.raises(ValueError, match="2 ranks"):
        parse_cpu_bind("0|1", 3)
    with pytest.raises(ValueError, match="not a core"):
        parse_cpu_bind("0-x|1", 2)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("tensor_parallel_size", 0, "tensor_parallel_size"),
    ("distributed_executor_backend", "ray", "distributed_executor_backend"),
    ("distributed_timeout_s", 0, "distributed_timeout_s"),
    ("cpu_bind", "0|1|2", "3 ranks"),
    ("all_reduce_backend", "mpi", "all_reduce_backend"),
])
def test_bad_settings_are_refused(field: str, value: object, match: str) -> None:
    kwargs = {"tensor_parallel_size": 2, field: value}
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="m.gguf", **kwargs)


# --- the shared-memory all-reduce op (one process) ---------------------------------------


def _shm_tensors(size: int, capacity: int, pids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    slots = torch.zeros(2, size, capacity)  # [2, ranks, capacity]
    return slots, torch.zeros(size, dtype=torch.int64), torch.tensor(pids, dtype=torch.int64)


def test_shm_all_reduce_of_one_rank_keeps_the_values_and_counts_calls() -> None:
    from pagedllm.kernels import load_kernels

    if load_kernels() is None:
        pytest.skip("native kernels unavailable")
    slots, flags, pids = _shm_tensors(1, 64, [os.getpid()])
    x = torch.randn(3, 7)
    y = x.clone()
    for call in (1, 2, 3):
        torch.ops.pagedllm.shm_all_reduce(y, slots, flags, pids, 0, 1.0)
        assert torch.equal(y, x) and int(flags[0]) == call
    # the call used the slots of its parity: call 3 wrote parity 1
    assert torch.equal(slots[1, 0, :21], x.flatten())


def test_shm_all_reduce_bounds_its_wait() -> None:
    """A peer that never publishes: a RuntimeError after the timeout; a peer whose process is gone: at once."""
    from pagedllm.kernels import load_kernels

    if load_kernels() is None:
        pytest.skip("native kernels unavailable")
    slots, flags, pids = _shm_tensors(2, 64, [os.getpid(), os.getpid()])
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="waited more than"):
        torch.ops.pagedllm.shm_all_reduce(torch.ones(8), slots, flags, pids, 0, 0.3)
    assert 0.3 <= time.monotonic() - start < 5
    gone = subprocess.Popen(["true"])
    gone.wait()
    slots, flags, pids = _shm_tensors(2, 64, [os.getpid(), gone.pid])
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="process gone"):
        torch.ops.pagedllm.shm_all_reduce(torch.ones(8), slots, flags, pids, 0, 60.0)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(("x", "slots", "match"), [
    (torch.ones(100), torch.zeros(2, 2, 64), "exceed the slots' capacity"),
    (torch.ones(8, dtype=torch.float64), torch.zeros(2, 2, 64), "float32"),
    (torch.ones(8), torch.zeros(3, 2, 64), r"\[2, ranks, capacity\]"),
])
def test_shm_all_reduce_checks_its_tensors(x: torch.Tensor, slots: torch.Tensor, match: str) -> None:
    from pagedllm.kernels import load_kernels

    if load_kernels() is None:
        pytest.skip("native kernels unavailable")
    flags, pids = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match=match):
        torch.ops.pagedllm.shm_all_reduce(x, slots, flags, pids, 0, 1.0)


# --- two ranks --------------------------------------------------------------------------


# Qwen2's two-rank engine is also the shared-memory side of the gloo test (which runs next, on it): "shm"
# named, where the other models take "auto" (which resolves to the same on one machine)
TINY_SETTINGS = {"qwen2": {"all_reduce_backend": "shm"}}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_tiny_models_two_ranks_equal_one_and_transformers(arch: str, tiny_model_dirs, hf_tiny,  # noqa: ANN001
                                                          two_ranks: TwoRankEngines) -> None:
    """Llama, Qwen2 (q/k/v biases split with their rows) and Qwen3 (per-head q/k norms) over 2 ranks."""
    path = tiny_model_dirs[arch]
    one = _tp(path, 1, block_size=8)
    tok = one.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    expected = _tokens(one.generate([{"prompt_token_ids": i} for i in ids], GREEDY, use_tqdm=False))
    whole = one.weight_bytes
    two = two_ranks.shared(path, block_size=8, **TINY_SETTINGS.get(arch, {}))
    got = _tokens(two.generate([{"prompt_token_ids": i} for i in ids], GREEDY, use_tqdm=False))
    rank_bytes = two.llm_engine.model_runner.rank_bytes
    # the parameter count is the whole model's, summed over the ranks (replicated norms once)
    assert two.llm_engine.model_runner.num_params == one.llm_engine.model_runner.num_params
    assert got == expected
    assert got == [hf_greedy(hf_tiny[arch], i, GREEDY.max_tokens) for i in ids]
    # each rank holds about half the weights (norms are replicated, tiny here): measured on each rank
    for weights, _ in rank_bytes:
        assert 0.45 * whole < weights < 0.56 * whole, (weights, whole)
    # KV heads 2 -> 1 per rank: every rank's cache is half of one process's
    assert [kv for _, kv in rank_bytes] == [one.kv_cache_bytes // 2] * 2


def test_gloo_and_shared_memory_all_reduce_give_the_same_tokens(tiny_model_dirs,  # noqa: ANN001
                                                               two_ranks: TwoRankEngines) -> None:
    """gloo (the process group) is the shared-memory path's oracle: same tokens, same logprobs to rounding."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    runs = {}
    for backend in ("shm", "gloo"):  # "shm": the Qwen2 engine of the test above
        two = two_ranks.shared(tiny_model_dirs["qwen2"], block_size=8, all_reduce_backend=backend)
        assert (two.llm_engine.model_runner.tp.shm is not None) == (backend == "shm")
        runs[backend] = two.generate(PROMPTS, params, use_tqdm=False)
    assert _tokens(runs["gloo"]) == _tokens(runs["shm"])
    for a, b in zip(runs["gloo"], runs["shm"]):
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa)


def test_int4_weights_on_two_ranks_equal_one(tiny_model_dirs, two_ranks: TwoRankEngines) -> None:  # noqa: ANN001
    """Weight-only int4 in groups of 32, quantized by each rank from its slice: the shard boundaries fall on
    group boundaries, so the blocks are one process's blocks and so are the tokens."""
    path = tiny_model_dirs["llama"]
    one = _tp(path, 1, block_size=8, quantization="int4", quantization_group_size=32)
    expected = _tokens(one.generate(PROMPTS, GREEDY, use_tqdm=False))
    two = two_ranks.shared(path, block_size=8, quantization="int4", quantization_group_size=32)
    assert two.llm_engine.model_runner.weight_format == "int4-g32"
    got = _tokens(two.generate(PROMPTS, GREEDY, use_tqdm=False))
    weights = [w for w, _ in two.llm_engine.model_runner.rank_bytes]
    assert got == expected
    assert all(0.4 * one.weight_bytes < w < 0.6 * one.weight_bytes for w in weights), (weights, one.weight_bytes)


def test_a_q4_k_m_file_with_mixed_qkv_on_two_ranks(tiny_model_dirs: dict[str, str],
                                                   tmp_path_factory: pytest.TempPathFactory,
                                                   two_ranks: TwoRankEngines) -> None:
    """A Q4_K_M-like file (Q4_K q/k, Q6_K v and down_proj) over 2 ranks: each rank holds its slices of the fused
    q/k/v part by part in their types, and greedy tokens equal transformers' on the blocks' weights (float32
    activations), or part from them at near-ties only (8-bit activations, each rank's slices interleaved)."""
    from test_gguf_quantized import Q, _k_quant_model, write_quantized_gguf

    hf = _k_quant_model("llama")
    path = os.path.join(tmp_path_factory.mktemp("tp-k"), "tiny-Q4_K_M.gguf")
    hf.load_state_dict(write_quantized_gguf(hf, "llama", Q.Q4_K, path,
                                            {"v_proj.weight": Q.Q6_K, "down_proj.weight": Q.Q6_K}))
    prompts = [{"prompt_token_ids": [1, 400, 3000, 77, 12000, 5]}, {"prompt_token_ids": list(range(100, 140))}]
    two = two_ranks.shared(path, tokenizer=tiny_model_dirs["llama"])
    qkv = two.llm_engine.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.quant_method.name == "gguf-q4_k+q4_k+q6_k" and qkv.out_features == (256 + 2 * 128) // 2
    outs = two.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt["prompt_token_ids"], len(out.outputs[0].token_ids))
    two = two_ranks.shared(path, tokenizer=tiny_model_dirs["llama"], gguf_activations="int8")
    assert two.llm_engine.model_runner.model.model.layers[0].self_attn.qkv_proj.quant_method.name == (
        "gguf-q4_k-x16+q4_k-x16+q6_k-x16")
    outs = two.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert_greedy_within_q8_noise(hf, prompt["prompt_token_ids"], out.outputs[0].token_ids, group=256)


# fp8 is not run here: its head rows have int8's layout and rules (values, then one float32 scale per token
# and head: layers/kv_quant.py), so a rank's slice of them is int8's; its values are checked in one process
# (tests/models/test_kv_cache_dtype.py, tests/kernels/test_kv_int8.py)
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_int8_kv_cache_on_two_ranks_equals_one(tiny_model_dirs, kv_cache_dtype: str,  # noqa: ANN001
                                               two_ranks: TwoRankEngines) -> None:
    """An int8 / int4 cache's scales (and int4's rotation and fitted K/V transform) are per KV head, so a
    rank's slice of the heads carries its own: each rank holds half the cache bytes of one process (the same
    blocks, half the heads) and the tokens are one process's."""
    path = tiny_model_dirs["llama"]
    one = _tp(path, 1, block_size=8, kv_cache_dtype=kv_cache_dtype)
    expected = _tokens(one.generate(PROMPTS, GREEDY, use_tqdm=False))
    one_bytes = one.llm_engine.model_runner.kv_cache_bytes
    two = two_ranks.shared(path, block_size=8, kv_cache_dtype=kv_cache_dtype)
    got = _tokens(two.generate(PROMPTS, GREEDY, use_tqdm=False))
    kv_bytes = [kv for _, kv in two.llm_engine.model_runner.rank_bytes]
    assert got == expected
    assert kv_bytes == [one_bytes // 2] * 2, (kv_bytes, one_bytes)


@pytest.fixture(scope="module")
def smollm_one() -> LLM:
    # chunked prefill (64-token steps) and prefix caching on, as in the two-rank engine
    return LLM(None, num_kv_blocks=128, max_model_len=256, max_num_batched_tokens=64, num_threads=1,
               **FLOAT_ACTIVATIONS, **ONE_PROCESS_KV)


# The float engine of the two tests below: 64-token steps as smollm_one's, and a pool of 20 blocks of 16 tokens,
# too small for the preemption test's batch, ample for everything the other test runs (it checks that none
# of its requests was preempted)
SMALL_POOL = {"num_kv_blocks": 20, "block_size": 16, "max_num_batched_tokens": 64}


def _long_prompt(llm: LLM) -> list[int]:
    text = " ".join(f"Item {i}: a short line about the number {i}." for i in range(12))
    return llm.get_tokenizer().encode(text)


# The default activations for the bundled blocks, batch_invariant (on by default there, named for the
# batch-invariance test) and no prefix caching (so that a needle among neighbours is computed again there)
INT8_INVARIANT = {"gguf_activations": "int8", "batch_invariant": True, "enable_prefix_caching": False}


def test_bundled_model_two_ranks_on_8_bit_activations(hf_smollm, two_ranks: TwoRankEngines) -> None:  # noqa: ANN001
    """The default for the bundled blocks on 2 ranks: each rank's slices are interleaved and multiplied on
    int8 rows; greedy text is transformers' up to near-ties (conftest.assert_greedy_within_q8_noise).
    The engine is the batch-invariance test's (no prefix caching, which three unrelated prompts never use)."""
    two = two_ranks.shared(None, **INT8_INVARIANT)
    outs = two.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    assert two.llm_engine.model_runner.model.lm_head.quant_method.name == "gguf-q8_0-x16"
    for out in outs:
        assert_greedy_within_q8_noise(hf_smollm, out.prompt_token_ids, out.outputs[0].token_ids)


def test_two_ranks_keep_a_request_batch_invariant(two_ranks: TwoRankEngines) -> None:
    """batch_invariant on two ranks, on the default 8-bit activations: a needle's tokens, logprobs and prompt
    logprobs alone equal, bitwise, the same needle among neighbours and in 16-token chunks (each element of an
    all-reduce is one addition of two ranks' values, the same bits in either order)."""
    needle = {"prompt_token_ids": list(range(300, 350))}
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, prompt_logprobs=5, ignore_eos=True)
    neighbours = [{"prompt_token_ids": list(range(500 + 7 * i, 520 + 13 * i))} for i in range(5)]

    def key(out) -> tuple:  # noqa: ANN001
        c = out.outputs[0]
        return (list(c.token_ids), [sorted(p.items()) for p in c.logprobs],
                [None if p is None else sorted(p.items()) for p in out.prompt_logprobs])

    two = two_ranks.shared(None, **INT8_INVARIANT)
    assert two.llm_engine.resolved_config.batch_invariant is True
    alone = key(two.generate([needle], params, use_tqdm=False)[0])
    among = two.generate([*neighbours[:3], needle, *neighbours[3:]], params, use_tqdm=False)
    assert key(among[3]) == alone
    # the same engine with its scheduler's step budget cut to 16 tokens (what max_num_batched_tokens=16 would
    # build, without starting two more ranks): the needle's prompt is computed in chunks of at most 16 tokens
    scheduler = two.llm_engine.scheduler
    budget, scheduler.max_num_batched_tokens = scheduler.max_num_batched_tokens, 16
    try:
        chunked = two.generate([needle, *neighbours], params, use_tqdm=False)
    finally:
        scheduler.max_num_batched_tokens = budget
    assert key(chunked[0]) == alone


def test_bundled_model_two_ranks_equal_one(smollm_one: LLM, hf_smollm,  # noqa: ANN001
                                          two_ranks: TwoRankEngines) -> None:
    """SmolLM2 (uneven heads: 6 + 3) over 2 ranks: greedy tokens equal transformers'; greedy, seeded n=3 (copy-on-write forks), beam search,
    prompt logprobs, a chunked long prompt and prefix-cache hits give what one process gives."""
    seeded = SamplingParams(temperature=0.8, top_p=0.9, n=3, seed=7, max_tokens=12, logprobs=2)
    chunked = {"prompt_token_ids": _long_prompt(smollm_one)}  # > 64 tokens: prefilled over several steps
    scored = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1)
    beam = BeamSearchParams(beam_width=3, max_tokens=8)

    def run(llm: LLM) -> tuple:
        greedy = _tokens(llm.generate(PROMPTS + PROMPTS, GREEDY, use_tqdm=False))
        sampled = llm.generate(PROMPTS[:2], seeded, use_tqdm=False)
        logprobs = [[sorted(p.items()) for p in c.logprobs] for o in sampled for c in o.outputs]
        long = _tokens(llm.generate([chunked], GREEDY, use_tqdm=False))
        long += _tokens(llm.generate([chunked], GREEDY, use_tqdm=False))  # its full blocks come from the cache
        prompt_lp = llm.generate([chunked], scored, use_tqdm=False)[0].prompt_logprobs
        beams = [[list(b.tokens) for b in r.sequences] for r in llm.beam_search([PROMPTS[0]], beam)]
        return greedy, _tokens(sampled), logprobs, long, prompt_lp, beams

    one = run(smollm_one)
    two = two_ranks.shared(None, **SMALL_POOL)
    engine = two.llm_engine
    preempted, prefix_hits = engine.scheduler.num_preemptions, engine.block_manager.num_prefix_hits
    got = run(two)
    # and transformers, on the prompts tests/test_correctness.py checks one process with
    oracle_ids = [two.get_tokenizer().encode(t) for t in ORACLE_TEXTS]
    oracle = _tokens(two.generate([{"prompt_token_ids": i} for i in oracle_ids],
                                  SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False))
    assert engine.scheduler.num_preemptions == preempted, "the pool was ample for these requests"
    assert engine.block_manager.num_used_blocks == 0
    assert engine.block_manager.num_prefix_hits > prefix_hits
    rank_bytes = engine.model_runner.rank_bytes
    # the GGUF blocks stay blocks on each rank (embedding included, split by vocabulary): about half each
    whole = smollm_one.weight_bytes
    assert all(0.4 * whole < w < 0.6 * whole for w, _ in rank_bytes), (rank_bytes, whole)
    greedy, sampled, logprobs, long, prompt_lp, beams = got
    assert oracle == [hf_greedy(hf_smollm, i, 24) for i in oracle_ids]
    assert greedy == one[0] and greedy[:4] == greedy[4:]
    assert sampled == one[1]
    assert long == one[3] and long[0] == long[1]
    assert beams == one[5]
    # the numbers themselves: two ranks sum partial products in another order, so within float rounding
    for mine, theirs in zip(logprobs, one[2]):
        for a, b in zip(mine, theirs):
            assert [t for t, _ in a] == [t for t, _ in b]
            assert all(abs(x.logprob - y.logprob) < 1e-3 for (_, x), (_, y) in zip(a, b))
    assert len(prompt_lp) == len(one[4])
    for a, b in zip(prompt_lp[1:], one[4][1:]):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-3 for t in a)


def test_preemption_on_two_ranks_gives_the_tokens_of_an_ample_pool(smollm_one: LLM,
                                                                   two_ranks: TwoRankEngines) -> None:
    """A pool too small for the batch preempts and recomputes; the tokens stay those of one ample process.
    An abort mid-run frees its blocks and leaves the other request's tokens alone."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = _tokens(smollm_one.generate(PROMPTS, params, use_tqdm=False))
    # 20 blocks of 16 tokens (SMALL_POOL): 4 sequences of ~48 tokens each need 16 at the end, so they take turns
    two = two_ranks.shared(None, **SMALL_POOL)
    engine = two.llm_engine
    before = engine.scheduler.num_preemptions
    got = _tokens(two.generate(PROMPTS * 2, params, use_tqdm=False))
    preempted = engine.scheduler.num_preemptions - before
    # abort mid-run: the aborted request's blocks return, the other finishes with its own tokens
    engine.add_request("keep", PROMPTS[0], params)
    engine.add_request("drop", PROMPTS[1], params)
    for _ in range(5):
        engine.step()
    engine.abort_request("drop")
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(finished) == ["keep"]
    assert list(finished["keep"].outputs[0].token_ids) == expected[0]
    assert engine.block_manager.num_used_blocks == 0
    assert preempted > 0
    assert got == expected * 2


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP])
def test_a_dead_or_hung_worker_stops_the_engine_in_bounded_time(how: signal.Signals,
                                                               two_ranks: TwoRankEngines) -> None:
    """SIGKILL: the all-reduce fails at once; SIGSTOP (a hang): after distributed_timeout_s. Either way the
    engine raises DistributedError, every later step too, and no child process is left."""
    llm = two_ranks.own(None, distributed_timeout_s=4, cpu_bind="0|1", max_model_len=1024)
    worker = llm.llm_engine.executor.workers.processes[0]
    # cpu_bind: each rank on its own core
    assert os.sched_getaffinity(0) == {0}
    assert os.sched_getaffinity(worker.pid) == {1}
    threading.Timer(1.5, os.kill, (worker.pid, how)).start()
    start = time.monotonic()
    with pytest.raises(DistributedError):
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - start < 1.5 + 4 + 10
    with pytest.raises(DistributedError):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    worker.join(10)
    assert not worker.is_alive()
    assert multiprocessing.active_children() == []
    llm.shutdown()


def test_a_worker_that_fails_to_start_fails_the_start_at_once(tmp_path: Path) -> None:
    """A script without the ``__main__`` guard: its spawned rank dies while importing; rank 0 says so
    at once instead of waiting out the rendezvous."""
    script = tmp_path / "unguarded.py"
    script.write_text("from pagedllm import LLM\nLLM(None, tensor_parallel_size=2, num_threads=1, num_kv_blocks=64, "
                      "max_model_len=256)\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "tensor-parallel worker rank 1" in proc.stderr and "exited with code" in proc.stderr
    assert time.monotonic() - start < 120


def test_two_torchrun_nodes_on_loopback_give_the_tokens_of_one_process(smollm_one: LLM, tmp_path: Path) -> None:
    """Two torchrun "nodes" (one rank each) meeting on 127.0.0.1 stand in for two machines."""
    expected = [c.text for o in smollm_one.generate(PROMPTS[:2], GREEDY, use_tqdm=False) for c in o.outputs]
    port = free_port()
    torchrun = Path(sys.executable).with_name("torchrun")
    procs = []
    for node in (0, 1):
        cmd = [str(torchrun), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
               "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "pagedllm.entrypoints.cli",
               "generate", "--tensor-parallel-size", "2", "--num-threads", "1", "--num-kv-blocks", "64",
               "--max-model-len", "256", "--temperature", "0", "--max-tokens", str(GREEDY.max_tokens),
               "--ignore-eos", "--gguf-activations", "float32", "--kv-cache-dtype", "float32",
               *PROMPTS[:2]]
        log = open(tmp_path / f"node{node}.log", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True), log))
    for proc, log in procs:
        proc.wait(timeout=400)
        log.close()
    out0 = (tmp_path / "node0.log").read_text()
    assert [p.returncode for p, _ in procs] == [0, 0], out0 + (tmp_path / "node1.log").read_text()
    for text in expected:
        assert f"\n{text}\n" in out0, out0


def test_server_on_two_ranks_answers_then_reports_a_dead_worker(smollm_one: LLM,
                                                                two_ranks: TwoRankEngines) -> None:
    """The OpenAI server over a two-rank engine: the official client's answers equal one process's; a
    killed worker fails the request in flight with a 5xx and /health turns 503, never a hang."""
    import httpx
    import openai
    from server_helpers import serve_in_thread

    expected = [o.outputs[0].text for o in smollm_one.generate(PROMPTS[:2], GREEDY, use_tqdm=False)]
    llm = two_ranks.own(None, distributed_timeout_s=4, max_model_len=1024)
    try:
        with serve_in_thread(llm.llm_engine, model_name="tp") as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
            got = [client.completions.create(model="tp", prompt=p, max_tokens=GREEDY.max_tokens, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS[:2]]
            assert got == expected
            worker = llm.llm_engine.executor.workers.processes[0]
            threading.Timer(1.0, os.kill, (worker.pid, signal.SIGKILL)).start()
            with pytest.raises(openai.APIStatusError) as failed:
                client.completions.create(model="tp", prompt=PROMPTS[0], max_tokens=900, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert failed.value.status_code >= 500
            assert httpx.get(f"{url}/health", timeout=5).status_code == 503
    finally:
        llm.shutdown()
    assert multiprocessing.active_children() == []


def test_data_parallel_replicas_of_two_ranks_each(tiny_model_dirs: dict[str, str], tmp_path: Path) -> None:
    """`serve --data-parallel-size 2 --tensor-parallel-size 2`: two replicas of two ranks each (4 processes)
    answer as one process does, and SIGTERM leaves no process behind. On the tiny Llama: the four processes
    are the point here, the bundled model's split over ranks is the tests' above."""
    import psutil
    from openai import OpenAI
    from server_helpers import launch_server, stop_server, wait_healthy

    path = tiny_model_dirs["llama"]
    one = _tp(path, 1)
    expected = [o.outputs[0].text for o in one.generate(PROMPTS[:2], GREEDY, use_tqdm=False)]
    port = free_port()
    log = tmp_path / "server.log"
    proc = launch_server([path, "--port", str(port), "-dp", "2", "-tp", "2", "--num-kv-blocks", "64",
                          "--max-model-len", "256", "--served-model-name", "m", "--gguf-activations", "float32",
                          "--kv-cache-dtype", "float32"], log)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, log)
        ranks = psutil.Process(proc.pid).children(recursive=True)
        # 2 replicas and their 2 workers (beside the server's own helpers)
        assert sum("pagedllm-tp" in " ".join(p.cmdline()) or "spawn_main" in " ".join(p.cmdline())
                   for p in ranks if p.is_running()) >= 4, [p.cmdline() for p in ranks]
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        got = [client.completions.create(model="m", prompt=p, max_tokens=GREEDY.max_tokens, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS[:2]]
        assert got == expected
    finally:
        stop_server(proc)
    _, alive = psutil.wait_procs(ranks, timeout=30)
    assert alive == [], log.read_text()
