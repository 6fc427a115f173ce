"""One trace covers every hop of a pull: connector -> local data plane -> control plane (grant)
-> source data plane (handshake, lookup), each process exporting its own spans to a file."""

from __future__ import annotations

from collections import defaultdict

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.tracing.traced_fleet import BLOCK_BYTES, BS, traced_fleet


@pytest.fixture(scope="module")
def traced_pull(tmp_path_factory, admin_key):
    with traced_fleet(tmp_path_factory, admin_key) as traced:
        fleet = traced.fleet
        for name, address in [("control-plane", fleet.control_plane.address),
                              *((n, p.address) for n, p in fleet.data_planes.items())]:
            tls = fleet.client_tls(server=name)  # each certificate names its role: a data plane's its node id
            with grpc.secure_channel(address, tls.credentials(), options=tls.options([])) as ch:  # never traced
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        host, port = fleet.data_planes["dp1"].address.rsplit(":", 1)
        source = {"kv_request_id": "r1", "remote_host": host, "remote_port": int(port), "remote_node_id": "dp1"}
        result = traced.run_client({"service": "kvmesh-engine-connector", "request_id": "traced-1",
                                    "kv_transfer_params": {"remote_kv_source": source}},
                                   "engine.jsonl", "kvmesh-engine-dp2")
    return result, traced.spans()


def test_the_pull_worked(traced_pull) -> None:
    result, _ = traced_pull
    assert result["matched_tokens"] == 8 * BS
    assert result["report"]["outcome"] == "pulled" and result["report"]["bytes_pulled"] == 8 * BLOCK_BYTES


def test_one_trace_id_covers_connector_control_plane_and_both_data_planes(traced_pull) -> None:
    _, spans = traced_pull
    (root,) = [s for s in spans if s["name"] == "kvmesh.connector.load"]
    trace = [s for s in spans if s["trace_id"] == root["trace_id"]]
    servers = defaultdict(set)
    for span in trace:
        if span["kind"] == "SERVER":
            servers[span["service"]].add(span["name"].rsplit("/", 1)[-1])
    # the Pull pins the prefix for the engine in the same call (PullRequest.lease_ms): no Acquire after it
    assert "Pull" in servers["kvmesh-data-plane-dp2"] and "Acquire" not in servers["kvmesh-data-plane-dp2"]
    assert "IssuePullGrant" in servers["kvmesh-control-plane"]
    assert {"ExchangeAgentMetadata", "Lookup"} <= servers["kvmesh-data-plane-dp1"]
    # Every span of the trace hangs off the connector's span (parents are known spans of the same trace).
    ids = {s["span_id"] for s in trace}
    assert all(s["parent_id"] in ids for s in trace if s is not root) and root["parent_id"] == ""


def test_spans_carry_tenant_namespace_blocks_bytes_tier_and_outcome(traced_pull) -> None:
    _, spans = traced_pull
    (root,) = [s for s in spans if s["name"] == "kvmesh.connector.load"]
    attrs = root["attributes"]
    assert attrs["kvmesh.tenant"] == "acme" and len(attrs["kvmesh.namespace"]) == 16
    assert attrs["kvmesh.blocks"] == 8 and attrs["kvmesh.bytes"] == 8 * BLOCK_BYTES
    assert attrs["kvmesh.tier"] == "peer" and attrs["kvmesh.outcome"] == "pulled"
    (pull_client,) = [s for s in spans if s["trace_id"] == root["trace_id"] and s["kind"] == "CLIENT"
                      and s["name"].endswith("/Pull")]
    assert pull_client["attributes"]["kvmesh.tenant"] == "acme" and pull_client["attributes"]["kvmesh.blocks"] == 8


def test_health_probes_are_not_traced(traced_pull) -> None:
    _, spans = traced_pull
    assert not [s for s in spans if "grpc.health" in s["name"] or "reflection" in s["name"]]
