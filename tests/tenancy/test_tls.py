"""Channels with TLS and mutual TLS (certificates made at test time)."""

from __future__ import annotations

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvmesh.channels import ClientTLS, channel
from kvmesh.v1 import common_pb2, control_plane_pb2_grpc

from control_plane.server import serve

from tests.pki import certificate, write_pem


@pytest.fixture
def pki(tmp_path):
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvmesh test CA")])
    ca = certificate("kvmesh test CA", ca_name, ca_key, ca_key, ca=True)
    ca_file, _ = write_pem(tmp_path, "ca", ca, ca_key)
    out = {"ca": ca_file}
    for name in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        out[name] = write_pem(tmp_path, name, certificate(name, ca_name, ca_key, key), key)
    other_key = ec.generate_private_key(ec.SECP256R1())
    other_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "another CA")])
    out["other_ca"], _ = write_pem(tmp_path, "other-ca", certificate("another CA", other_name, other_key, other_key,
                                                                  ca=True), other_key)
    key = ec.generate_private_key(ec.SECP256R1())
    out["other_client"] = write_pem(tmp_path, "other-client", certificate("intruder", other_name, other_key, key), key)
    return out


async def _refused(address, key, tls):
    async with channel(address, key, tls) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await control_plane_pb2_grpc.ControlPlaneStub(ch).Ping(common_pb2.PingRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_tls_and_mutual_tls(cp_config, pki, admin_key):
    server_cert, server_key = pki["server"]
    tls = cp_config.model_copy(update={"tls_cert_file": server_cert, "tls_key_file": server_key})
    running = await serve(tls)
    try:
        async with channel(f"127.0.0.1:{running.port}", admin_key, ClientTLS(pki["ca"])) as ch:
            await control_plane_pb2_grpc.ControlPlaneStub(ch).Ping(common_pb2.PingRequest(), timeout=10)
        await _refused(f"127.0.0.1:{running.port}", admin_key, None)  # plaintext
        await _refused(f"127.0.0.1:{running.port}", admin_key, ClientTLS(pki["other_ca"]))  # server not trusted
    finally:
        await running.stop()

    mtls = tls.model_copy(update={"tls_client_ca_file": pki["ca"]})
    running = await serve(mtls)
    try:
        async with channel(f"127.0.0.1:{running.port}", admin_key, ClientTLS(pki["ca"])) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await control_plane_pb2_grpc.ControlPlaneStub(ch).Ping(common_pb2.PingRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # no client certificate: no handshake
        await _refused(f"127.0.0.1:{running.port}", admin_key, ClientTLS(pki["ca"], *pki["other_client"]))
        client_cert, client_key = pki["client"]
        async with channel(f"127.0.0.1:{running.port}", admin_key, ClientTLS(pki["ca"], client_cert, client_key)) as ch:
            await control_plane_pb2_grpc.ControlPlaneStub(ch).Ping(common_pb2.PingRequest(), timeout=10)
    finally:
        await running.stop()
