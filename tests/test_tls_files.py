"""A TLS file that is not PEM, or a key that is not its certificate's, is bad input named in one line.

Both sides check their files before gRPC sees them (kvmesh.grpc_server.tls_files): a server's (``server_tls``,
``ServerTLS``: control plane and data plane) and a client's (``kvmesh.channels.ClientTLS``: ``kvmesh admin``,
``kvmesh vllm-events``, the data plane's and the engines' links). Before, gRPC's core printed a few lines of its
own and the command blamed the address: "cannot listen on 127.0.0.1:0: address in use" for a server, "UNAVAILABLE
... check that the service runs at that address" for a client, with exit 1.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh import pki
from kvmesh.channels import ClientTLS, channel
from kvmesh.command_line import BAD_INPUT, describe
from kvmesh.grpc_server import ServerTLS, server_tls, start_server

KVMESH = str(Path(sys.executable).parent / "kvmesh")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """A CA, a server certificate (localhost, 127.0.0.1) and a client certificate with their keys, another key,
    and files that are not what their names say."""
    d = tmp_path_factory.mktemp("tls")
    ca = pki.new_authority("test")
    out = {"ca": d / "ca.crt"}
    out["ca"].write_text(pki.pem_cert(ca.cert))
    for name, subject in (("server", pki.Subject("server", True, ("localhost",), ("127.0.0.1",))),
                          ("client", pki.Subject("client", False))):
        cert, key = pki.issue(ca, subject)
        out[f"{name}_cert"], out[f"{name}_key"] = d / f"{name}.crt", d / f"{name}.key"
        out[f"{name}_cert"].write_text(pki.pem_cert(cert))
        out[f"{name}_key"].write_text(pki.pem_key(key))
    _, other = pki.issue(ca, pki.Subject("other", False))
    out["other_key"] = d / "other.key"
    out["other_key"].write_text(pki.pem_key(other))
    out["encrypted_key"] = d / "encrypted.key"
    out["encrypted_key"].write_bytes(other.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.BestAvailableEncryption(b"passphrase")))
    out["garbage"] = d / "garbage.pem"
    out["garbage"].write_text("kvmesh_0123456789abcdef  (an API key, not PEM)\n")
    return {name: str(path) for name, path in out.items()}


def refused_in_one_line(exc: ValueError, *words: str) -> str:
    """The line a command prints for ``exc``: bad input (exit 2), one line, naming each of ``words``."""
    line, status = describe(exc)
    assert status == BAD_INPUT and "\n" not in line and "; " in line, (status, line)
    for word in words:
        assert word in line, (word, line)
    return line


# ---- the server side: server_tls / ServerTLS ----

SERVER_CASES = {  # name: (cert, key, client CA), the words the line names
    "garbage certificate": (("garbage", "server_key", None), ["tls_cert_file", "garbage.pem", "not a PEM certificate"]),
    "a key as the certificate": (("server_key", "server_key", None), ["tls_cert_file", "server.key"]),
    "garbage key": (("server_cert", "garbage", None), ["tls_key_file", "garbage.pem", "not a PEM private key"]),
    "a certificate as the key": (("server_cert", "server_cert", None), ["tls_key_file", "not a PEM private key"]),
    "a key of another certificate": (("server_cert", "client_key", None),
                                     ["tls_key_file", "client.key", "not the private key of", "server.crt"]),
    "an encrypted key": (("server_cert", "encrypted_key", None), ["tls_key_file", "encrypted.key", "encrypted"]),
    "garbage client CA": (("server_cert", "server_key", "garbage"), ["tls_client_ca_file", "garbage.pem"]),
}


@pytest.mark.parametrize("case", SERVER_CASES)
def test_a_server_with_a_bad_tls_file_is_refused_naming_it(files, case):
    names, words = SERVER_CASES[case]
    cert, key, ca = (files[n] if n else None for n in names)
    with pytest.raises(ValueError) as caught:
        server_tls(cert, key, ca)
    refused_in_one_line(caught.value, *words)
    with pytest.raises(ValueError):  # what start_server calls: the same check
        ServerTLS(cert, key, ca).credentials()


def test_a_server_with_valid_tls_files_loads_them(files):
    assert server_tls(None, None, None) is None
    plain = server_tls(files["server_cert"], files["server_key"], None)
    assert isinstance(plain.credentials(), grpc.ServerCredentials)
    mutual = server_tls(files["server_cert"], files["server_key"], files["ca"])
    assert isinstance(mutual.credentials(), grpc.ServerCredentials)


# ---- the client side: ClientTLS ----

CLIENT_CASES = {  # name: (CA, cert, key), the words the line names
    "garbage CA": (("garbage", None, None), ["tls_ca_file", "--tls-ca-file", "garbage.pem", "not a PEM certificate"]),
    "garbage certificate": (("ca", "garbage", "client_key"), ["--tls-cert-file", "garbage.pem"]),
    "garbage key": (("ca", "client_cert", "garbage"), ["--tls-key-file", "garbage.pem", "not a PEM private key"]),
    "a key of another certificate": (("ca", "client_cert", "other_key"),
                                     ["--tls-key-file", "other.key", "not the private key of", "client.crt"]),
    "a certificate without its key": (("ca", "client_cert", None), ["--tls-cert-file", "--tls-key-file", "both"]),
}


@pytest.mark.parametrize("case", CLIENT_CASES)
def test_a_client_with_a_bad_tls_file_is_refused_naming_it(files, case):
    names, words = CLIENT_CASES[case]
    ca, cert, key = (files[n] if n else None for n in names)
    with pytest.raises(ValueError) as caught:
        ClientTLS(ca, cert, key).credentials()
    refused_in_one_line(caught.value, *words)
    with pytest.raises(ValueError):  # every channel builds its credentials so: refused before any connection
        channel("127.0.0.1:1", "key", ClientTLS(ca, cert, key))


def test_a_client_with_valid_tls_files_loads_them(files):
    assert isinstance(ClientTLS(files["ca"]).credentials(), grpc.ChannelCredentials)
    tls = ClientTLS(files["ca"], files["client_cert"], files["client_key"], "localhost")
    assert isinstance(tls.credentials(), grpc.ChannelCredentials)


async def test_the_checked_files_still_make_a_working_mutual_tls_link(files):
    """Positive control end to end: the bytes the check hands gRPC serve and reach a mutual-TLS server."""
    tls = server_tls(files["server_cert"], files["server_key"], files["ca"])
    running = await start_server("127.0.0.1:0", [], tls=tls)
    try:
        client = ClientTLS(files["ca"], files["client_cert"], files["client_key"])
        async with channel(f"127.0.0.1:{running.port}", None, client) as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await running.stop(None)


# ---- as a user runs it ----

def admin(files: dict[str, str], tmp_path: Path, ca: str, cert: str, key: str) -> subprocess.CompletedProcess:
    key_file = tmp_path / "admin.key"
    key_file.write_text("kvm_000000000000_any-text\n")  # any well-formed key: the TLS files are at fault
    return subprocess.run([KVMESH, "admin", "--control-plane", "127.0.0.1:1", "--key-file", str(key_file),
                           "--tls-ca-file", files[ca], "--tls-cert-file", files[cert], "--tls-key-file", files[key],
                           "tenants", "list"], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("ca, cert, key, named", [
    ("garbage", "garbage", "garbage", "garbage.pem"),
    ("ca", "client_cert", "other_key", "other.key"),  # the report's mix-up: a key of another certificate
])
def test_kvmesh_admin_with_a_bad_tls_file_says_so_in_one_line(files, tmp_path, ca, cert, key, named):
    out = admin(files, tmp_path, ca, cert, key)
    lines = out.stderr.splitlines()
    assert "Traceback" not in out.stderr and len(lines) == 1, out.stderr
    assert lines[0].startswith("kvmesh admin: error:") and named in lines[0], lines[0]
    assert out.returncode == BAD_INPUT, (out.returncode, out.stderr)


def test_a_ca_bundle_is_passed_to_grpc_as_given(files, tmp_path):
    """Found in review: a CA bundle was parsed whole, so one certificate this library refuses (or OpenSSL's
    TRUSTED CERTIFICATE blocks, which gRPC reads) refused the whole file. A CA file is now only required to hold a
    PEM certificate block; gRPC judges the rest. Control: garbage is still refused (above)."""
    from kvmesh.grpc_server import tls_files

    bundle = tmp_path / "bundle.crt"
    bundle.write_text(Path(files["ca"]).read_text()
                      + "-----BEGIN TRUSTED CERTIFICATE-----\nMIIBnotparsedhere\n-----END TRUSTED CERTIFICATE-----\n")
    ca, key, cert = tls_files(files["client_cert"], files["client_key"], str(bundle), ca_setting="tls_ca_file")
    assert ca == bundle.read_bytes() and key and cert
