"""Secrets never reach a service's log or error output: a Redis URL with a password is logged redacted,
and an invalid configuration names the field and the reason, never the value."""

from __future__ import annotations

import subprocess
import sys
import uuid

import redis

from kvmesh.redis_client import redacted
from kvmesh_apps.procs import ServiceProcess


def test_a_redis_password_in_the_url_is_logged_redacted(redis_server, admin_key, tmp_path):
    user, password = f"u{uuid.uuid4().hex[:8]}", f"pw-{uuid.uuid4().hex}"
    admin = redis.Redis.from_url(redis_server.url)
    admin.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", "+@all")
    url = redis_server.url.replace("redis://", f"redis://{user}:{password}@")
    key_file = tmp_path / "admin.key"
    key_file.write_text(admin_key)
    log = tmp_path / "cp.log"
    proc = ServiceProcess(["control-plane", "--listen", "127.0.0.1:0", "--admin-key-file", str(key_file),
                           "--key-prefix", f"t{uuid.uuid4().hex[:8]}"],
                          env={"KVMESH_CP_REDIS_URL": url}, log_path=log)
    try:
        proc.start()
        clients = admin.execute_command("CLIENT", "LIST")
        assert f"user={user}".encode() in clients  # positive control: it did use the password-bearing URL
    finally:
        proc.stop()
        admin.execute_command("ACL", "DELUSER", user)
        admin.close()
    text = log.read_text()
    assert redacted(url) in text and password not in text


def test_an_invalid_configuration_never_echoes_values():
    secret = f"kvm_{uuid.uuid4().hex[:12]}_{uuid.uuid4().hex}"
    out = subprocess.run([sys.executable, "-m", "kvmesh_apps.cli", "control-plane", "--admin-key", secret,
                          "--lease-ms", secret], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "lease_ms" in out.stderr  # the error is reported ...
    assert secret not in out.stderr + out.stdout  # ... without the value
