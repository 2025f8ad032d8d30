"""Expert load: the runner's per-expert routing counts, what ``/metrics`` and ``pagedllm bench`` show of them.

One tiny random Qwen3-MoE (``test_family_qwen3_moe``'s folder: layer 0 sparse, 8 experts, top 4; layer 1
dense) behind one engine: after a greedy request, the counts layer 0 kept equal the top-4 choices of
transformers' own router over the same tokens (the prompt and every generated token but the last, each
computed once), and a server on that engine exports them (per expert, per layer's imbalance).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import httpx
import pytest
import torch
from server_helpers import free_port, metrics, wait_healthy
from test_family_qwen3_moe import ENGINE, NUM_EXPERTS, TOP_K, qwen3_moe_dir  # noqa: F401 (a fixture)

from pagedllm import LLM, SamplingParams
from pagedllm.bench.throughput import expert_load_line
from pagedllm.expert_counts import ExpertCounts, load_summary

NUM_GENERATED = 5


@pytest.fixture(scope="module")
def moe_llm(qwen3_moe_dir: str) -> LLM:  # noqa: F811
    return LLM(qwen3_moe_dir, **ENGINE, num_threads=1)


def _hf_counts(path: str, ids: list[int]) -> list[int]:
    """Layer 0's tokens per expert from transformers' router logits: softmax, top 4, counted."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([ids]), output_router_logits=True).router_logits[0]  # [tokens, 8]
    chosen = torch.topk(torch.softmax(logits.float(), dim=-1), TOP_K, dim=-1).indices
    return torch.bincount(chosen.reshape(-1), minlength=NUM_EXPERTS).tolist()


def test_counts_equal_the_routers_top_k_choices(moe_llm: LLM, qwen3_moe_dir: str) -> None:  # noqa: F811
    load = moe_llm.llm_engine.model_runner.expert_load
    assert load is not None and load.layers == [0]  # layer 1 is dense
    load.reset()
    prompt = [random.Random(5).randrange(100, 49000) for _ in range(29)]
    params = SamplingParams(temperature=0, max_tokens=NUM_GENERATED, ignore_eos=True)
    out = moe_llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    counts = load.counts()
    computed = prompt + list(out.outputs[0].token_ids)[:-1]  # the last token is sampled, never run
    assert counts.layers == (0,) and counts.num_steps == NUM_GENERATED  # one prefill, then a decode per token
    assert sum(counts.tokens[0]) == len(computed) * TOP_K
    assert list(counts.tokens[0]) == _hf_counts(qwen3_moe_dir, computed)


def test_summary_and_bench_line_arithmetic() -> None:
    counts = ExpertCounts((0, 2), ((6, 2, 0, 0), (2, 2, 2, 2)), num_steps=2)
    assert counts.by_expert() == [8, 4, 2, 2]
    assert counts.layer_imbalance() == [3.0, 1.0]
    summary = load_summary(counts)  # 16 tokens over 8 cells and 2 steps: mean 1, the busiest 6 / 2 = 3
    assert summary == {"mean": 1.0, "max": 3.0, "imbalance": 3.0, "num_steps": 2}
    assert "mean 1.00, max 3.00, imbalance (max/mean) 3.00" in expert_load_line(summary)
    assert load_summary(ExpertCounts((0,), ((0, 0),), 0))["imbalance"] == 0.0


@pytest.fixture(scope="module")
def moe_server(moe_llm: LLM) -> Iterator[str]:
    """A server on the module's engine (uvicorn on a thread, as tests/server/test_kv_page.py starts one)."""
    import uvicorn

    from pagedllm.entrypoints.openai.api_server import ServerSettings, create_server_app

    port = free_port()
    app = create_server_app(moe_llm.llm_engine, ServerSettings(model_name="tiny-moe", port=port))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    yield url
    server.should_exit = True
    thread.join(30)


def test_metrics_export_the_counts(moe_llm: LLM, moe_server: str) -> None:
    body = {"model": "tiny-moe", "prompt": [101, 202, 303, 404, 505], "max_tokens": 3, "temperature": 0}
    assert httpx.post(f"{moe_server}/v1/completions", json=body, timeout=60).status_code == 200
    counts = moe_llm.llm_engine.model_runner.expert_load.counts()  # the engine is idle: nothing moves now
    assert counts.num_steps > 0
    got = metrics(moe_server)
    for expert, n in enumerate(counts.by_expert()):
        assert got[f'pagedllm:moe_expert_tokens_total{{"expert": "{expert}"}}'] == n
    assert got["pagedllm:moe_steps_total"] == counts.num_steps
    assert got['pagedllm:moe_layer_load_imbalance{"layer": "0"}'] == pytest.approx(counts.layer_imbalance()[0])
    assert not any('"layer": "1"' in key for key in got)  # the dense layer has no series


def test_bench_throughput_prints_the_expert_load(qwen3_moe_dir: str, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    """``pagedllm bench throughput`` on the MoE folder: its line and JSON ``expert_load``, counted over the measured
    run only (every prompt and output token but each request's last, each through top 4 of 8 experts)."""
    import json

    from pagedllm.bench.workload import make_workload
    from pagedllm.entrypoints import cli

    num_threads = torch.get_num_threads()
    try:
        assert cli.main(["bench", "throughput", "--model", qwen3_moe_dir, "--num-requests", "3", "--min-len", "8",
                         "--max-len", "16", "--workload-seed", "7", "--json", "--no-enable-prefix-caching",
                         "--num-kv-blocks", "64", "--max-model-len", "256", "--num-threads", "1"]) == 0
    finally:
        torch.set_num_threads(num_threads)
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])["expert_load"]
    assert any(line.startswith(f"expert load over {summary['num_steps']} steps") for line in lines)
    workload = make_workload(3, 8, 16, 7)
    computed = sum(len(r.prompt_token_ids) + r.output_len - 1 for r in workload)
    assert summary["mean"] * NUM_EXPERTS * summary["num_steps"] == pytest.approx(computed * TOP_K, abs=0.01 * NUM_EXPERTS * summary["num_steps"])
    assert summary["imbalance"] == pytest.approx(summary["max"] / summary["mean"], rel=1e-2) and summary["imbalance"] >= 1
