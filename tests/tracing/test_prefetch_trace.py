"""Route-time prefetch is traced: its span (on the destination data plane) is in the scheduler's Route trace, and the
engine's later load links to it. A fleet (mutual TLS) exporting spans to files; the scheduler and the engine's ask
run in a child process (prefetch_client.py) that owns its TracerProvider."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvmesh.channels import channel
from kvmesh.hashing import BlockHasher
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh.v1 import tenant_admin_pb2 as ta_pb, tenant_admin_pb2_grpc as ta_grpc
from kvmesh_apps.fleet import Fleet

from control_plane.scheduler_client import SchedulerClient
from data_plane.client import DataPlaneClient, SharedTier
from engine_connector.config import KV_LAYOUT

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

BS = 32
BLOCK_BYTES = 4096
CLIENT = Path(__file__).with_name("prefetch_client.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def traced_prefetch(tmp_path_factory, admin_key):
    trace_dir = tmp_path_factory.mktemp("traces")
    fleet = Fleet(tmp_path_factory.mktemp("fleet"), 2, admin_key, tenant="acme", block_bytes=BLOCK_BYTES,
                  block_tokens=BS, capacity=f"{64 * BLOCK_BYTES}", trace_dir=trace_dir).start()
    try:
        ns = Namespace("acme", "tiny", "rev1", CacheConfig(block_size=BS, kv_dtype="float32",
                                                           kv_layout=KV_LAYOUT)).validate()
        hashes = BlockHasher().block_hashes(list(range(8 * BS)), BS)

        async def seed() -> str:  # dp1 holds the prefix, as if its engine had computed it
            async with DataPlaneClient(fleet.data_planes["dp1"].address, key=fleet.node_keys["dp1"],
                                       tls=fleet.client_tls("engine-dp1")) as client:
                tier = SharedTier.open(await client.describe_tier())
                for slot in await client.reserve(ns, hashes):
                    tier.slot(slot)[:] = np.uint8(7)
                tier.close()
                await client.commit(ns, hashes)
            async with channel(fleet.control_plane.address, admin_key, fleet.client_tls()) as ch:
                key = (await ta_grpc.TenantAdminStub(ch).IssueKey(ta_pb.IssueKeyRequest(
                    role=ta_pb.ROLE_SCHEDULER, tenant_id="acme"))).secret
            async with SchedulerClient(fleet.control_plane.address, ns, api_key=key,
                                       tls=fleet.client_tls()) as scheduler:
                for _ in range(100):  # dp1's event reaches the map
                    if (await scheduler.lookup_prefix(block_hashes=hashes)).longest == 8:
                        return key
                    await asyncio.sleep(0.05)
            raise AssertionError("the map never named dp1")

        key = asyncio.run(seed())
        tls = fleet.client_tls()
        args = {"connector": fleet.connector_config("dp2"), "hashes": [h.hex() for h in hashes],
                "control_plane": fleet.control_plane.address, "scheduler_key": key,
                "scheduler_tls": [tls.ca_file, tls.cert_file, tls.key_file]}
        env = {**os.environ, "KVMESH_TRACE_EXPORTER": "file",
               "KVMESH_TRACE_FILE": str(trace_dir / "scheduler-and-engine.jsonl"),
               "OTEL_SERVICE_NAME": "kvmesh-scheduler-and-engine"}
        out = subprocess.run([sys.executable, str(CLIENT), json.dumps(args)], capture_output=True, text=True,
                             env=env, cwd=REPO, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        result = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        fleet.stop()  # SimpleSpanProcessor: every span is on disk by now
    spans = [json.loads(line) for path in sorted(trace_dir.glob("*.jsonl")) for line in path.read_text().splitlines()]
    return result, spans


def test_the_engine_got_the_prefetched_prefix(traced_prefetch) -> None:
    result, _ = traced_prefetch
    assert result["prefetch_status"] == "STARTED"
    assert result["matched_tokens"] == 8 * BS and result["report"]["outcome"] == "pulled"


def test_the_prefetch_is_one_span_under_the_route_trace_linked_from_the_engines_load(traced_prefetch) -> None:
    _, spans = traced_prefetch
    (route,) = [s for s in spans if s["name"] == "kvmesh.scheduler.route"]
    (prefetch,) = [s for s in spans if s["name"] == "kvmesh.prefetch"]
    assert prefetch["service"] == "kvmesh-data-plane-dp2" and prefetch["trace_id"] == route["trace_id"]
    trace = {s["span_id"]: s for s in spans if s["trace_id"] == route["trace_id"]}
    chain, span = [], prefetch
    while span["parent_id"]:  # prefetch -> Prefetch (server) -> Prefetch (client) -> kvmesh.scheduler.route
        span = trace[span["parent_id"]]
        chain.append(span["name"].rsplit("/", 1)[-1])
    assert chain == ["Prefetch", "Prefetch", "kvmesh.scheduler.route"], chain
    assert prefetch["attributes"]["kvmesh.blocks"] == 8 and prefetch["attributes"]["kvmesh.source_node"] == "dp1"
    # the prefetch's own pull (grant, handshake, lookup on dp1) is in the Route's trace, under the prefetch
    assert any(s["name"].endswith("/IssuePullGrant") or s["name"].endswith("/Lookup") for s in trace.values())
    # the engine's load is another trace; its Acquire on dp2 links to the prefetch
    (load,) = [s for s in spans if s["name"] == "kvmesh.connector.load"]
    acquires = [s for s in spans if s["trace_id"] == load["trace_id"] and s["kind"] == "SERVER"
                and s["name"].endswith("/Acquire")]
    assert acquires and any({"trace_id": prefetch["trace_id"], "span_id": prefetch["span_id"]} in s["links"]
                            for s in acquires)
