"""docs/metrics.md against a live `kvmesh up` fleet: `up` prints every service's Prometheus endpoint and each serves
exactly the metrics the page lists for its service (none missing from the page, none listed that it lacks); the
tier gauges report each data plane's capacity. The engines' `vllm:kvmesh_*` section is checked against the
connector's own Prometheus hook (vLLM serves those, not a kvmesh service)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
_ROW = re.compile(r"^\| `([a-z0-9_:]+)` \|")
_TYPE = re.compile(r"^# TYPE (\S+) (\S+)$", re.M)


def documented() -> dict[str, set[str]]:
    """``{section title: metric names}`` from the first column of docs/metrics.md's tables."""
    sections: dict[str, set[str]] = {}
    title = ""
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            title = line[3:].strip()
        elif (match := _ROW.match(line)) and title:
            sections.setdefault(title, set()).add(match.group(1))
    return sections


def families(text: str) -> set[str]:
    """The metric names an exposition serves, as scraped (``_total`` counters), without the ``<name>_created``
    gauges prometheus_client adds to each counter and histogram."""
    types = dict(_TYPE.findall(text))
    return {name for name, kind in types.items()
            if not (kind == "gauge" and name.endswith("_created")
                    and ({name[:-len("_created")], name[:-len("_created")] + "_total"} & types.keys()))}


def scrape(url: str) -> str:
    return urllib.request.urlopen(url, timeout=10).read().decode()


def sample(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series == f"{name}{{{want}}}" or (not labels and series == name):
            return float(value)
    raise AssertionError(f"no sample {name}{{{want}}}")


def _printed(lines: list[str]) -> dict[str, str]:
    """{service: metrics URL} from `kvmesh up`'s human output (each under its service's line)."""
    metrics, current = {}, ""
    for line in lines:
        if line.startswith("control plane  "):
            current = "control_plane"
        elif line.startswith("data plane     "):
            current = line.split()[2]
        elif line.startswith("  metrics:") and current:
            metrics[current] = line.split()[-1]
    return metrics


def test_every_served_metric_is_documented_and_every_documented_one_served(tmp_path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh_apps.cli", "up", "--data-planes", "2", "--capacity",
                             "1MiB", "--block-bytes", "4096", "--workdir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not lines or lines[-1] != "Ctrl-C stops everything.":
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            lines.append(line.rstrip("\n"))
        urls = _printed(lines)
        assert set(urls) == {"control_plane", "dp1", "dp2"}, lines  # every service's endpoint, printed
        assert len(set(urls.values())) == 3 and all(u.startswith("http://127.0.0.1:") for u in urls.values())

        docs = documented()
        cp_doc, dp_doc = docs["Control plane"], docs["Data plane"]
        assert len(cp_doc) >= 10 and len(dp_doc) >= 15  # the parse found the tables
        cp_served = families(scrape(urls["control_plane"]))
        assert cp_served == cp_doc, (f"served, not in docs/metrics.md: {sorted(cp_served - cp_doc)}; "
                                     f"documented, not served: {sorted(cp_doc - cp_served)}")
        # negative control: the comparison sees one metric missing from the page, and one listed but not served
        assert cp_served != cp_doc - {"kvmesh_cp_stale_route_rate"} and cp_served != cp_doc | {"kvmesh_cp_x"}

        for node in ("dp1", "dp2"):
            text = scrape(urls[node])
            served = families(text)
            assert served == dp_doc, (f"{node} serves, not in docs/metrics.md: {sorted(served - dp_doc)}; "
                                      f"documented, not served: {sorted(dp_doc - served)}")
            assert sample(text, "kvmesh_dp_tier_capacity_bytes", node=node, tier="cpu") == 1 << 20
            # nothing stored yet (the bytes of stored blocks: tests/test_metrics.py)
            assert sample(text, "kvmesh_dp_tier_used_bytes", node=node, tier="cpu") == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_the_engine_section_lists_exactly_the_connectors_metrics() -> None:
    """The connector's Prometheus hook, registered as vLLM registers it (no engine needed)."""
    from engine_connector.connector import KvmeshConnector

    registry = CollectorRegistry()

    def bound(cls):
        return lambda *args, **kwargs: cls(*args, registry=registry, **kwargs)

    types = {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}
    KvmeshConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"],
                                       {0: ["m", "0"]})
    served = families(generate_latest(registry).decode())
    assert served and served == documented()["Engines (the vLLM connector)"], served
