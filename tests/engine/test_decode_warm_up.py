"""The decode trace (seconds on a 30-layer model) is made before a server's first request, offline only once
the requests may decode long enough to pay for it, and never counts as a step's cost."""

from __future__ import annotations

import pytest

from pagedllm.clients.async_engine import AsyncEngine
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams


def _engine(path: str, **kwargs: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, num_kv_blocks=64, max_model_len=128, block_size=8,
                                  itl_target_ms="auto", **kwargs))


def _run(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def test_a_server_engine_is_traced_before_its_first_request(tiny_model_dirs: dict[str, str]) -> None:
    engine = _engine(tiny_model_dirs["llama"])
    assert engine.model_runner.num_decode_traces == 0
    client = AsyncEngine(engine)
    client.start()
    try:
        assert engine.model_runner.num_decode_traces == 1
        assert engine.model_runner.captured_decode.graphs
    finally:
        client.stop()


def test_a_step_that_traced_is_not_a_decode_cost(tiny_model_dirs: dict[str, str]) -> None:
    engine = _engine(tiny_model_dirs["llama"], capture_min_decode_steps=0)
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()  # the prefill
    engine.step()  # the first decode: it traces
    assert engine.model_runner.num_decode_traces == 1
    assert engine.step_costs.decode_s(1) is None
    engine.step()  # a decode replayed: measured
    assert engine.model_runner.num_decode_traces == 1
    assert (engine.step_costs.decode_s(1) or 0.0) > 0


def test_offline_decodes_are_traced_only_when_enough_steps_are_ahead(tiny_model_dirs: dict[str, str]) -> None:
    engine = _engine(tiny_model_dirs["llama"], capture_min_decode_steps=40)
    assert engine.model_runner.capture_waits
    short = SamplingParams(temperature=0, max_tokens=39, ignore_eos=True)
    engine.add_request("short", {"prompt_token_ids": [5, 6, 7]}, short)
    _run(engine)  # 39 tokens at most: the trace would not pay, every decode step ran the modules
    assert engine.model_runner.num_decode_traces == 0 and engine.model_runner.capture_waits
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("long", {"prompt_token_ids": [5, 6, 7]}, long)
    engine.add_request("short2", {"prompt_token_ids": [8, 9]}, short)
    _run(engine)  # one request may decode 40 steps: traced once, at its first step
    assert engine.model_runner.num_decode_traces == 1 and not engine.model_runner.capture_waits
    assert engine.model_runner.captured_decode.graphs


def test_no_max_tokens_counts_up_to_max_model_len(tiny_model_dirs: dict[str, str]) -> None:
    engine = _engine(tiny_model_dirs["llama"], capture_min_decode_steps=120)
    # 125 tokens of room past a 3-token prompt in max_model_len=128: enough
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=None))
    engine.step()  # the prefill: the engine traces before it runs, as a server does at start
    assert engine.model_runner.num_decode_traces == 1 and not engine.model_runner.capture_waits


def test_tokens_are_the_same_traced_late_or_never(tiny_model_dirs: dict[str, str]) -> None:
    outputs = []
    for steps in (0, 10, 10_000):  # traced at the first decode, at the second request, never
        engine = _engine(tiny_model_dirs["llama"], capture_min_decode_steps=steps)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=9,
                                                                                   ignore_eos=True))
        _run(engine)
        engine.add_request("b", {"prompt_token_ids": [11, 12, 13, 14]}, params)
        got = []
        while engine.has_unfinished_requests():
            got += [o for o in engine.step() if o.finished]
        outputs.append(got[0].outputs[0].token_ids)
        assert engine.model_runner.num_decode_traces == (0 if steps == 10_000 else 1)
    assert outputs[0] == outputs[1] == outputs[2]


def test_a_negative_step_count_is_refused() -> None:
    with pytest.raises(ValueError, match="capture_min_decode_steps must be an integer >= 0"):
        EngineConfig(model="unused", capture_min_decode_steps=-1)
