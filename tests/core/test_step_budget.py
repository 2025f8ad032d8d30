"""The prompt tokens a step may add to running decodes: the cost model, the scheduler's cap, a real engine.

The scheduler tests use tiny blocks and exact block ids as ``test_scheduler.py``
does; the engine test runs the bundled model and checks the shape of the plan
(how a long prompt is cut while streams decode), with a generous bound on the
measured gaps: exact figures belong in BENCHMARKS.md.
"""

from __future__ import annotations

import random
import statistics
import time

import pytest

from pagedllm.config import EngineConfig
from pagedllm.engine.block_manager import BlockManager
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence
from pagedllm.engine.step_budget import (
    AUTO_ITL_FACTOR,
    INITIAL_PREFILL_TOKENS,
    MIN_PREFILL_TOKENS,
    StepCostModel,
)

BS = 4


# --- the cost model ---------------------------------------------------------------
def test_no_decode_means_no_cap() -> None:
    assert StepCostModel().max_prefill_tokens(0) is None
    assert StepCostModel(itl_target_ms=5.0).max_prefill_tokens(0) is None


def test_before_any_measure_a_mixed_step_takes_the_initial_share() -> None:
    model = StepCostModel()
    assert model.max_prefill_tokens(3) == INITIAL_PREFILL_TOKENS
    model.times.observe(3, 0, 0, 0.020)  # a decode step, but no prompt-token cost yet
    assert model.max_prefill_tokens(3) == INITIAL_PREFILL_TOKENS


def test_auto_target_is_a_multiple_of_the_decode_step() -> None:
    model = StepCostModel()
    model.times.observe(4, 0, 0, 0.020)  # decodes alone: 20 ms
    model.times.observe(4, 0, 100, 0.020 + 100 * 0.001)  # each prompt token adds 1 ms
    # two steps, five coefficients: the ridge's prior moves the fit by ~1e-4 of a step
    assert model.decode_s(4) == pytest.approx(0.020, rel=1e-3)
    assert model.token_s == pytest.approx(0.001, rel=1e-3)
    # target 4 x 20 = 80 ms, of which 60 ms for prompt tokens at 1 ms each
    assert model.target_s(4) == pytest.approx(AUTO_ITL_FACTOR * 0.020, rel=1e-3)
    assert abs(model.max_prefill_tokens(4) - int((AUTO_ITL_FACTOR - 1) * 20)) <= 1


def test_a_fixed_target_and_the_floor() -> None:
    model = StepCostModel(itl_target_ms=90.0)
    model.times.observe(2, 0, 0, 0.010)
    model.times.observe(2, 0, 40, 0.010 + 40 * 0.002)
    assert abs(model.max_prefill_tokens(2) - 40) <= 1  # (90 - 10) ms / 2 ms
    slow = StepCostModel(itl_target_ms=5.0)
    slow.times.observe(2, 0, 0, 0.030)  # the decodes alone already miss the target
    slow.times.observe(2, 0, 10, 0.040)
    assert slow.max_prefill_tokens(2) == MIN_PREFILL_TOKENS  # a prompt still progresses


def test_the_fit_follows_a_growing_cost() -> None:
    """Chunk by chunk a prompt's attention grows; the estimate follows, so the cap shrinks."""
    model = StepCostModel()
    model.times.observe(1, 0, 0, 0.040)
    caps = []
    for cost_ms in (1, 2, 3, 4, 5, 6, 7, 8):
        model.times.observe(1, 0, 30, 0.040 + 30 * cost_ms / 1000)
        caps.append(model.max_prefill_tokens(1))
    assert caps == sorted(caps, reverse=True) and caps[-1] < caps[0]


def test_the_cap_reads_the_decodes_it_runs_beside() -> None:
    """One fit of a + b*B + p*P: the decodes' step and so the auto target grow with B, and the drafting
    cost reads the same fit (a machine measured once answers both)."""
    model = StepCostModel()
    a, b, p = 0.010, 0.002, 0.0005
    for num_decodes, num_prompt in [(1, 0), (8, 0), (4, 0), (2, 64), (6, 32), (3, 0), (5, 128), (7, 0)] * 4:
        model.times.observe(num_decodes, 0, num_prompt, a + b * num_decodes + p * num_prompt)
    assert model.decode_s(1) == pytest.approx(a + b, rel=1e-3)
    assert model.decode_s(8) == pytest.approx(a + 8 * b, rel=1e-3)
    assert model.token_s == pytest.approx(p, rel=1e-3)
    # (4 - 1) x (a + b B) / p prompt tokens
    for num_decodes in (1, 8):
        want = (AUTO_ITL_FACTOR - 1) * (a + b * num_decodes) / p
        assert abs(model.max_prefill_tokens(num_decodes) - want) <= 1
    assert model.times.predict(3, 0, 100) == pytest.approx(a + 3 * b + 100 * p, rel=1e-3)


@pytest.mark.parametrize("bad", [0, -1.0, True, "fast", float("nan")])
def test_bad_targets_are_value_errors(bad: object) -> None:
    with pytest.raises(ValueError, match="itl_target_ms"):
        StepCostModel(itl_target_ms=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -5, True, "soon", float("nan")])
def test_engine_config_refuses_bad_targets(bad: object, smollm_path: str) -> None:
    with pytest.raises(ValueError, match="itl_target_ms"):
        EngineConfig(model=smollm_path, itl_target_ms=bad)  # type: ignore[arg-type]


def test_cli_reads_auto_off_and_milliseconds() -> None:
    import argparse

    from pagedllm.entrypoints.cli import _itl_target

    assert _itl_target("auto") == "auto"
    assert _itl_target("off") is None
    assert _itl_target("120") == 120.0
    for bad in ("0", "-3", "never"):
        with pytest.raises(argparse.ArgumentTypeError):
            _itl_target(bad)


# --- the scheduler's cap ----------------------------------------------------------------
def mk(tokens: range) -> Sequence:
    return Sequence(list(tokens), block_size=BS)


def run(sched: Scheduler, num_steps: int) -> list[list[tuple[Sequence, int, int]]]:
    """Plan and simulate ``num_steps`` steps: every sampling sequence gets one token."""
    plans = []
    for _ in range(num_steps):
        out = sched.schedule()
        sched.update(out)
        for s in out.scheduled:
            if s.samples:
                s.seq.append_token(1000 + len(s.seq))
        plans.append([(s.seq, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled])
    return plans


def test_the_cap_cuts_a_long_prompt_only_while_others_decode() -> None:
    caps: list[int] = []

    def cap(num_decodes: int) -> int | None:
        caps.append(num_decodes)
        return 3 if num_decodes else None

    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, prefill_cap=cap)
    a = mk(range(2))
    sched.add(a)
    assert run(sched, 1) == [[(a, 0, 2)]]  # nobody decodes: the whole prompt at once
    long = mk(range(100, 111))  # 11 tokens; 64 would fit, the cap allows 3 beside a's decode
    sched.add(long)
    assert run(sched, 4) == [
        [(long, 0, 3), (a, 2, 1)],
        [(long, 3, 3), (a, 3, 1)],
        [(long, 6, 3), (a, 4, 1)],
        [(long, 9, 2), (a, 5, 1)],
    ]
    # decodes take their slots first: a's fifth token (step 4) takes block 3 before long's ninth
    assert long.block_table == [1, 2, 4] and a.block_table == [0, 3]
    assert caps == [0, 1, 1, 1, 1]


def test_the_cap_holds_chunks_and_admissions_together() -> None:
    bm = BlockManager(num_blocks=32, block_size=BS, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, prefill_cap=lambda n: 5 if n else None)
    a = mk(range(1))
    sched.add(a)
    run(sched, 1)
    b, c = mk(range(10, 17)), mk(range(20, 23))  # 7 and 3 tokens
    sched.add(b)
    sched.add(c)
    assert run(sched, 3) == [
        [(b, 0, 5), (a, 1, 1)],             # b's first chunk takes the whole share; c waits
        [(b, 5, 2), (c, 0, 3), (a, 2, 1)],  # b's rest and c fit the 5 together
        [(a, 3, 1), (b, 7, 1), (c, 3, 1)],
    ]


def test_a_request_arriving_behind_a_prompt_in_chunks_gets_half_the_share() -> None:
    """Under the cap a prompt in chunks would take every step's share until done; a waiting request keeps half."""
    bm = BlockManager(num_blocks=32, block_size=BS, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, prefill_cap=lambda n: 6 if n else None)
    a = mk(range(1))
    sched.add(a)
    run(sched, 1)
    long = mk(range(100, 120))  # 20 tokens
    sched.add(long)
    assert run(sched, 1) == [[(long, 0, 6), (a, 1, 1)]]
    chat = mk(range(200, 205))  # 5 tokens arrive while long is in chunks
    sched.add(chat)
    assert run(sched, 3) == [
        [(long, 6, 3), (chat, 0, 3), (a, 2, 1)],  # half of 6 kept for the chat
        [(long, 9, 4), (chat, 3, 2), (a, 3, 1)],  # the chat in chunks still wants 2: long leaves them
        [(long, 13, 6), (a, 4, 1), (chat, 5, 1)],  # nothing waits: the whole share
    ]
    # decodes first each step: a takes block 7 for its fifth token before long needs block 8
    assert long.block_table == [1, 2, 3, 5, 8] and chat.block_table == [4, 6] and a.block_table == [0, 7]
    assert bm.num_free_blocks == 32 - len(a.block_table) - 5 - 2


def test_without_a_cap_the_budget_is_max_num_batched_tokens() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a = mk(range(2))
    sched.add(a)
    run(sched, 1)
    long = mk(range(100, 111))
    sched.add(long)
    assert run(sched, 1) == [[(long, 0, 11), (a, 2, 1)]]


# --- a real engine --------------------------------------------------------------------
def _long_prompt_among_streams(engine, seed: int) -> tuple[list, float]:  # noqa: ANN001
    """Three streams decode, then a 768-token prompt arrives: (per step: decodes, prompt tokens, seconds),
    and the seconds to its first token. ``seed`` picks the prompts (a run after another must not hit the
    prefix cache)."""
    from pagedllm.sampling_params import SamplingParams

    rng = random.Random(seed)
    greedy = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"s{i}", {"prompt_token_ids": [rng.randrange(1000, 20000) for _ in range(8)]}, greedy)
    for _ in range(8):  # the streams run, and the decode cost is measured
        engine.step()
    prompt = [rng.randrange(1000, 20000) for _ in range(768)]
    engine.add_request("long", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1))
    steps, start = [], time.perf_counter()
    while "long" in engine.requests:
        before = {rid: r.seqs[0].num_computed_tokens for rid, r in engine.requests.items()}
        t0 = time.perf_counter()
        engine.step()
        now = engine.requests
        long_tokens = (now["long"].seqs[0].num_computed_tokens if "long" in now else len(prompt)) - before["long"]
        steps.append((sum(1 for r in ("s0", "s1", "s2") if r in now), long_tokens, time.perf_counter() - t0))
    ttft = time.perf_counter() - start
    for rid in ("s0", "s1", "s2"):
        engine.abort_request(rid)
    assert engine.block_manager.num_used_blocks == 0
    return steps, ttft


@pytest.mark.slow
def test_a_long_prompt_no_longer_freezes_the_streams(smollm_path: str) -> None:
    from pagedllm.engine.llm_engine import LLMEngine

    # one engine for both runs (loading and tracing the model once): first as configured, with the auto
    # target, on a fresh cost model as before; then with the scheduler's cap taken away, which is what
    # itl_target_ms=None builds (no StepCostModel, no prefill_cap: LLMEngine.__init__)
    engine = LLMEngine(EngineConfig(
        model=smollm_path, num_kv_blocks=160, max_model_len=2048, max_num_batched_tokens=1024,
        itl_target_ms="auto", num_threads=2,
        capture_min_decode_steps=0,  # replayed decode steps from the first, as a server's: steadier step times
    ))
    assert engine.scheduler.prefill_cap is not None
    on, _ = _long_prompt_among_streams(engine, seed=0)
    engine.scheduler.prefill_cap = None
    off, _ = _long_prompt_among_streams(engine, seed=1)
    # without a target the whole prompt is one step beside the decodes: the freeze the issue measured
    assert max(tokens for _, tokens, _ in off) == 768
    chunks = [tokens for _, tokens, _ in on if tokens]
    assert len(chunks) >= 4 and max(chunks) < 400, chunks
    assert sum(chunks) == 768
    # generous: on a quiet 2-core machine the longest step is ~1.2x the median (BENCHMARKS.md); the second
    # longest is asserted, so that one step the shared host stalls (seen under load) does not decide it
    gaps = [seconds for decodes, _, seconds in on if decodes]
    assert sorted(gaps)[-2] < 6 * statistics.median(gaps) + 0.05, gaps


# --- the serving benchmark's long prompts -----------------------------------------------
def test_bench_serve_mixes_in_long_prompts() -> None:
    from pagedllm.bench.serve import make_requests, parse_mix

    plain_only = make_requests(40, 16, 8, 0.0, 3, parse_mix("plain"))
    mixed = make_requests(40, 16, 8, 0.0, 3, parse_mix("plain:3,long:1"), long_lens=(300, 2))
    longs = [r for r in mixed if r.kind == "long"]
    assert 0 < len(longs) < 40
    assert all(len(r.prompt_token_ids) == 300 and r.output_len == 2 for r in longs)
    assert all(len(r.prompt_token_ids) == 16 and r.output_len == 8 for r in mixed if r.kind == "plain")
    with pytest.raises(ValueError, match="long-input-len"):
        make_requests(4, 16, 8, 0.0, 3, parse_mix("long"), long_lens=(0, 1))
    assert len(plain_only) == 40


# --- through the server -----------------------------------------------------------------
@pytest.mark.slow
def test_streams_keep_their_pace_while_a_4k_prompt_prefills(smollm_path: str, tmp_path) -> None:  # noqa: ANN001
    """The issue's case on ``pagedllm serve``: chats stream (the official client) while a 4,000-token prompt
    with ``max_tokens=1`` arrives; the streams' gaps over the prompt's prefill stay within a generous
    bound of their median, and the prompt is answered."""
    import threading

    import httpx
    import openai
    from server_helpers import free_port, launch_server, stop_server, wait_healthy

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = launch_server(["--port", str(port), "--num-kv-blocks", "320", "--max-model-len", "4096",
                          "--max-num-batched-tokens", "2048"], tmp_path / "server.log")
    try:
        wait_healthy(url, proc, tmp_path / "server.log")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        stamps: dict[int, list[float]] = {i: [] for i in range(3)}
        long_done = threading.Event()
        window: list[float] = []

        def stream(i: int) -> None:
            chunks = client.chat.completions.create(
                model=client.models.list().data[0].id, messages=[{"role": "user", "content": f"Count to {99 + i}."}],
                max_tokens=1000, temperature=0, stream=True, extra_body={"ignore_eos": True},
            )
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    stamps[i].append(time.monotonic())
                if long_done.is_set() and time.monotonic() > window[1] + 1.0:
                    break
            chunks.close()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        time.sleep(3.0)  # the streams are decoding
        prompt = [random.Random(1).randrange(1000, 20000) for _ in range(4000)]
        window.append(time.monotonic())
        resp = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=300)
        window.append(time.monotonic())
        long_done.set()
        for t in threads:
            t.join(120)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["prompt_tokens"] == 4000
        for i, times in stamps.items():
            gaps = [b - a for a, b in zip(times, times[1:]) if window[0] <= b <= window[1]]
            assert len(gaps) >= 5, f"stream {i} made {len(gaps)} tokens while the prompt prefilled"
            gaps.sort()
            p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]
            # the goal (BENCHMARKS.md) is 3x; generous here, for a loaded CI machine. Without the target one
            # gap is the whole prefill (~8 s on 2 cores) among ~0.05 s ones
            assert p99 < 8 * statistics.median(gaps) + 0.25, (i, statistics.median(gaps), gaps[-5:])
    finally:
        stop_server(proc)
