"""The decode trace (seconds on a 30-layer model) is made before a server's first request, and never counts
as a step's cost."""

from __future__ import annotations

from pagedllm.clients.async_engine import AsyncEngine
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams


def _engine(path: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, num_kv_blocks=64, max_model_len=128, block_size=8,
                                  itl_target_ms="auto"))


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
    engine = _engine(tiny_model_dirs["llama"])
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()  # the prefill
    engine.step()  # the first decode: it traces
    assert engine.model_runner.num_decode_traces == 1
    assert engine.step_costs.decode_s is None
    engine.step()  # a decode replayed: measured
    assert engine.model_runner.num_decode_traces == 1
    assert engine.step_costs.decode_s is not None and engine.step_costs.decode_s > 0
