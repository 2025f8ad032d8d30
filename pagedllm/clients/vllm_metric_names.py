"""vLLM's metric names on ``/metrics``, for routers that read them (Gateway API Inference Extension, llm-d).

Kubernetes' Gateway API Inference Extension (its endpoint picker, "EPP") and
llm-d's scheduler place requests by scraping each model server's Prometheus
endpoint for the names vLLM exports: ``vllm:num_requests_waiting``,
``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``,
``vllm:lora_requests_info`` and optionally ``vllm:cache_config_info`` (the
"model server protocol"). Dashboards built for vLLM read the counters and
histograms below as well.

Nothing here counts anything: at each scrape :class:`VllmNameCollector` reads
the ``pagedllm:*`` families of the server's registry and yields them again
under the vLLM name, the same samples with the same labels, so the two names
can never disagree. The two info gauges are built from figures the server
already keeps (block size, blocks in the pool); pagedllm serves no LoRA
adapters, so ``vllm:lora_requests_info`` says so (``max_lora="0"``, no
adapters running or waiting) rather than being absent, which the EPP reports
as a scrape error.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping

    from prometheus_client.registry import Collector

# pagedllm family -> the vLLM families that show it (vLLM's v1 names; its deprecated
# time_per_output_token_seconds held the same inter-token observations)
VLLM_ALIASES: dict[str, tuple[str, ...]] = {
    "pagedllm:num_requests_running": ("vllm:num_requests_running",),
    "pagedllm:num_requests_waiting": ("vllm:num_requests_waiting",),
    # gpu_cache_usage_perc: vLLM's name before 0.11, still the default of older endpoint pickers
    "pagedllm:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "pagedllm:prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "pagedllm:prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "pagedllm:num_preemptions": ("vllm:num_preemptions",),
    "pagedllm:prompt_tokens": ("vllm:prompt_tokens",),
    "pagedllm:generation_tokens": ("vllm:generation_tokens",),
    "pagedllm:request_success": ("vllm:request_success",),
    "pagedllm:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "pagedllm:inter_token_latency_seconds": (
        "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
    ),
    "pagedllm:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "pagedllm:spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "pagedllm:spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "pagedllm:spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
}


def renamed(metric: Metric, name: str, documentation: str | None = None) -> Metric:
    """``metric`` under the family name ``name``: every sample's name has its prefix swapped
    (``pagedllm:x_total`` -> ``vllm:x_total``, ``..._bucket``, ``..._created``), labels and values kept."""
    out = Metric(name, documentation or metric.documentation, metric.type, metric.unit)
    suffix_start = len(metric.name)
    for s in metric.samples:
        if not s.name.startswith(metric.name):
            raise ValueError(f"sample {s.name!r} does not belong to family {metric.name!r}")
        out.samples.append(Sample(name + s.name[suffix_start:], s.labels, s.value, s.timestamp, s.exemplar))
    return out


class VllmNameCollector:
    """Yields the pagedllm families named in ``VLLM_ALIASES`` again under vLLM's names, plus vLLM's
    ``cache_config_info`` and ``lora_requests_info`` gauges.

    Args:
        families: the server's pagedllm metric objects by family name (those absent are skipped).
        model_name: the served model name.
        cache_info: returns ``(block_size, num_blocks)`` at scrape time; block size 0 while unknown.
    """

    def __init__(
        self, families: Mapping[str, Collector], model_name: str, cache_info: Callable[[], tuple[int, int]],
    ) -> None:
        self._families = families
        self._model_name = model_name
        self._cache_info = cache_info

    def collect(self) -> Iterator[Metric]:
        """The aliases (read from the pagedllm metrics now), then the two info gauges."""
        for source_name, aliases in VLLM_ALIASES.items():
            source = self._families.get(source_name)
            if source is None:
                continue
            for metric in source.collect():
                for alias in aliases:
                    yield renamed(metric, alias, f"{metric.documentation} (the same as {source_name})")
        yield from self._info_gauges()

    def _info_gauges(self) -> Iterator[Metric]:
        block_size, num_blocks = self._cache_info()
        if block_size > 0:
            # vLLM's CacheConfig labels that the EPP's prefix scorer reads; "gpu" is vLLM's word for the pool
            cache = GaugeMetricFamily(
                "vllm:cache_config_info", "KV cache configuration (the labels; the value is 1)",
                labels=["model_name", "block_size", "num_gpu_blocks"],
            )
            cache.add_metric([self._model_name, str(block_size), str(num_blocks)], 1.0)
            yield cache
        # no LoRA adapters are served: none can run or wait; the value is the time of this report, as
        # vLLM's (the EPP keeps the newest series)
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "LoRA adapters running and waiting (pagedllm serves none); the value is the report's Unix time",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        lora.add_metric(["0", "", ""], time.time())
        yield lora
