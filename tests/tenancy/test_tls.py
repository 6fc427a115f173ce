"""Channels with TLS and mutual TLS (certificates made at test time)."""

from __future__ import annotations

import datetime
import ipaddress

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvmesh.channels import ClientTLS, channel
from kvmesh.v1 import common_pb2, control_plane_pb2_grpc

from control_plane.server import serve


def _write_pair(tmp_path, name, cert, key):
    (tmp_path / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                             serialization.PrivateFormat.PKCS8,
                                                             serialization.NoEncryption()))
    return str(tmp_path / f"{name}.crt"), str(tmp_path / f"{name}.key")


def _cert(subject: str, issuer_name, issuer_key, key, ca=False):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture
def pki(tmp_path):
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvmesh test CA")])
    ca = _cert("kvmesh test CA", ca_name, ca_key, ca_key, ca=True)
    ca_file, _ = _write_pair(tmp_path, "ca", ca, ca_key)
    out = {"ca": ca_file}
    for name in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        out[name] = _write_pair(tmp_path, name, _cert(name, ca_name, ca_key, key), key)
    other_key = ec.generate_private_key(ec.SECP256R1())
    other_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "another CA")])
    out["other_ca"], _ = _write_pair(tmp_path, "other-ca", _cert("another CA", other_name, other_key, other_key,
                                                                  ca=True), other_key)
    key = ec.generate_private_key(ec.SECP256R1())
    out["other_client"] = _write_pair(tmp_path, "other-client", _cert("intruder", other_name, other_key, key), key)
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
