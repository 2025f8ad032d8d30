"""vLLM's metric names beside ours (``clients/vllm_metric_names.py``), without a server: every alias shows
the pagedllm family's samples under the vLLM name, parsed back by prometheus_client's own parser.

The served check (a request moves them) is ``test_server.py::test_vllm_metric_names_follow_ours``.
"""

from __future__ import annotations

import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.clients.metrics import EngineStats, ServerMetrics
from pagedllm.clients.vllm_metric_names import VLLM_ALIASES, renamed

# what the Gateway API Inference Extension's model server protocol and vLLM's dashboards read, with vLLM's types
EXPECTED_TYPES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:lora_requests_info": "gauge", "vllm:cache_config_info": "gauge",
}


def _scrape(m: ServerMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(m.registry).decode())}


def _values(family) -> dict:  # noqa: ANN001 - a parsed family
    """Sample name with the family prefix cut off, plus its labels -> value."""
    cut = len(family.name)
    return {(s.name[cut:], tuple(sorted(s.labels.items()))): s.value for s in family.samples}


@pytest.fixture
def metrics() -> ServerMetrics:
    m = ServerMetrics("tiny")
    m.block_size = 16
    m.update_from_stats(EngineStats(num_blocks=40, used_blocks=10, running=3, waiting=2, prefix_queries=64,
                                    prefix_hits=32, preemptions=1, generated_tokens=9))
    m.prompt_tokens.inc(64)
    m.request_success("stop")
    m.request_success("length")
    m.request_success("length")
    for seconds in (0.004, 0.3, 7.0):
        m.time_to_first_token.observe(seconds)
        m.inter_token_latency.observe(seconds / 10)
        m.e2e_request_latency.observe(seconds * 3)
    return m


def test_every_vllm_name_has_vllms_type_and_our_samples(metrics: ServerMetrics) -> None:
    fams = _scrape(metrics)
    for name, typ in EXPECTED_TYPES.items():
        assert name in fams, name
        assert fams[name].type == typ, name
    for ours, aliases in VLLM_ALIASES.items():
        for alias in aliases:
            assert _values(fams[alias]) == _values(fams[ours]), alias
    # the figures themselves, from the numbers put in above (not from our families)
    assert fams["vllm:kv_cache_usage_perc"].samples[0].value == 0.25
    assert fams["vllm:num_requests_running"].samples[0].value == 3
    assert fams["vllm:num_requests_waiting"].samples[0].value == 2
    v = {s.name: s.value for s in fams["vllm:prefix_cache_hits"].samples}
    assert v["vllm:prefix_cache_hits_total"] == 32
    success = {s.labels["finished_reason"]: s.value for s in fams["vllm:request_success"].samples
               if s.name.endswith("_total")}
    assert success == {"stop": 1, "length": 2}
    ttft = {s.labels.get("le"): s.value for s in fams["vllm:time_to_first_token_seconds"].samples
            if s.name.endswith("_bucket")}
    assert (ttft["0.005"], ttft["0.5"], ttft["10.0"], ttft["+Inf"]) == (1, 2, 3, 3)
    for s in fams["vllm:num_requests_running"].samples:
        assert s.labels == {"model_name": "tiny"}


def test_aliases_follow_later_updates(metrics: ServerMetrics) -> None:
    metrics.update_from_stats(EngineStats(num_blocks=40, used_blocks=0, prefix_queries=100, prefix_hits=32,
                                          preemptions=1, generated_tokens=20))
    fams = _scrape(metrics)
    assert fams["vllm:kv_cache_usage_perc"].samples[0].value == 0
    assert fams["vllm:num_requests_running"].samples[0].value == 0
    gen = {s.name: s.value for s in fams["vllm:generation_tokens"].samples}
    assert gen["vllm:generation_tokens_total"] == 20


def test_info_gauges_name_the_pool_and_no_lora(metrics: ServerMetrics) -> None:
    before = time.time()
    fams = _scrape(metrics)
    (cache,) = fams["vllm:cache_config_info"].samples
    assert cache.labels == {"model_name": "tiny", "block_size": "16", "num_gpu_blocks": "40"}
    assert cache.value == 1
    (lora,) = fams["vllm:lora_requests_info"].samples
    # the labels the inference extension reads; no adapters: max 0, none running or waiting
    assert lora.labels == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert before - 1 <= lora.value <= time.time() + 1


def test_cache_info_waits_for_the_block_size() -> None:
    fams = _scrape(ServerMetrics("tiny"))
    assert "vllm:cache_config_info" not in fams  # block size not known yet: no made-up figure
    assert "vllm:lora_requests_info" in fams


def test_renamed_refuses_a_foreign_sample() -> None:
    family = GaugeMetricFamily("pagedllm:a", "doc", labels=["model_name"])
    family.add_metric(["m"], 1.0)
    family.samples[0] = family.samples[0]._replace(name="pagedllm:b")
    with pytest.raises(ValueError, match="does not belong"):
        renamed(family, "vllm:a")
