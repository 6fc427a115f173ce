"""docker/init_secrets.py (the compose `secrets-init` step): fresh secrets, owned by their consumer alone, kept on a
second run; the ACL file it renders works in a real redis-server: each user with its generated password only; the
CA and per-service certificates it issues carry the compose service names and serve the real planes' mutual TLS."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import runpy
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvmesh.channels import ClientTLS, channel
from kvmesh.v1 import control_plane_pb2 as cp_pb, control_plane_pb2_grpc as cp_grpc
from kvmesh.v1 import data_plane_pb2 as dp_pb, data_plane_pb2_grpc as dp_grpc
from kvmesh.v1 import tenant_admin_pb2 as ta_pb, tenant_admin_pb2_grpc as ta_grpc

from kvmesh_apps.redis_server import find_redis_server
from tests.pki import certificate, write_pem

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "docker/redis/users.acl"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="secrets-init gives files to other uids: runs as root")


def init_secrets(root: Path) -> None:
    main = runpy.run_path(str(ROOT / "docker/init_secrets.py"))["main"]
    assert main(["--acl-template", str(TEMPLATE), "--nodes", "dp1,dp2", "--root", str(root)]) == 0


def _owner_and_mode(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_uid, stat.S_IMODE(st.st_mode)


@pytest.fixture
def secrets_root(tmp_path) -> Path:
    init_secrets(tmp_path)
    return tmp_path


def test_every_secret_is_generated_for_its_consumer_alone(secrets_root):
    files = {
        "admin/admin.key": (10001, 0o400),
        "control-plane/redis-password": (10001, 0o400),
        "control-plane/redis-acl-password": (10001, 0o400),
        "control-plane/tenant-secret": (10001, 0o400),
        "control-plane/grant-key.pem": (10001, 0o600),
        "redis/users.acl": (999, 0o600),
        "redis/healthcheck-password": (999, 0o400),
    }
    for name, expected in files.items():
        assert _owner_and_mode(secrets_root / name) == expected, name
        assert _owner_and_mode((secrets_root / name).parent)[1] == 0o700
    for node in ("dp1", "dp2"):
        assert _owner_and_mode(secrets_root / "nodes" / node) == (10001, 0o700)
    assert (secrets_root / "admin/admin.key").read_text().startswith("kvm_")
    load_pem_private_key((secrets_root / "control-plane/grant-key.pem").read_bytes(), None)


def test_passwords_are_random_and_only_their_hashes_reach_redis(secrets_root, tmp_path_factory):
    other = tmp_path_factory.mktemp("other")
    init_secrets(other)
    password = (secrets_root / "control-plane/redis-password").read_text().strip()
    assert password != (other / "control-plane/redis-password").read_text().strip()  # no default
    acl = (secrets_root / "redis/users.acl").read_text()
    assert password not in acl and "#" + hashlib.sha256(password.encode()).hexdigest() in acl
    assert "#@" not in acl and not [line for line in acl.splitlines() if not line.startswith("user ")]


def test_a_second_run_keeps_what_exists(secrets_root):
    before = {p: p.read_bytes() for p in secrets_root.rglob("*") if p.is_file()}
    init_secrets(secrets_root)
    assert {p: p.read_bytes() for p in secrets_root.rglob("*") if p.is_file()} == before


@pytest.fixture
def acl_redis(secrets_root, tmp_path):
    """A real redis-server on the rendered ACL file."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--dir", str(tmp_path), "--aclfile", str(secrets_root / "redis/users.acl")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not start"
            time.sleep(0.05)
    yield port
    proc.terminate()
    proc.wait(10)


def test_the_rendered_acl_admits_each_user_with_its_password_only(secrets_root, acl_redis):
    cp_password = (secrets_root / "control-plane/redis-password").read_text().strip()
    acl_password = (secrets_root / "control-plane/redis-acl-password").read_text().strip()
    hc_password = (secrets_root / "redis/healthcheck-password").read_text().strip()
    # Positive controls: the control plane's user works on kvmesh's keys; its ACL user makes a tenant user;
    # the healthcheck user may ping.
    cp = redis.Redis(port=acl_redis, username="kvmesh-cp", password=cp_password)
    cp.set("kvm:probe", "1")
    assert cp.get("kvm:probe") == b"1"
    acl = redis.Redis(port=acl_redis, username="kvmesh-acl", password=acl_password)
    acl.execute_command("ACL", "SETUSER", "kvm-t-probe", "on", ">probe-password", "~kvm:{t:probe:*", "+get")
    assert redis.Redis(port=acl_redis, username="healthcheck", password=hc_password).ping()
    # The attacker: no default user, no swapped password, no key outside kvmesh's prefix, no command beyond PING.
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=acl_redis).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=acl_redis, username="kvmesh-cp", password=hc_password).ping()
    with pytest.raises(redis.exceptions.NoPermissionError):
        cp.set("other:probe", "1")
    with pytest.raises(redis.exceptions.NoPermissionError):
        cp.execute_command("ACL", "SETUSER", "intruder", "on", ">x", "~*", "+@all")  # only the ACL user may
    with pytest.raises(redis.exceptions.NoPermissionError):
        acl.get("kvm:probe")  # and that one touches no key
    with pytest.raises(redis.exceptions.NoPermissionError):
        redis.Redis(port=acl_redis, username="healthcheck", password=hc_password).get("kvm:probe")


# ---- TLS: the private CA and one certificate per service ----

TLS_SERVERS, TLS_CLIENTS = ("control-plane", "dp1", "dp2"), ("engine1", "engine2", "admin")


def init_tls(root: Path) -> None:
    main = runpy.run_path(str(ROOT / "docker/init_secrets.py"))["main"]
    assert main(["--acl-template", str(TEMPLATE), "--nodes", "dp1,dp2", "--root", str(root),
                 "--tls-servers", ",".join(TLS_SERVERS), "--tls-clients", ",".join(TLS_CLIENTS)]) == 0


@pytest.fixture
def tls_root(tmp_path) -> Path:
    init_tls(tmp_path)
    return tmp_path


def test_each_service_gets_its_own_certificate_for_its_service_name(tls_root):
    ca = x509.load_pem_x509_certificate((tls_root / "ca/ca.crt").read_bytes())
    assert _owner_and_mode(tls_root / "ca") == (0, 0o700) and _owner_and_mode(tls_root / "ca/ca.key") == (0, 0o400)
    keys = set()
    for name in TLS_SERVERS + TLS_CLIENTS:
        directory = tls_root / "tls" / name
        assert _owner_and_mode(directory) == (10001, 0o700)
        assert _owner_and_mode(directory / "tls.key") == (10001, 0o400)
        assert sorted(p.name for p in directory.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]  # no CA key
        assert (directory / "ca.crt").read_bytes() == (tls_root / "ca/ca.crt").read_bytes()
        cert = x509.load_pem_x509_certificate((directory / "tls.crt").read_bytes())
        cert.verify_directly_issued_by(ca)
        assert cert.public_key() == load_pem_private_key((directory / "tls.key").read_bytes(), None).public_key()
        usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        if name in TLS_SERVERS:
            sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            assert sans.get_values_for_type(x509.DNSName) == [name]  # the compose service name, nothing else
            assert usages == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
        else:
            assert usages == {ExtendedKeyUsageOID.CLIENT_AUTH}  # a client cannot pose as a server
        keys.add((directory / "tls.key").read_bytes())
    assert len(keys) == len(TLS_SERVERS + TLS_CLIENTS)


def test_a_second_run_keeps_valid_certificates_and_reissues_the_rest(tls_root):
    before = {p: p.read_bytes() for p in tls_root.rglob("*") if p.is_file()}
    init_tls(tls_root)
    assert {p: p.read_bytes() for p in tls_root.rglob("*") if p.is_file()} == before
    # Negative controls: a certificate from another CA, then a lost CA key, are replaced.
    (tls_root / "tls/dp1/tls.crt").write_bytes((tls_root / "tls/dp2/tls.crt").read_bytes())  # names dp2
    init_tls(tls_root)
    dp1 = x509.load_pem_x509_certificate((tls_root / "tls/dp1/tls.crt").read_bytes())
    assert dp1.subject.rfc4514_string() == "CN=dp1" and (tls_root / "tls/dp1/tls.crt").read_bytes() != before[
        tls_root / "tls/dp1/tls.crt"]
    (tls_root / "tls/engine1/tls.crt").write_bytes((tls_root / "tls/dp1/tls.crt").read_bytes())  # a server's
    init_tls(tls_root)
    engine1 = x509.load_pem_x509_certificate((tls_root / "tls/engine1/tls.crt").read_bytes())
    assert engine1.subject.rfc4514_string() == "CN=engine1"
    (tls_root / "ca/ca.key").unlink()
    init_tls(tls_root)
    ca = x509.load_pem_x509_certificate((tls_root / "ca/ca.crt").read_bytes())
    assert (tls_root / "ca/ca.crt").read_bytes() != before[tls_root / "ca/ca.crt"]
    for name in TLS_SERVERS + TLS_CLIENTS:
        x509.load_pem_x509_certificate((tls_root / "tls" / name / "tls.crt").read_bytes()).verify_directly_issued_by(ca)
        assert (tls_root / "tls" / name / "ca.crt").read_bytes() == (tls_root / "ca/ca.crt").read_bytes()


def _client(tls_root: Path, name: str, server_name: str, ca: Path | None = None) -> ClientTLS:
    directory = tls_root / "tls" / name
    return ClientTLS(str(ca or directory / "ca.crt"), str(directory / "tls.crt"), str(directory / "tls.key"),
                     server_name)


@pytest.mark.slow
async def test_the_real_planes_run_mutual_tls_on_these_certificates(tls_root, redis_server, key_prefix, admin_key,
                                                                    tmp_path_factory):
    """The control plane and a data plane on the issued certificates (dialled on loopback, their compose names
    checked): the admin's and an engine's client certificates work, the data plane registers over TLS; a
    plaintext client, a certificate from another CA and a client expecting another service's name are refused."""
    from control_plane.config import ControlPlaneConfig
    from control_plane.server import serve as serve_cp
    from data_plane.config import DataPlaneConfig
    from data_plane.server import serve as serve_dp

    def server_files(name: str) -> dict[str, str]:
        d = tls_root / "tls" / name
        return {"tls_cert_file": str(d / "tls.crt"), "tls_key_file": str(d / "tls.key"),
                "tls_client_ca_file": str(d / "ca.crt")}

    cp = await serve_cp(ControlPlaneConfig(listen="127.0.0.1:0", redis_url=redis_server.url, key_prefix=key_prefix,
                                           lease_ms=60_000, admin_key=admin_key, policy_ttl_s=0,
                                           **server_files("control-plane")))
    cp_address = f"127.0.0.1:{cp.port}"
    admin_tls = _client(tls_root, "admin", "control-plane")
    dp = None
    try:
        async with channel(cp_address, admin_key, admin_tls) as ch:  # positive control: the admin certificate
            node_key = (await ta_grpc.TenantAdminStub(ch).IssueKey(
                ta_pb.IssueKeyRequest(role=ta_pb.ROLE_NODE, node_id="dp1"), timeout=10)).secret
        shm = tmp_path_factory.mktemp("shm")
        shm.chmod(0o700)
        dp = await serve_dp(DataPlaneConfig(
            node_id="dp1", listen="127.0.0.1:0", shm_dir=shm, block_bytes=65536, capacity_bytes=8 * 65536,
            lock_memory=False, api_key=node_key, control_plane_address=cp_address,
            tls_ca_file=str(tls_root / "tls/dp1/ca.crt"), tls_server_name="control-plane", **server_files("dp1")))
        engine_tls = _client(tls_root, "engine1", "dp1")
        async with channel(dp.address, node_key, engine_tls) as ch:  # positive control: the engine certificate
            assert (await dp_grpc.DataPlaneStub(ch).DescribeTier(dp_pb.DescribeTierRequest(), timeout=10)).node_id \
                == "dp1"
        async with channel(cp_address, admin_key, admin_tls) as ch:  # dp1 registered over mutual TLS
            for _ in range(100):
                nodes = (await cp_grpc.ControlPlaneStub(ch).ListNodes(cp_pb.ListNodesRequest(), timeout=10)).nodes
                if any(n.node.node_id == "dp1" and n.live for n in nodes):
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("dp1 never registered over TLS")

        other = ec.generate_private_key(ec.SECP256R1())
        other_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "another CA")])
        foreign = tmp_path_factory.mktemp("foreign")
        write_pem(foreign, "ca", certificate("another CA", other_name, other, other, ca=True))
        leaf = ec.generate_private_key(ec.SECP256R1())
        foreign_cert, foreign_key = write_pem(foreign, "client", certificate("dp2", other_name, other, leaf), leaf)

        async def refused(address: str, key: str, tls: ClientTLS | None, call) -> None:
            async with channel(address, key, tls) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(ch)
            assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN), info.value

        async def list_tenants(ch):
            await ta_grpc.TenantAdminStub(ch).ListTenants(ta_pb.ListTenantsRequest(), timeout=10)

        async def describe(ch):
            await dp_grpc.DataPlaneStub(ch).DescribeTier(dp_pb.DescribeTierRequest(), timeout=10)

        # The admin CLI as keys-init and the admin service run it: TLS from $KVMESH_ADMIN_TLS_*.
        cli = [sys.executable, "-m", "kvmesh_apps.cli", "admin", "--control-plane", cp_address, "--key", admin_key,
               "tenants", "list"]
        env = {**os.environ, "KVMESH_ADMIN_TLS_CA_FILE": admin_tls.ca_file,
               "KVMESH_ADMIN_TLS_CERT_FILE": admin_tls.cert_file, "KVMESH_ADMIN_TLS_KEY_FILE": admin_tls.key_file,
               "KVMESH_ADMIN_TLS_SERVER_NAME": "control-plane"}
        listed = await asyncio.to_thread(subprocess.run, cli, env=env, capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0 and isinstance(json.loads(listed.stdout), dict), listed.stderr  # answered
        plain = await asyncio.to_thread(subprocess.run, cli, capture_output=True, text=True, timeout=60)
        assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr, plain.stderr  # plaintext: refused

        for address, key, good, call in ((cp_address, admin_key, admin_tls, list_tenants),
                                         (dp.address, node_key, engine_tls, describe)):
            await refused(address, key, None, call)  # plaintext, with a valid key
            await refused(address, key, ClientTLS(good.ca_file, foreign_cert, foreign_key, good.server_name), call)
            await refused(address, key, ClientTLS(good.ca_file, server_name=good.server_name), call)  # no cert
            await refused(address, key, ClientTLS(good.ca_file, good.cert_file, good.key_file, "dp2"), call)
    finally:
        if dp is not None:
            await dp.stop()
        await cp.stop()
