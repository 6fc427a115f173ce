"""The connector's counters through vLLM's connector-stats API and its Prometheus hook (no engine needed)."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine_connector.connector import KvmeshConnector
from engine_connector.scheduler_side import LoadReport
from engine_connector.stats import ConnectorStats


def _interval() -> ConnectorStats:
    stats = ConnectorStats()
    stats.record_lookup(LoadReport(source="dp1", bytes_pulled=4096, pull_ms=12.5, outcome="pulled"))
    stats.record_lookup(LoadReport(source="dp1", pull_ms=3000.0, outcome="pull_failed"))
    stats.record_loaded(local_tokens=32, peer_tokens=128)
    stats.record_failure("deadline")
    return stats


def test_an_interval_roundtrips_through_to_dict_and_aggregates() -> None:
    snapshot = _interval().take()
    rebuilt = KvmeshConnector.build_kv_connector_stats(snapshot.to_dict())
    assert rebuilt.data == snapshot.data
    total = rebuilt.aggregate(KvmeshConnector.build_kv_connector_stats(_interval().take().to_dict()))
    reduced = total.reduce()
    assert reduced["lookups"] == 4 and reduced["pulls"] == 4 and reduced["peer_tokens"] == 256
    assert reduced["bytes_pulled"] == 8192 and reduced["avg_pull_ms"] == 3012.5 / 2
    assert reduced["failures_pull_failed"] == 2 and reduced["failures_deadline"] == 2


def test_an_empty_interval_reports_nothing() -> None:
    stats = ConnectorStats()
    assert stats.is_empty() and stats.take() is None
    assert KvmeshConnector.build_kv_connector_stats({}).is_empty()


def test_prometheus_counters_by_tier_and_reason() -> None:
    registry = CollectorRegistry()

    def bound(cls):
        return lambda *args, **kwargs: cls(*args, registry=registry, **kwargs)

    types = {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}
    prom = KvmeshConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), types,
                                              ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(_interval().take().to_dict(), engine_idx=0)
    value = lambda name, **labels: registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})  # noqa: E731
    assert value("vllm:kvmesh_loaded_tokens_total", tier="peer") == 128
    assert value("vllm:kvmesh_loaded_tokens_total", tier="local") == 32
    assert value("vllm:kvmesh_pulled_bytes_total") == 4096
    assert value("vllm:kvmesh_load_failures_total", reason="deadline") == 1
    assert value("vllm:kvmesh_pull_seconds_total") == 3.0125
