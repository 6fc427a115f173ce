"""TLS and mutual TLS on both planes, tried as an attacker: a plaintext client, a client that trusts
another CA, a client certificate from another CA are refused; the right certificates work, and a
data plane reaches a mutual-TLS control plane over TLS (so node keys and grants never travel in clear)."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvmesh.channels import ClientTLS, channel
from kvmesh.v1 import common_pb2, control_plane_pb2 as cp_pb, control_plane_pb2_grpc as cp_grpc
from kvmesh.v1 import data_plane_pb2 as dp_pb, data_plane_pb2_grpc as dp_grpc, tenant_admin_pb2 as ta_pb
from kvmesh.v1 import tenant_admin_pb2_grpc as ta_grpc

from tests.pki import certificate, write_pem

pytestmark = pytest.mark.slow


def _ca(tmp_path, label):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvmesh {label} CA")])
    cert = certificate(f"kvmesh {label} CA", name, key, key, ca=True)
    out = {"ca": write_pem(tmp_path, f"{label}-ca", cert)[0]}
    for who in ("server", "client"):
        leaf_key = ec.generate_private_key(ec.SECP256R1())
        out[who] = write_pem(tmp_path, f"{label}-{who}", certificate(f"{label}-{who}", name, key, leaf_key), leaf_key)
    return out


@pytest.fixture
def cp_config(redis_server, key_prefix, admin_key):
    from control_plane.config import ControlPlaneConfig

    return ControlPlaneConfig(listen="127.0.0.1:0", redis_url=redis_server.url, key_prefix=key_prefix,
                              lease_ms=60_000, admin_key=admin_key, policy_ttl_s=0)


@pytest.fixture
def pki(tmp_path):
    return {"good": _ca(tmp_path, "good"), "other": _ca(tmp_path, "other")}


async def _refused(address, key, tls, call):
    async with channel(address, key, tls) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(ch)
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN), info.value
    return info.value


async def _probe_all(address, key, pki, call):
    """Every wrong way in is refused; the right certificates work."""
    good, other = pki["good"], pki["other"]
    await _refused(address, key, None, call)  # plaintext client
    await _refused(address, key, ClientTLS(other["ca"], *good["client"]), call)  # trusts another CA
    await _refused(address, key, ClientTLS(good["ca"], *other["client"]), call)  # client cert from another CA
    await _refused(address, key, ClientTLS(good["ca"]), call)  # no client certificate
    async with channel(address, key, ClientTLS(good["ca"], *good["client"])) as ch:  # positive control
        await call(ch)


async def test_control_plane_refuses_plaintext_and_foreign_certificates(cp_config, pki, admin_key):
    from control_plane.server import serve

    good = pki["good"]
    config = cp_config.model_copy(update={"tls_cert_file": good["server"][0], "tls_key_file": good["server"][1],
                                          "tls_client_ca_file": good["ca"]})
    running = await serve(config)
    try:
        async def ping(ch):
            await cp_grpc.ControlPlaneStub(ch).Ping(common_pb2.PingRequest(), timeout=10)

        await _probe_all(f"127.0.0.1:{running.port}", admin_key, pki, ping)

        # A router's SchedulerClient: refused in plaintext, routes over mutual TLS (positive control).
        from control_plane.scheduler_client import Candidate, SchedulerClient
        from kvmesh.namespace import CacheConfig, Namespace

        address = f"127.0.0.1:{running.port}"
        async with channel(address, admin_key, ClientTLS(good["ca"], *good["client"])) as ch:
            await ta_grpc.TenantAdminStub(ch).CreateTenant(ta_pb.CreateTenantRequest(tenant_id="tls-router"),
                                                           timeout=10)
        ns = Namespace("tls-router", "m", "", CacheConfig(block_size=16))
        candidates = [Candidate("engine-a", "node-a")]
        async with SchedulerClient(address, ns, api_key=admin_key) as client:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.route(candidates, token_ids=list(range(32)))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        tls = ClientTLS(good["ca"], *good["client"])
        async with SchedulerClient(address, ns, api_key=admin_key, tls=tls) as client:
            assert (await client.route(candidates, token_ids=list(range(32)))).engine_id == "engine-a"
    finally:
        await running.stop()


async def test_data_plane_tls_both_ways(cp_config, pki, admin_key, tmp_path):
    """A data plane serving mutual TLS refuses wrong clients, and itself reaches the control plane over
    mutual TLS: it registers (its node key crossed only TLS) and fetches the grant key."""
    from control_plane.server import serve as serve_cp
    from data_plane.config import DataPlaneConfig
    from data_plane.server import serve as serve_dp

    good = pki["good"]
    tls = {"tls_cert_file": good["server"][0], "tls_key_file": good["server"][1], "tls_client_ca_file": good["ca"]}
    cp = await serve_cp(cp_config.model_copy(update=tls))
    cp_address = f"127.0.0.1:{cp.port}"
    admin_tls = ClientTLS(good["ca"], *good["client"])
    node_id = f"tls-{uuid.uuid4().hex[:6]}"
    async with channel(cp_address, admin_key, admin_tls) as ch:
        node_key = (await ta_grpc.TenantAdminStub(ch).IssueKey(
            ta_pb.IssueKeyRequest(role=ta_pb.ROLE_NODE, node_id=node_id), timeout=10)).secret
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    config = DataPlaneConfig(node_id=node_id, listen="127.0.0.1:0", shm_dir=shm, block_bytes=65536,
                             capacity_bytes=8 * 65536, lock_memory=False, api_key=node_key,
                             control_plane_address=cp_address, tls_ca_file=good["ca"], **tls)
    dp = await serve_dp(config)
    try:
        async def describe(ch):
            await dp_grpc.DataPlaneStub(ch).DescribeTier(dp_pb.DescribeTierRequest(), timeout=10)

        await _probe_all(dp.address, node_key, pki, describe)
        async with channel(cp_address, admin_key, admin_tls) as ch:
            stub = cp_grpc.ControlPlaneStub(ch)
            for _ in range(100):  # the node's publisher registers over mutual TLS
                nodes = (await stub.ListNodes(cp_pb.ListNodesRequest(), timeout=10)).nodes
                if any(n.node.node_id == node_id and n.live for n in nodes):
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("the data plane never registered over TLS")
        # The engine connector's links (to its data plane and the control plane) over mutual TLS too.
        from engine_connector.config import ConnectorConfig
        from engine_connector.node_link import NodeLink

        connector = ConnectorConfig.from_extra_config({
            "data_plane_address": dp.address, "api_key": node_key, "control_plane_address": cp_address,
            "tls_ca_file": good["ca"], "tls_cert_file": good["client"][0], "tls_key_file": good["client"][1]})
        link = await asyncio.to_thread(NodeLink, dp.address, node_key, cp_address, 10.0, connector.tls())
        try:
            assert (await asyncio.to_thread(link.describe_tier)).node_id == node_id
            for _ in range(100):  # listed in the background (address_of never waits on the network)
                if await asyncio.to_thread(link.address_of, node_id) == dp.address:
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("the connector never learnt its node's address over TLS")
        finally:
            await asyncio.to_thread(link.close)
    finally:
        await dp.stop()
        await cp.stop()
