"""Per-replica Prometheus figures of a data-parallel server, and the totals over replicas.

The server-wide names (``pagedllm:num_requests_running``, ...) keep their
meaning: with several replicas they are the sums over all of them (KV usage:
blocks held over blocks in all pools), so dashboards built for one engine
still read right. Each replica's own figures are the same names with a
``replica_`` prefix and a ``replica`` label::

    pagedllm:num_requests_running{model_name="m"} 5
    pagedllm:replica_num_requests_running{model_name="m",replica="0"} 3
    pagedllm:replica_num_requests_running{model_name="m",replica="1"} 2

A replica's counters continue across its restarts (the figures of the dead
process are carried), so they never go down.
"""

from __future__ import annotations

import threading

from prometheus_client import Counter, Gauge

from pagedllm.clients.metrics import EngineStats, ServerMetrics

# (EngineStats field, metric suffix, help) of the counters mirrored per replica
_COUNTERS = (
    ("prefix_queries", "prefix_cache_queries", "Prompt tokens looked up in this replica's prefix cache"),
    ("prefix_hits", "prefix_cache_hits", "Prompt tokens found in this replica's prefix cache"),
    ("preemptions", "num_preemptions", "Sequences this replica preempted"),
    ("prompt_tokens_computed", "prompt_tokens_computed", "Prompt tokens this replica's prefills computed"),
    ("generated_tokens", "generation_tokens", "Tokens this replica generated"),
)


class ReplicaMetrics:
    """Per-replica gauges and counters, and the server totals, refreshed from replicas' stats.

    Args:
        metrics: the server's metrics (their registry gets the per-replica families).
        num_replicas: how many replicas there are.
    """

    def __init__(self, metrics: ServerMetrics, num_replicas: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.metrics = metrics
        self.num_replicas = num_replicas
        r, labels = metrics.registry, ["model_name", "replica"]
        name = metrics._model_name

        def gauge(suffix: str, doc: str) -> list[Gauge]:
            family = Gauge(f"pagedllm:replica_{suffix}", doc, labels, registry=r)
            return [family.labels(name, str(i)) for i in range(num_replicas)]

        def counter(suffix: str, doc: str) -> list[Counter]:
            family = Counter(f"pagedllm:replica_{suffix}", doc, labels, registry=r)
            return [family.labels(name, str(i)) for i in range(num_replicas)]

        self.up = gauge("up", "1 while the replica process serves, 0 while it is (re)starting or stuck")
        self.in_flight = gauge("requests_in_flight", "Engine requests the router has on this replica")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "This replica's KV cache usage, 0 to 1")
        self.num_kv_blocks = gauge("num_kv_blocks", "KV cache blocks in this replica's pool")
        self.running = gauge("num_requests_running", "Requests with a sequence running on this replica")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled on this replica")
        self.restarts = counter("restarts", "Times this replica's process died and was started again")
        self.heartbeat_timeouts = counter(
            "heartbeat_timeouts", "Times this replica sent nothing for its heartbeat timeout and was killed"
        )
        self.counters = {fld: counter(suffix, doc) for fld, suffix, doc in _COUNTERS}
        self._seen = [EngineStats() for _ in range(num_replicas)]
        self._latest = [EngineStats() for _ in range(num_replicas)]
        self._lock = threading.Lock()

    def update(self, index: int, stats: EngineStats) -> None:
        """Replica ``index``'s figures (counters cumulative across its restarts); refreshes the totals."""
        with self._lock:
            self.kv_cache_usage[index].set(stats.kv_cache_usage)
            self.num_kv_blocks[index].set(stats.num_blocks)
            self.running[index].set(stats.running)
            self.waiting[index].set(stats.waiting)
            seen = self._seen[index]
            for fld, metric in self.counters.items():
                delta = getattr(stats, fld) - getattr(seen, fld)
                if delta > 0:
                    metric[index].inc(delta)
            self._seen[index] = stats
            self._latest[index] = stats
            total = EngineStats()
            for s in self._latest:
                total = total + s
            self.metrics.update_from_stats(total)

    def set_up(self, index: int, up: bool) -> None:
        """Mark replica ``index`` serving or not."""
        self.up[index].set(1 if up else 0)

    def restarted(self, index: int) -> None:
        """Count one restart of replica ``index``."""
        self.restarts[index].inc()

    def unresponsive(self, index: int) -> None:
        """Count one heartbeat timeout of replica ``index``."""
        self.heartbeat_timeouts[index].inc()
