"""Prometheus metrics of the OpenAI-compatible server, recorded by its engine client (``AsyncEngine`` or the data-parallel one).

Every metric lives in the server's own ``CollectorRegistry`` (one per app),
never in prometheus-client's global default registry, so two servers in one
process (tests) do not collide. Names follow vLLM's with a ``pagedllm:``
prefix; the ones routers and vLLM dashboards read are shown again under
vLLM's own ``vllm:`` names (``vllm_metric_names.py``). All updates come from the engine thread, except the prompt-token
counter, which is bumped when a request is accepted; prometheus-client
metrics are thread-safe.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagedllm.clients.vllm_metric_names import VllmNameCollector

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.expert_counts import ExpertCounts
    from pagedllm.kv_disk.store import DiskBlockStore
    from pagedllm.structured_output.compiler import GrammarCompiler

# vLLM's buckets, in seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """The server's metrics and the engine counters they mirror.

    Args:
        model_name: the served model name, set as the ``model_name`` label.
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry
        # each family by name, for the vLLM names that show them again (vllm_metric_names.py)
        self._families: dict[str, Gauge | Counter | Histogram] = {}

        def gauge(name: str, doc: str) -> Gauge:
            self._families[name] = Gauge(name, doc, labels, registry=r)
            return self._families[name].labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            self._families[name] = Counter(name, doc, labels, registry=r)
            return self._families[name].labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            self._families[name] = Histogram(name, doc, labels, buckets=buckets, registry=r)
            return self._families[name].labels(model_name)

        self.kv_cache_usage = gauge(
            "pagedllm:kv_cache_usage_perc",
            "KV cache usage, 0 to 1: blocks held by requests over all blocks",
        )
        self.num_kv_blocks = gauge("pagedllm:num_kv_blocks", "KV cache blocks in the pool")
        # engine info: set once the engine's config is known (update_from_engine, or the data-parallel server)
        self.batch_invariant = gauge(
            "pagedllm:batch_invariant", "1 when every request's bits are independent of its batch (--batch-invariant)"
        )
        self.kv_reserved_bytes = gauge(
            "pagedllm:kv_cache_reserved_bytes", "Bytes of address space the KV pool reserves (this process's share)"
        )
        self.kv_resident_bytes = gauge(
            "pagedllm:kv_cache_resident_bytes",
            "Bytes of the KV pool in memory: blocks written and not yet given back to the OS",
        )
        self.num_requests_running = gauge("pagedllm:num_requests_running", "Requests with a sequence running")
        self.num_requests_waiting = gauge("pagedllm:num_requests_waiting", "Requests waiting to be scheduled")
        self.prefix_cache_queries = counter(
            "pagedllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_cache_hits = counter("pagedllm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.num_preemptions = counter("pagedllm:num_preemptions", "Sequences preempted (recomputed later)")
        self.prompt_tokens = counter("pagedllm:prompt_tokens", "Prompt tokens of accepted requests")
        self.prompt_tokens_computed = counter(
            "pagedllm:prompt_tokens_computed",
            "Prompt tokens computed by prefills (prefix-cache hits excluded, recomputation included)",
        )
        self.generation_tokens = counter("pagedllm:generation_tokens", "Generated tokens")
        # the prefix cache on disk (--kv-cache-dir); zero when it is off
        self.kv_disk = {
            "kv_disk_hits": counter("pagedllm:kv_disk_hits", "KV blocks read back from the prefix cache on disk"),
            "kv_disk_misses": counter(
                "pagedllm:kv_disk_misses", "Prompts whose next block past RAM's was absent or bad on disk"
            ),
            "kv_disk_corrupt": counter(
                "pagedllm:kv_disk_corrupt", "Block files on disk ignored as torn, corrupt or not the block asked for"
            ),
            "kv_disk_bytes_read": counter("pagedllm:kv_disk_bytes_read", "Bytes of block files read back"),
            "kv_disk_bytes_written": counter("pagedllm:kv_disk_bytes_written", "Bytes of block files written"),
            "kv_disk_evictions": counter(
                "pagedllm:kv_disk_evictions", "Block files removed to keep --kv-cache-dir-max-bytes"
            ),
        }
        self.stream_write_timeouts = counter(
            "pagedllm:stream_write_timeouts",
            "Streams ended, and their requests aborted, because a write waited --stream-write-timeout seconds "
            "for a client that read nothing",
        )
        # speculative decoding (vLLM's names); zero when it is off
        self.spec_decode_num_drafts = counter("pagedllm:spec_decode_num_drafts", "Verify steps run (one per drafting sequence)")
        self.spec_decode_num_draft_tokens = counter("pagedllm:spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.spec_decode_num_accepted_tokens = counter(
            "pagedllm:spec_decode_num_accepted_tokens", "Draft tokens accepted by verification"
        )
        self._request_success = Counter(
            "pagedllm:request_success",
            "Requests finished, by finish reason",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self._families["pagedllm:request_success"] = self._request_success
        self._model_name = model_name
        self.time_to_first_token = histogram(
            "pagedllm:time_to_first_token_seconds", "Time from arrival to the first token", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "pagedllm:inter_token_latency_seconds", "Time between two tokens of a sequence", ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "pagedllm:e2e_request_latency_seconds", "Time from arrival to the last token", E2E_BUCKETS
        )
        # engine totals already exported, so each update adds only the difference
        self._seen = {"queries": 0, "hits": 0, "preemptions": 0, "computed": 0, "generated": 0,
                      "drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                      **{name: 0 for name in self.kv_disk}}
        self._grammars_watched = False
        self._experts_watched = False
        # token slots per KV block, for vllm:cache_config_info; 0 until the engine's config is known
        self.block_size = 0
        self._num_blocks = 0
        r.register(VllmNameCollector(self._families, model_name, lambda: (self.block_size, self._num_blocks)))

    def watch_grammars(self, compiler: GrammarCompiler) -> None:
        """Export ``compiler``'s cache and compile figures, read at each scrape (once per server: later calls no-op)."""
        if not self._grammars_watched:
            self.registry.register(_GrammarCollector(compiler, self._model_name))
            self._grammars_watched = True

    def watch_experts(self, read_counts: Callable[[], ExpertCounts]) -> None:
        """Export a mixture-of-experts model's routing counts, ``read_counts()`` at each scrape (once per server;
        the runner's ``ExpertLoad.counts``).

        Per expert (summed over the sparse layers) and per layer (its imbalance), not per (layer, expert):
        ``num_experts + num_layers`` series (176 for Qwen3-30B-A3B) rather than their product (6144).
        """
        if not self._experts_watched:
            self.registry.register(_ExpertCollector(read_counts, self._model_name))
            self._experts_watched = True

    def request_success(self, finished_reason: str) -> None:
        """Count a finished request under its (first output's) finish reason."""
        self._request_success.labels(self._model_name, finished_reason).inc()

    def update_from_engine(self, engine: LLMEngine) -> None:
        """Refresh gauges and counters from the engine; call on the engine's own thread."""
        self.batch_invariant.set(int(engine.resolved_config.batch_invariant))
        self.block_size = engine.block_manager.block_size
        self.update_from_stats(engine_stats(engine))

    def update_from_stats(self, stats: EngineStats) -> None:
        """Refresh gauges and counters from an engine's figures (or several engines' sum)."""
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.num_kv_blocks.set(stats.num_blocks)
        self._num_blocks = stats.num_blocks
        self.kv_reserved_bytes.set(stats.kv_reserved_bytes)
        self.kv_resident_bytes.set(stats.kv_resident_bytes)
        self.num_requests_running.set(stats.running)
        self.num_requests_waiting.set(stats.waiting)
        totals = {
            "queries": (stats.prefix_queries, self.prefix_cache_queries),
            "hits": (stats.prefix_hits, self.prefix_cache_hits),
            "preemptions": (stats.preemptions, self.num_preemptions),
            "computed": (stats.prompt_tokens_computed, self.prompt_tokens_computed),
            "generated": (stats.generated_tokens, self.generation_tokens),
            "drafts": (stats.spec_decode_num_drafts, self.spec_decode_num_drafts),
            "draft_tokens": (stats.spec_decode_num_draft_tokens, self.spec_decode_num_draft_tokens),
            "accepted_tokens": (stats.spec_decode_num_accepted_tokens, self.spec_decode_num_accepted_tokens),
        }
        totals.update({name: (getattr(stats, name), metric) for name, metric in self.kv_disk.items()})
        for key, (total, metric) in totals.items():
            delta = total - self._seen[key]
            if delta > 0:
                metric.inc(delta)
            self._seen[key] = total


@dataclass(frozen=True)
class EngineStats:
    """One engine's figures at one moment: plain data, so a replica process can send it.

    The counters are totals since the engine started.
    """

    num_blocks: int = 0
    used_blocks: int = 0
    running: int = 0
    waiting: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    prompt_tokens_computed: int = 0
    generated_tokens: int = 0
    kv_reserved_bytes: int = 0
    kv_resident_bytes: int = 0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    kv_disk_hits: int = 0
    kv_disk_misses: int = 0
    kv_disk_corrupt: int = 0
    kv_disk_bytes_read: int = 0
    kv_disk_bytes_written: int = 0
    kv_disk_evictions: int = 0

    @property
    def kv_cache_usage(self) -> float:
        """Blocks held over blocks in the pool, 0..1."""
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0

    def __add__(self, other: EngineStats) -> EngineStats:
        return EngineStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def counters_only(self) -> EngineStats:
        """The counters, the gauges zeroed (what a dead replica's figures still add to the totals)."""
        return dataclasses.replace(
            self, num_blocks=0, used_blocks=0, running=0, waiting=0, kv_reserved_bytes=0, kv_resident_bytes=0
        )


def engine_stats(engine: LLMEngine) -> EngineStats:
    """The engine's figures now; call on the thread that steps it."""
    bm, runner = engine.block_manager, engine.model_runner
    running = sum(1 for req in engine.requests.values() if any(s.status.value == "running" for s in req.seqs))
    spec = getattr(engine, "speculator", None)  # (stand-in engines in tests have none)
    disk = getattr(engine, "kv_disk", None)
    return EngineStats(
        num_blocks=bm.num_blocks,
        used_blocks=bm.num_used_blocks,
        running=running,
        waiting=len(engine.requests) - running,
        prefix_queries=bm.num_prefix_queries,
        prefix_hits=bm.num_prefix_hits,
        preemptions=engine.scheduler.num_preemptions,
        prompt_tokens_computed=engine.num_prompt_tokens_computed,
        generated_tokens=engine.num_generated_tokens,
        kv_reserved_bytes=runner.kv_cache_bytes,
        # the bookkeeping's count (a syscall over the whole pool each step would cost more than it tells)
        kv_resident_bytes=getattr(bm, "num_touched_blocks", bm.num_used_blocks) * runner.kv_bytes_per_block,
        spec_decode_num_drafts=spec.num_drafts if spec is not None else 0,
        spec_decode_num_draft_tokens=spec.num_draft_tokens if spec is not None else 0,
        spec_decode_num_accepted_tokens=spec.num_accepted_tokens if spec is not None else 0,
        **kv_disk_stats(disk),
    )


def kv_disk_stats(disk: DiskBlockStore | None) -> dict[str, int]:
    """The disk prefix cache's counters under ``EngineStats``' names (zeros when it is off)."""
    if disk is None:
        return {}
    return {
        "kv_disk_hits": disk.num_hits, "kv_disk_misses": disk.num_misses, "kv_disk_corrupt": disk.num_corrupt,
        "kv_disk_bytes_read": disk.bytes_read, "kv_disk_bytes_written": disk.bytes_written,
        "kv_disk_evictions": disk.num_evictions,
    }


class _GrammarCollector:
    """The structured-output grammar compiler's figures, read when Prometheus scrapes (its counters are its own)."""

    def __init__(self, compiler: GrammarCompiler, model_name: str) -> None:
        self._compiler = compiler
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        """One sample per figure, labelled with the model name."""
        c, workers = self._compiler, self._compiler.workers
        figures = [
            (GaugeMetricFamily, "pagedllm:grammar_cache_bytes", "Bytes of the compiled grammars cached", c.cache_bytes),
            (GaugeMetricFamily, "pagedllm:grammar_cache_limit_bytes", "The grammar cache's bound in bytes",
             c.limits.cache_bytes),
            (GaugeMetricFamily, "pagedllm:grammar_cache_entries", "Compiled grammars cached", c.num_cached),
            (GaugeMetricFamily, "pagedllm:grammar_compiles_running", "Grammar compiles running now",
             workers.num_running),
            (GaugeMetricFamily, "pagedllm:grammar_compiles_waiting", "Grammar compiles waiting for a compile worker",
             workers.num_waiting),
            (GaugeMetricFamily, "pagedllm:grammar_compile_workers_idle",
             "Grammar compile workers free now (a killed one is busy until its replacement started)",
             workers.num_idle),
            (CounterMetricFamily, "pagedllm:grammar_compiles", "Grammars compiled (cache misses that compiled)",
             c.num_compiled),
            (CounterMetricFamily, "pagedllm:grammar_compiles_stopped",
             "Grammar compiles killed: past the time or memory limit, or their client left", workers.num_stopped),
        ]
        for family, name, doc, value in figures:
            metric = family(name, doc, labels=["model_name"])
            metric.add_metric([self._model_name], value)
            yield metric


class _ExpertCollector:
    """A mixture of experts' routing counts (``runner/expert_load.py``), copied out when Prometheus scrapes: the
    engine's steps only add into tensors."""

    def __init__(self, read_counts: Callable[[], ExpertCounts], model_name: str) -> None:
        self._read_counts = read_counts
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        """Tokens per expert (over the layers), forward steps counted, and each layer's max / mean load."""
        counts = self._read_counts()
        name = self._model_name
        tokens = CounterMetricFamily(
            "pagedllm:moe_expert_tokens",
            "Tokens routed to each expert, summed over the sparse layers (a token counts once per expert it chose)",
            labels=["model_name", "expert"],
        )
        for expert, n in enumerate(counts.by_expert()):
            tokens.add_metric([name, str(expert)], n)
        yield tokens
        steps = CounterMetricFamily("pagedllm:moe_steps", "Forward steps through the experts counted",
                                    labels=["model_name"])
        steps.add_metric([name], counts.num_steps)
        yield steps
        imbalance = GaugeMetricFamily(
            "pagedllm:moe_layer_load_imbalance",
            "Per sparse layer: its busiest expert's tokens over the mean expert's since the start (1: even)",
            labels=["model_name", "layer"],
        )
        for layer, value in zip(counts.layers, counts.layer_imbalance()):
            imbalance.add_metric([name, str(layer)], value)
        yield imbalance
