"""`kvmesh up` as an attacker on the same machine sees it: no password-less Redis, no secret on a
command line, in a log, on stdout or in Redis, and the control plane's Redis users confined."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import redis.exceptions

from control_plane.config import ControlPlaneConfig
from tenancy import api_keys
from tenancy.redis_acl import tenant_password
from tests.deploy.up_fleet import stop_all_ups

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("up")
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh_apps.cli", "up", "--data-planes", "1", "--json",
                             "--workdir", str(workdir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        info = json.loads(line)
        yield proc, info, workdir, line
    finally:
        stop_all_ups([proc])


def _secrets(info, workdir: Path) -> dict[str, str]:
    out = {"admin key": Path(info["admin_key_file"]).read_text().strip()}
    for node, path in info["node_key_files"].items():
        out[f"node key {node}"] = Path(path).read_text().strip()
    for path in (workdir / "secrets").glob("redis-*.password"):
        out[path.name] = path.read_text().strip()
    return out


def _client(info, user="kvmesh-cp", password_file=None) -> redis.Redis:
    password = Path(password_file or info["redis_password_file"]).read_text().strip()
    return redis.Redis.from_url(info["redis"], username=user, password=password)


def test_redis_has_no_password_less_user(up):
    _, info, workdir, _ = up
    anonymous = redis.Redis.from_url(info["redis"])
    with pytest.raises((redis.exceptions.AuthenticationError, redis.exceptions.ResponseError)):
        anonymous.ping()  # the default user is off
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(info["redis"], username="default", password="").ping()
    assert _client(info).ping()  # positive control: the control plane's user, with its generated password


def test_secrets_never_on_a_command_line_in_a_log_or_on_stdout(up):
    proc, info, workdir, line = up
    secrets = _secrets(info, workdir)
    assert len(secrets) >= 4 and all(len(s) > 20 for s in secrets.values())
    command_lines = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True).stdout
    assert "--redis-password-file" in command_lines  # positive control: we do see the services' command lines
    environments = ""
    for pid_dir in Path("/proc").glob("[0-9]*"):
        try:
            if str(workdir) in (pid_dir / "cmdline").read_text(errors="replace"):
                environments += (pid_dir / "environ").read_text(errors="replace")
        except OSError:
            continue
    logs = {p: p.read_text(errors="replace") for p in workdir.rglob("*")
            if p.is_file() and "secrets" not in p.parts and p.name != "users.acl" and p.stat().st_size < 50 << 20}
    assert any(p.name == "control-plane.log" for p in logs)
    for name, secret in secrets.items():
        assert secret not in command_lines, f"{name} on a command line"
        assert secret not in environments, f"{name} in a process environment"
        assert secret not in line, f"{name} on stdout"
        for path, text in logs.items():
            assert secret not in text, f"{name} in {path}"
    acl_file = (workdir / "redis" / "users.acl").read_text()
    assert "#" in acl_file and not any(s in acl_file for s in secrets.values())  # hashes only
    assert all((workdir / "secrets" / p).stat().st_mode & 0o077 == 0 for p in (workdir / "secrets").iterdir())


def test_redis_holds_key_hashes_never_secrets(up):
    """API keys (admin, node), Redis passwords of the services and of the tenant: none in Redis."""
    _, info, workdir, _ = up
    secrets = _secrets(info, workdir)
    r = _client(info)
    tenant = {k.decode(): v.decode() for k, v in r.hgetall("kvm:{kvm-ten}:tenant:" + info["tenant"]).items()}
    admin_key = secrets["admin key"]
    secret = ControlPlaneConfig(admin_key=admin_key).tenant_secret()
    secrets["tenant redis password"] = tenant_password(secret, info["tenant"], tenant["epoch"], 0)
    # positive control: that derived password is the tenant user's real one
    assert redis.Redis.from_url(info["redis"], username=tenant["redis_user"],
                                password=secrets["tenant redis password"]).ping()
    values = []
    for key in r.scan_iter(count=1000):
        kind = r.type(key).decode()
        if kind == "string":
            values.append(r.get(key))
        elif kind == "hash":
            values += [b"%s=%s" % kv for kv in r.hgetall(key).items()]
        elif kind == "set":
            values += list(r.smembers(key))
        elif kind == "stream":
            values += [repr(e).encode() for e in r.xrange(key)]
        values.append(key)
    blob = b"\n".join(values)
    assert b"kvm:{kvm-ten}:key:" in blob or any(b":key:" in v for v in values)  # the key records are there
    for name, value in secrets.items():
        assert value.encode() not in blob, f"{name} stored in Redis"
        if name.startswith(("admin", "node")):
            assert api_keys.parse(value)[1].encode() not in blob, f"{name}'s secret part stored in Redis"


def test_redis_holds_no_private_key(up):
    _, info, _, _ = up
    r = _client(info)
    for key in r.scan_iter(count=1000):
        if r.type(key) == b"string":
            assert b"PRIVATE KEY" not in r.get(key), f"a private key stored in Redis under {key!r}"


def test_control_plane_redis_users_are_confined(up):
    _, info, workdir, _ = up
    cp = _client(info)
    with pytest.raises(redis.exceptions.NoPermissionError):
        cp.execute_command("ACL", "SETUSER", "intruder", "on", ">pw", "~*", "+@all")
    with pytest.raises(redis.exceptions.NoPermissionError):
        cp.flushall()
    with pytest.raises(redis.exceptions.NoPermissionError):
        cp.set("not-kvmesh:x", "1")
    acl = _client(info, "kvmesh-acl", workdir / "secrets" / "redis-kvmesh-acl.password")
    with pytest.raises(redis.exceptions.NoPermissionError):
        acl.get("kvm:{kvm-ten}:tenants")
    with pytest.raises(redis.exceptions.NoPermissionError):
        acl.execute_command("ACL", "LIST")
    assert cp.set("kvm:security-probe", "1")  # positive control: its own prefix is writable
    cp.delete("kvm:security-probe")
