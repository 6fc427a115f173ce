"""A data plane says when its NIXL agent is up (issue 19): the "listening" line comes when the local API answers,
and the agent can take seconds more on a loaded host, so a first peer call made at once could spend its whole
deadline waiting for it (the byte-path tests did, under load). The gRPC health status of TRANSFERS_HEALTH is
NOT_SERVING until the agent is up and SERVING after; a node whose agent cannot be created stays NOT_SERVING and
answers peer calls UNAVAILABLE, saying why (negative control). Real data-plane processes.
"""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tenancy.peer_proof import NodeIdentity

from data_plane.server import TRANSFERS_HEALTH

from tests.security.test_byte_path_gating import BLOCK, TENANT_A, as_peer, fleet, wait_transfers_ready  # noqa: F401

pytestmark = [pytest.mark.nixl, pytest.mark.slow]


def transfers_status(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=TRANSFERS_HEALTH), timeout=10).status


async def test_a_node_reports_when_its_transfers_are_ready(fleet, monkeypatch):
    me = NodeIdentity()
    ready = fleet.start("src")  # Fleet.start waits for TRANSFERS_HEALTH to be SERVING
    assert transfers_status(ready.address) == health_pb2.HealthCheckResponse.SERVING
    async with as_peer(me, ready) as peer:
        t0 = time.monotonic()
        hs = await peer.exchange_agent_metadata("peer", b"", BLOCK, timeout=2.0,
                                                grant=fleet.grant(me.public_key, "peer", "src", TENANT_A))
        assert hs.node_id == "src" and time.monotonic() - t0 < 2.0, "once ready, a first peer call is answered at once"

    # Negative control: an agent that cannot be created (no such UCX transport) is never reported ready.
    monkeypatch.setattr("tests.security.test_byte_path_gating.wait_transfers_ready", lambda proc: None)
    broken = fleet.start("broken", UCX_TLS="no_such_transport")
    deadline = time.monotonic() + 60
    while not any("serves no transfers" in line for line in broken.output):
        assert time.monotonic() < deadline, "\n".join(broken.output)
        time.sleep(0.1)
    assert transfers_status(broken.address) == health_pb2.HealthCheckResponse.NOT_SERVING
    async with as_peer(me, broken) as peer:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await peer.exchange_agent_metadata("peer", b"", BLOCK, timeout=5.0,
                                               grant=fleet.grant(me.public_key, "peer", "broken", TENANT_A))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "NIXL" in err.value.details(), err.value.details()
