"""docker/init_secrets.py (the compose `secrets-init` step): fresh secrets, owned by their consumer alone, kept on a
second run; the ACL file it renders works in a real redis-server: each user with its generated password only."""

from __future__ import annotations

import hashlib
import os
import runpy
import shutil
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest
import redis
from cryptography.hazmat.primitives.serialization import load_pem_private_key

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
    if not shutil.which("redis-server"):
        pytest.skip("no redis-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
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
