"""The connector's counters in vLLM's own metrics: ``KVConnectorStats`` and Prometheus.

The scheduler side records what each background lookup and each accepted load did
(:class:`ConnectorStats`); vLLM collects it every step through ``get_kv_connector_stats``,
rebuilds it in its logger process with ``build_kv_connector_stats`` (from ``to_dict()``: plain
data), sums intervals with ``aggregate``, logs ``reduce()`` ("KV Transfer metrics: ...") and
feeds :class:`KvmeshPromMetrics`, which ``build_prom_metrics`` registers beside vLLM's own
prefix-cache counters on the engine's ``/metrics``. Tokens by tier also reach vLLM's
``external_prefix_cache_hits_by_source`` through ``get_external_cache_hit_sources`` (connector.py).

Not thread-safe: the scheduler thread records and takes snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

if TYPE_CHECKING:
    from engine_connector.load_report import LoadReport

# Summed counters (tokens, bytes, counts, milliseconds); ``failures`` is a {reason: count} map.
COUNTERS = ("lookups", "pulls", "local_tokens", "peer_tokens", "bytes_pulled", "pull_ms", "failed_blocks")
FAILURE_REASONS = ("deadline", "pull_failed", "pull_missed", "control_plane_error", "data_plane_error",
                   "unknown_source", "copy", "error")


def _empty() -> dict[str, Any]:
    return {**{name: 0 for name in COUNTERS}, "failures": {}}


@dataclass
class ConnectorStats(KVConnectorStats):
    """One interval's counters; ``data`` is ``{counter: number, "failures": {reason: count}}``."""

    def __post_init__(self) -> None:
        self.data = {**_empty(), **(self.data or {})}
        self.data["failures"] = dict(self.data["failures"])

    def record_lookup(self, attempt: "LoadReport") -> None:
        self.data["lookups"] += 1
        if attempt.source:
            self.data["pulls"] += 1
            self.data["bytes_pulled"] += attempt.bytes_pulled
            self.data["pull_ms"] += attempt.pull_ms
        if attempt.outcome in FAILURE_REASONS:
            self.record_failure(attempt.outcome)

    def record_loaded(self, local_tokens: int, peer_tokens: int) -> None:
        self.data["local_tokens"] += local_tokens
        self.data["peer_tokens"] += peer_tokens

    def record_failure(self, reason: str, blocks: int = 0) -> None:
        self.data["failures"][reason] = self.data["failures"].get(reason, 0) + 1
        self.data["failed_blocks"] += blocks

    def take(self) -> "ConnectorStats | None":
        """This interval's counters (None when nothing happened); starts the next interval."""
        if self.is_empty():
            return None
        snapshot = ConnectorStats(data=self.data)
        self.reset()
        return snapshot

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> "ConnectorStats":
        for name in COUNTERS:
            self.data[name] += other.data.get(name, 0)
        for reason, count in other.data.get("failures", {}).items():
            self.data["failures"][reason] = self.data["failures"].get(reason, 0) + count
        return self

    def reduce(self) -> dict[str, int | float]:
        pulls = self.data["pulls"]
        out: dict[str, int | float] = {name: self.data[name] for name in COUNTERS if name != "pull_ms"}
        out["avg_pull_ms"] = round(self.data["pull_ms"] / pulls, 3) if pulls else 0.0
        out.update({f"failures_{reason}": count for reason, count in sorted(self.data["failures"].items())})
        return out

    def is_empty(self) -> bool:
        return not self.data["lookups"] and not any(self.data[name] for name in COUNTERS) \
            and not self.data["failures"]


class KvmeshPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvmesh_*`` counters per engine: loaded tokens by tier, bytes and time pulled, failures by reason."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return self._counter_cls(name=f"vllm:kvmesh_{name}", documentation=doc,
                                     labelnames=[*labelnames, *extra])

        self._tokens = counter("loaded_tokens", "Prompt tokens whose KV kvmesh loaded, by tier (local, peer).",
                               ("tier",))
        self._bytes = create_metric_per_engine(counter("pulled_bytes", "Bytes pulled from peers."),
                                               per_engine_labelvalues)
        self._pull_s = create_metric_per_engine(counter("pull_seconds", "Seconds spent in pulls from peers."),
                                                per_engine_labelvalues)
        self._lookups = create_metric_per_engine(counter("lookups", "Background lookups (and pulls) ended."),
                                                 per_engine_labelvalues)
        self._failures = counter("load_failures", "Loads that fell back to recompute, by reason.", ("reason",))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = {**_empty(), **transfer_stats_data}
        labels = self.per_engine_labelvalues[engine_idx]
        self._tokens.labels(*labels, "local").inc(data["local_tokens"])
        self._tokens.labels(*labels, "peer").inc(data["peer_tokens"])
        self._bytes[engine_idx].inc(data["bytes_pulled"])
        self._pull_s[engine_idx].inc(data["pull_ms"] / 1e3)
        self._lookups[engine_idx].inc(data["lookups"])
        for reason, count in data["failures"].items():
            self._failures.labels(*labels, reason).inc(count)
