"""One trace covers every hop of a pull: connector -> local data plane -> control plane (grant)
-> source data plane (handshake, lookup), each process exporting its own spans to a file."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh_apps.fleet import Fleet
from kvmesh.hashing import BlockHasher
from kvmesh.namespace import CacheConfig, Namespace

from data_plane.client import DataPlaneClient, SharedTier
from engine_connector.config import KV_LAYOUT

BS = 32
BLOCK_BYTES = 4096
CLIENT = Path(__file__).with_name("pull_client.py")
REPO = Path(__file__).resolve().parents[2]


def read_spans(trace_dir: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(trace_dir.glob("*.jsonl")) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def traced_pull(tmp_path_factory, admin_key):
    trace_dir = tmp_path_factory.mktemp("traces")
    fleet = Fleet(tmp_path_factory.mktemp("fleet"), 2, admin_key, tenant="acme", block_bytes=BLOCK_BYTES,
                  block_tokens=BS, capacity=f"{64 * BLOCK_BYTES}", trace_dir=trace_dir).start()
    try:
        ns = Namespace("acme", "tiny", "rev1", CacheConfig(block_size=BS, kv_dtype="float32",
                                                           kv_layout=KV_LAYOUT)).validate()
        hashes = BlockHasher().block_hashes(list(range(8 * BS)), BS)

        async def seed() -> None:  # dp1 holds the prefix, as if its engine had computed it
            async with DataPlaneClient(fleet.data_planes["dp1"].address, key=fleet.node_keys["dp1"],
                                       tls=fleet.client_tls("engine-dp1")) as client:
                tier = SharedTier.open(await client.describe_tier())
                for slot in await client.reserve(ns, hashes):
                    tier.slot(slot)[:] = np.uint8(7)
                tier.close()
                await client.commit(ns, hashes)

        asyncio.run(seed())
        for address in [fleet.control_plane.address, *(p.address for p in fleet.data_planes.values())]:
            with grpc.secure_channel(address, fleet.client_tls().credentials()) as ch:  # health probes: never traced
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        host, port = fleet.data_planes["dp1"].address.rsplit(":", 1)
        args = {"connector": fleet.connector_config("dp2"), "hashes": [h.hex() for h in hashes],
                "kv_transfer_params": {"remote_kv_source": {"kv_request_id": "r1", "remote_host": host,
                                                            "remote_port": int(port), "remote_node_id": "dp1"}}}
        env = {**os.environ, "KVMESH_TRACE_EXPORTER": "file", "KVMESH_TRACE_FILE": str(trace_dir / "engine.jsonl"),
               "OTEL_SERVICE_NAME": "kvmesh-engine-dp2"}
        out = subprocess.run([sys.executable, str(CLIENT), json.dumps(args)], capture_output=True, text=True,
                             env=env, cwd=REPO, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        result = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        fleet.stop()  # SimpleSpanProcessor: every span is on disk by now
    return result, read_spans(trace_dir)


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
    assert "Pull" in servers["kvmesh-data-plane-dp2"] and "Acquire" in servers["kvmesh-data-plane-dp2"]
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
