"""Route-time prefetch is traced: its span (on the destination data plane) is in the scheduler's Route trace, and the
engine's later load links to it. A fleet (mutual TLS) exporting spans to files; the scheduler and the engine's ask
run in a child process (connector_client.py) that owns its TracerProvider."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.channels import channel
from kvmesh.v1 import tenant_admin_pb2 as ta_pb, tenant_admin_pb2_grpc as ta_grpc

from control_plane.scheduler_client import SchedulerClient
from tests.tracing.traced_fleet import BS, traced_fleet

pytestmark = [pytest.mark.nixl, pytest.mark.slow]


@pytest.fixture(scope="module")
def traced_prefetch(tmp_path_factory, admin_key):
    with traced_fleet(tmp_path_factory, admin_key) as traced:
        fleet = traced.fleet

        async def scheduler_key() -> str:  # once dp1's event reached the map
            async with channel(fleet.control_plane.address, admin_key, fleet.client_tls()) as ch:
                key = (await ta_grpc.TenantAdminStub(ch).IssueKey(ta_pb.IssueKeyRequest(
                    role=ta_pb.ROLE_SCHEDULER, tenant_id="acme"))).secret
            async with SchedulerClient(fleet.control_plane.address, traced.ns, api_key=key,
                                       tls=fleet.client_tls()) as scheduler:
                for _ in range(100):
                    if (await scheduler.lookup_prefix(block_hashes=traced.hashes)).longest == 8:
                        return key
                    await asyncio.sleep(0.05)
            raise AssertionError("the map never named dp1")

        key = asyncio.run(scheduler_key())
        tls = fleet.client_tls()
        result = traced.run_client({"service": "kvmesh-scheduler", "request_id": "prefetched-1",
                                    "control_plane": fleet.control_plane.address, "scheduler_key": key,
                                    "scheduler_tls": [tls.ca_file, tls.cert_file, tls.key_file]},
                                   "scheduler-and-engine.jsonl", "kvmesh-scheduler-and-engine")
    return result, traced.spans()


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
    # the engine's load is another trace; the call on dp2 that acquired the blocks (its Pull, which pins the
    # prefix, or an Acquire) links to the prefetch
    (load,) = [s for s in spans if s["name"] == "kvmesh.connector.load"]
    acquires = [s for s in spans if s["trace_id"] == load["trace_id"] and s["kind"] == "SERVER"
                and s["name"].endswith(("/Acquire", "/Pull"))]
    assert acquires and any({"trace_id": prefetch["trace_id"], "span_id": prefetch["span_id"]} in s["links"]
                            for s in acquires)
