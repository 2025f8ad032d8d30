"""LFM2 (``Lfm2ForCausalLM``: short-conv layers beside attention) against transformers on tiny random weights.

Three of the four layers are gated short convs, whose per-sequence conv state
lives in a state slot (docs/hybrid-models.md); the third is attention with
per-head q/k norms. The norm weights are drawn at random (transformers starts
them at one) so that a norm loaded into the wrong place changes the result.
The oracle is transformers' own greedy loop with its own cache
(``conftest.hf_greedy``); logprobs within ``LOGPROB_TOL`` (float32 on both
sides, summation order only, measured ~1e-5). Then the state's bookkeeping
end to end: prompts in chunks of 16, 64 and 2048 tokens, two samples forked
from one prompt, preempted requests recomputed, and prefix hits restored from
state snapshots (the second prompt sharing a prefix hitting it at a periodic
snapshot point) all give the whole prompt's greedy tokens, and every block
and slot comes back.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import LFM2_LAYER_TYPES as LAYER_TYPES
from conftest import hf_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.engine.sequence import Sequence
from pagedllm.loader import load_model_config
from pagedllm.models.lfm2 import Lfm2ForCausalLM

LOGPROB_TOL = 1e-4
GENERATED = 12
ENGINE = dict(max_model_len=1024, num_kv_blocks=200, block_size=8, kv_cache_dtype="float32", max_num_seqs=4,
              itl_target_ms=None)


@pytest.fixture(scope="module")
def hf(lfm2_dir: str):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(lfm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(lfm2_dir: str) -> LLM:
    """One engine for the module: its chunk size is set per test on the scheduler (engines cost seconds)."""
    return LLM(lfm2_dir, **ENGINE)


@pytest.fixture(scope="module")
def oracle(hf):  # noqa: ANN001, ANN201
    """transformers' greedy tokens of a prompt, computed once per prompt."""
    memo: dict[tuple[int, ...], list[int]] = {}

    def tokens(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in memo:
            memo[tuple(prompt)] = hf_greedy(hf, prompt, GENERATED)
        return memo[tuple(prompt)]

    return tokens


def _prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in lengths]


def _greedy(llm: LLM, prompts: list[list[int]], n: int = 1) -> list[list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True, n=n)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def _pool_whole(llm: LLM) -> None:
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.state_slots.num_free == bm.state_slots.num_slots


def test_lfm2_config_and_layout(lfm2_dir: str, llm: LLM) -> None:
    """Conv layers keep no K/V: the pool has one layer row (the attention layer's); one slot per sequence."""
    cfg = load_model_config(lfm2_dir)
    assert cfg.architecture == "lfm2" and cfg.layer_types == tuple(LAYER_TYPES)
    assert cfg.intermediate_size == 128  # int(2 * 192 / 3), rounded up to a multiple of 32
    assert (cfg.conv_kernel_size, cfg.conv_bias, cfg.qk_norm, cfg.rms_norm_eps) == (3, False, True, 1e-5)
    runner = llm.llm_engine.model_runner
    assert isinstance(runner.model, Lfm2ForCausalLM)
    assert runner.kv_cache.shape[1] == 1
    assert runner.num_state_slots == runner.num_snapshot_slots == ENGINE["max_num_seqs"]
    assert [None if s is None else tuple(t.shape) for s in runner.state_caches for t in (s or (None,))] == [
        (8, 2, 64), (8, 2, 64), None, (8, 2, 64)]  # 4 running slots, then 4 for snapshots
    # decode steps are captured, the state slots one more input of the graph (docs/hybrid-models.md)
    assert runner.captured_decode is not None and runner.captured_decode.state_layers


def test_lfm2_matches_transformers(llm: LLM, hf, oracle) -> None:  # noqa: ANN001
    """Greedy tokens equal transformers'; every reported logprob (prompt and output) within LOGPROB_TOL."""
    prompts = _prompts((150, 9), 9)
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == oracle(prompt)
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        with torch.inference_mode():
            want = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)
        rows = [(i - 1, lps) for i, lps in enumerate(out.prompt_logprobs) if lps is not None]
        rows += [(len(prompt) - 1 + i, lps) for i, lps in enumerate(out.outputs[0].logprobs)]
        assert max(abs(lp.logprob - float(want[r, t])) for r, lps in rows for t, lp in lps.items()) < LOGPROB_TOL
    _pool_whole(llm)


@pytest.mark.parametrize("chunk", [16, 64, 2048])
def test_prompts_in_chunks_give_the_whole_prompts_tokens(chunk: int, llm: LLM, oracle) -> None:  # noqa: ANN001
    """Each chunk continues the conv state its slot holds: the tokens of transformers' whole-prompt run."""
    prompts = _prompts((150, 9), 9)
    scheduler = llm.llm_engine.scheduler
    budget = scheduler.max_num_batched_tokens
    scheduler.max_num_batched_tokens = chunk
    chunks: list[int] = []
    plan = scheduler.schedule

    def recording():  # noqa: ANN202
        out = plan()
        chunks.extend(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1)
        return out

    scheduler.schedule = recording
    llm.llm_engine.block_manager.reset_prefix_cache()  # computed from position 0, not hit from a snapshot
    try:
        got = _greedy(llm, prompts)
    finally:
        scheduler.max_num_batched_tokens, scheduler.schedule = budget, plan
    assert max(chunks) <= chunk and (chunk >= 150 or len(chunks) > 2)
    assert got == [[oracle(p)] for p in prompts]
    _pool_whole(llm)


def test_forked_samples_take_the_prompts_state(llm: LLM, oracle) -> None:  # noqa: ANN001
    """n=2: the second sample forks after the prompt's step and gets a copy of its state (a zero or stale
    state would decode other tokens)."""
    prompt = _prompts((9,), 9)[0]
    want = oracle(prompt)
    assert _greedy(llm, [prompt], n=2) == [[want, want]]
    _pool_whole(llm)


def test_preempted_requests_recompute_their_state(lfm2_dir: str, oracle) -> None:  # noqa: ANN001
    """A pool too small for every request: the newest are preempted, give back their slots and blocks, and
    start again from a zero state; every request still gets transformers' tokens."""
    prompts = [*_prompts((150, 9), 9), *_prompts((60,), 33)]
    tight = LLM(lfm2_dir, **{**ENGINE, "max_model_len": 176, "num_kv_blocks": 24, "max_num_batched_tokens": 24,
                             "enable_prefix_caching": False})
    got = _greedy(tight, prompts)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert got == [[oracle(p)] for p in prompts]
    _pool_whole(tight)


def test_prefix_hits_start_from_a_state_snapshot(llm: LLM, oracle) -> None:  # noqa: ANN001
    """The next turn of a prompt hits it up to its last full block, and a prefix two prompts share is hit by
    the third: each from the snapshot of the state there; the tokens are the whole prompt's."""
    base = _prompts((150,), 9)[0]
    bm = llm.llm_engine.block_manager
    bm.reset_prefix_cache()  # no snapshot of earlier tests' prompts (they share base's first tokens)
    _greedy(llm, [base])  # snapshot at 144 tokens ((150 - 1) // 8 * 8)
    turn = base + _prompts((30,), 61)[0]
    assert bm.num_cached_prefix_tokens(Sequence(turn, 8)) == 144
    shared = base[:100] + _prompts((20,), 62)[0]  # shares 12 blocks with base, no snapshot there: no hit
    assert bm.num_cached_prefix_tokens(Sequence(shared, 8)) == 0
    third = base[:100] + _prompts((25,), 63)[0]
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True)
    outs = []
    for prompt in (turn, shared, third):  # one at a time: shared's snapshot (at 96) is taken before third
        outs += llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [144, 0, 96]
    assert [list(o.outputs[0].token_ids) for o in outs] == [oracle(p) for p in (turn, shared, third)]
    _pool_whole(llm)


def test_the_second_prompt_hits_a_shared_prefix_at_a_periodic_point(lfm2_dir: str, oracle) -> None:  # noqa: ANN001
    """Snapshots every 32 tokens: a (a 90-token system prompt and 20 more) keeps points 32, 64, 96 and its last
    full block 104; b (the system prompt and 20 others) hits 64, the last inside the shared 88 tokens (11
    blocks), and c hits 88, where b's cached blocks ended. Each gives the whole prompt's greedy tokens (the
    oracle: transformers on the prompt, no cache)."""
    periodic = LLM(lfm2_dir, **{**ENGINE, "max_num_seqs": 16, "state_snapshot_interval": 32})
    bm = periodic.llm_engine.block_manager
    assert (bm.state_snapshot_interval, bm.snapshots.num_slots) == (32, 16)  # 16 slots: up to 4 periodic points
    system = _prompts((90,), 71)[0]
    prompts = [system + tail for tail in _prompts((20, 20, 25), 72)]
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True)
    outs = []
    for prompt in prompts:  # one at a time: each one's snapshots are taken before the next is looked up
        outs += periodic.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 64, 88]
    assert [list(o.outputs[0].token_ids) for o in outs] == [oracle(p) for p in prompts]
    _pool_whole(periodic)


def test_a_model_without_state_layers_refuses_a_snapshot_interval(tiny_model_dirs: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="no state layers"):
        LLM(tiny_model_dirs["llama"], max_model_len=64, num_kv_blocks=16, state_snapshot_interval=32)


def test_what_state_models_refuse(lfm2_dir: str) -> None:
    with pytest.raises(ValueError, match="contiguous"):
        LLM(lfm2_dir, **ENGINE, kv_allocator="contiguous")


def test_state_slots_come_out_of_a_given_budget(lfm2_dir: str, oracle) -> None:  # noqa: ANN001
    """A KV budget that cannot spare half of itself for max_num_seqs slots holds fewer, and max_num_seqs
    follows; the blocks take what the slots leave."""
    per_slot = 3 * 2 * 64 * 4  # three conv layers of [2, 64] float32
    per_block = 2 * 1 * 8 * 2 * 16 * 4  # K and V of the one attention layer: 8 tokens x 2 heads x 16
    budget = 13000  # half of it holds 2 slots and their 2 snapshots (6,500 // 3,072)
    small = LLM(lfm2_dir, **{**ENGINE, "max_model_len": 24, "num_kv_blocks": None, "kv_cache_memory_bytes": budget})
    runner = small.llm_engine.model_runner
    assert runner.state_bytes_per_slot == per_slot
    assert runner.num_state_slots == 2 and small.llm_engine.config.max_num_seqs == 2
    assert runner.num_kv_blocks == (budget - 4 * per_slot) // per_block == 3
    prompts = _prompts((3, 4, 3), 9)
    assert _greedy(small, prompts) == [[oracle(p)] for p in prompts]
    _pool_whole(small)


def test_bench_memory_reports_the_state_slots(lfm2_dir: str, capsys: pytest.CaptureFixture) -> None:
    """``bench memory`` on a hybrid model: the paged pool only (the contiguous one has no state slots), with its
    state slots, their peak use, the snapshot slots and their bytes."""
    from pagedllm.bench.memory import (
        MemoryWorkload,
        _allocators,
        print_groups_and_state,
        run_allocator,
    )

    assert _allocators(lfm2_dir) == ("paged",)
    workload = MemoryWorkload(num_requests=3, min_prompt=8, max_prompt=16, median_output=4, max_model_len=64,
                              num_kv_slots=256)
    summary, _ = run_allocator(lfm2_dir, workload, "paged", "max", None)
    assert summary["state_slots"] == 64 and 1 <= summary["state_peak_used_slots"] <= 3  # max_num_seqs=64
    assert summary["state_snapshot_slots"] == 0  # the benchmark runs without prefix caching
    assert summary["state_bytes_per_slot"] == 3 * 2 * 64 * 4
    assert summary["state_reserved_bytes"] == 64 * 3 * 2 * 64 * 4
    assert (summary["state_slot_bytes"], summary["state_snapshot_bytes"], summary["state_checkpoint_bytes"]) == (
        64 * 3 * 2 * 64 * 4, 0, 0)
    assert (summary["state_checkpoint_slots"], summary["state_peak_snapshots"]) == (0, 0)
    # one KV cache group: the attention layer (layer 2), full
    [group] = summary["kv_groups"]
    assert (group["kind"], group["window"], group["layers"]) == ("full", None, [2])
    assert group["peak_blocks"] == summary["peak_blocks_per_group"][0] >= 1
    assert group["peak_bytes"] == group["peak_blocks"] * summary["kv_bytes_per_block"]
    print_groups_and_state(summary)
    out = capsys.readouterr().out
    assert "state slots (0.001 MiB each)" in out
    running = next(line for line in out.splitlines() if line.strip().startswith("running"))
    assert running.split()[1:3] == ["64", str(summary["state_peak_used_slots"])]


@pytest.mark.slow  # converts the checkpoint in subprocesses (seconds each)
# F16 only: the converter writes this family's own tensors (vectors, norms, the conv filters) in F32 in either outtype, so
# its F16 file holds both types; an all-F32 file's matrices are read as any family's (tests/models/
# test_gguf_converted.py's Llama F32 file)
@pytest.mark.parametrize("outtype", ["f16"])
def test_lfm2_gguf_from_llama_cpps_converter_matches_transformers(
    outtype: str, lfm2_dir: str, tmp_path_factory: pytest.TempPathFactory, gguf_converter  # noqa: ANN001
) -> None:
    """llama.cpp's converter writes LFM2 as 'lfm2' (head_count_kv 0 for conv layers, shortconv.* tensors,
    token_embd_norm as the final norm): transformers' tokens and logprobs (its weights rounded as the file
    stores its matrices) on float32 activations."""
    from transformers import AutoModelForCausalLM

    path = gguf_converter.convert(lfm2_dir, outtype, str(tmp_path_factory.mktemp("lfm2-gguf") / f"lfm2-{outtype}.gguf"))
    cfg = load_model_config(path)
    assert (cfg.architecture, cfg.checkpoint_format, cfg.layer_types) == ("lfm2", "gguf", tuple(LAYER_TYPES))
    assert (cfg.conv_kernel_size, cfg.qk_norm, cfg.num_key_value_heads, cfg.intermediate_size) == (3, True, 2, 128)
    hf = AutoModelForCausalLM.from_pretrained(lfm2_dir, dtype=torch.float32).eval()
    if outtype == "f16":  # the converter writes matrices in the outtype, vectors (and the conv filters) in F32
        with torch.no_grad():
            for p in hf.parameters():
                if p.dim() == 2:
                    p.copy_(p.half().float())
    llm = LLM(path, **ENGINE, gguf_activations="float32")
    assert isinstance(llm.llm_engine.model_runner.model, Lfm2ForCausalLM)
    prompt = _prompts((40,), 5)[0]
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True, logprobs=5)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, GENERATED)
    ids = prompt + list(out.outputs[0].token_ids)
    with torch.inference_mode():
        want = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)
    rows = [(len(prompt) - 1 + i, lps) for i, lps in enumerate(out.outputs[0].logprobs)]
    assert max(abs(lp.logprob - float(want[r, t])) for r, lps in rows for t, lp in lps.items()) < LOGPROB_TOL


def test_beam_forks_copy_the_running_state(llm: LLM, hf) -> None:  # noqa: ANN001
    """Beam search forks running beams (their state copied before the next step): every beam's summed logprob
    is transformers' teacher-forced one over its tokens, which a stale or zero state would not give."""
    from pagedllm.engine.beam_search import BeamSearchParams

    prompt = _prompts((20,), 77)[0]
    (out,) = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=6,
                                                                            ignore_eos=True))
    assert len(out.sequences) == 3
    for beam in out.sequences:
        tokens = beam.output_token_ids
        with torch.inference_mode():
            lp = hf(torch.tensor([prompt + tokens])).logits[0].double().log_softmax(-1)
        want = sum(float(lp[len(prompt) + j - 1, t]) for j, t in enumerate(tokens))
        assert beam.cum_logprob == pytest.approx(want, abs=1e-3)
    _pool_whole(llm)
