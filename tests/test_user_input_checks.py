"""A user's mistake in a flag or setting ends the command in one line naming it (exit 2), never a hang, an
"internal error" or a run that silently does nothing; the valid input next to each mistake is still accepted.

- ``kvmesh vllm-events --zmq``: an endpoint zmq refuses, or one it would retry for ever; ``--kv-dtype``: a name
  no engine connector derives (control_plane/vllm_events.py).
- ``kvmesh control-plane --redis-url``: a URL that names no node, a port or database that is not a number, a
  cluster URL at a single server, a database the server lacks (kvmesh/redis_client.py, kvmesh/command_line.py).
- ``kvmesh bench faults --cases``: a misspelled case, before any set-up (kvmesh_apps/bench/faults.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import redis.exceptions

from kvmesh.command_line import RUNTIME, describe, run_command
from kvmesh.errors import InvalidArgument
from kvmesh.redis_client import connect
from kvmesh_apps.redis_server import free_port

KVMESH = shutil.which("kvmesh", path=str(Path(sys.executable).parent)) or shutil.which("kvmesh")
pytestmark = pytest.mark.skipif(KVMESH is None, reason="the kvmesh command is not installed")


def kvmesh(*args: str, env: dict | None = None) -> tuple[int, list[str]]:
    """Runs ``kvmesh ARGS``; its exit status and its stderr lines."""
    out = subprocess.run([KVMESH, *args], capture_output=True, text=True, timeout=30,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}, **(env or {})})
    return out.returncode, out.stderr.splitlines()


def one_line(rc: int, lines: list[str], cmd: str, status: int, *says: str) -> str:
    assert rc == status and len(lines) == 1, (rc, lines)
    line = lines[0]
    assert line.startswith(f"kvmesh {cmd}: error: ") and "Traceback" not in line, line
    assert "internal error" not in line, line
    for text in says:
        assert text in line, (text, line)
    return line


# ---- kvmesh vllm-events --zmq / --kv-dtype ----

def vllm_events(tmp_path: Path, zmq: str = "tcp://127.0.0.1:5557", kv_dtype: str = "bfloat16",
                key_file: str | None = None) -> tuple[int, list[str]]:
    """The command against a control plane nothing serves: valid flags get as far as reading the key file."""
    return kvmesh("vllm-events", "--zmq", zmq, "--control-plane", "127.0.0.1:1", "--api-key-file",
                  key_file or str(tmp_path / "missing.key"), "--node-id", "n1", "--data-plane-address",
                  "127.0.0.1:7001", "--model", "m", "--block-size", "32", "--kv-dtype", kv_dtype)


@pytest.mark.parametrize("endpoint, says", [
    ("notazmq", "Invalid argument"),                 # zmq refuses it (it was refused in a task nobody awaited)
    ("tcp://127.0.0.1", "needs a host and a port"),  # zmq takes these, and would retry them for ever
    ("tcp://127.0.0.1:99999", "needs a host and a port"),
    ("tcp://*:5557", "the address vLLM binds"),
    ("inproc://events", "only inside one process"),
])
def test_a_bad_zmq_endpoint_is_one_line(tmp_path, endpoint, says):
    key = tmp_path / "node.key"
    key.write_text("kvm_0123456789abcdef_" + "x" * 43)  # readable: the endpoint is what stops it
    started = time.monotonic()
    rc, lines = vllm_events(tmp_path, zmq=endpoint, key_file=str(key))
    one_line(rc, lines, "vllm-events", 2, f"--zmq {endpoint!r}", says)
    assert time.monotonic() - started < 20  # not the control plane's 10 s wait: nothing was started


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5557", "tcp://localhost:5557", "tcp://[::1]:5557",
                                      "ipc:///tmp/kvmesh-test-kv-events"])
def test_a_valid_zmq_endpoint_is_accepted(tmp_path, endpoint):
    """Positive control: the command gets past --zmq to the next check (the key file)."""
    rc, lines = vllm_events(tmp_path, zmq=endpoint)
    one_line(rc, lines, "vllm-events", 2, "cannot read --api-key-file")


@pytest.mark.parametrize("dtype, says", [("bogus", "unknown KV dtype 'bogus'"), ("bf16", "unknown KV dtype 'bf16'"),
                                         ("auto", "auto is not a KV dtype")])
def test_a_kv_dtype_no_engine_has_is_one_line(tmp_path, dtype, says):
    rc, lines = vllm_events(tmp_path, kv_dtype=dtype)
    one_line(rc, lines, "vllm-events", 2, "argument --kv-dtype", says)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "fp8_e4m3", "torch.bfloat16", "half"])
def test_the_kv_dtypes_the_connector_derives_are_accepted(tmp_path, dtype):
    rc, lines = vllm_events(tmp_path, kv_dtype=dtype)
    one_line(rc, lines, "vllm-events", 2, "cannot read --api-key-file")


def test_kv_dtype_names_it_as_the_connector_does():
    from control_plane.vllm_events import kv_dtype

    # the connector: str(model_config.dtype) without "torch."; vllm serve --dtype half / float are these dtypes
    assert [kv_dtype(d) for d in ("bfloat16", "torch.float16", "half", "float", "fp8")] == \
        ["bfloat16", "float16", "float16", "float32", "fp8"]


# ---- kvmesh control-plane --redis-url ----

def control_plane(url: str) -> tuple[int, list[str]]:
    from tenancy.api_keys import new_key

    return kvmesh("control-plane", "--listen", "127.0.0.1:0", "--redis-url", url,
                  env={"KVMESH_CP_ADMIN_KEY": new_key()[1]})


@pytest.mark.parametrize("url, says", [
    ("redis+cluster://", "names no node"),
    ("redis+cluster://127.0.0.1:7000,", "every node must be host:port"),
    ("redis://127.0.0.1:notaport/0", "port 'notaport' is not a number"),
    ("redis://127.0.0.1:6379/abc", "the database 'abc' is not a number"),
    ("redis+cluster://127.0.0.1:7000/3", "a Redis Cluster has only database 0"),
    ("unix://", "no socket path"),
])
def test_a_malformed_redis_url_is_one_line_naming_the_setting(url, says):
    rc, lines = control_plane(url)
    one_line(rc, lines, "control-plane", 2, "redis_url (--redis-url / KVMESH_CP_REDIS_URL)", says)


def test_a_malformed_redis_url_never_shows_its_password():
    rc, lines = control_plane("redis://user:s3cret@127.0.0.1:notaport/0")
    line = one_line(rc, lines, "control-plane", 2, "redis_url", "user:***@")
    assert "s3cret" not in line


def test_a_cluster_url_at_a_single_server_is_one_line(redis_server):
    rc, lines = control_plane(f"redis+cluster://127.0.0.1:{redis_server.port}")
    one_line(rc, lines, "control-plane", 2, "not a Redis Cluster", "--redis-url", "redis://host:port/0")


def test_a_database_the_server_lacks_is_one_line(redis_server):
    rc, lines = control_plane(f"redis://127.0.0.1:{redis_server.port}/99")
    one_line(rc, lines, "control-plane", 2, "no such database", "--redis-url", "/0")


def test_an_unreachable_cluster_is_a_runtime_failure_naming_the_setting():
    rc, lines = control_plane(f"redis+cluster://127.0.0.1:{free_port()}")
    one_line(rc, lines, "control-plane", RUNTIME, "no Redis Cluster node answered", "--redis-url")


async def test_valid_redis_urls_are_accepted(redis_server):
    """Positive control: the URLs the checks above sit next to still connect (or, for a cluster, are taken)."""
    for url in (f"redis://127.0.0.1:{redis_server.port}/0", f"redis://127.0.0.1:{redis_server.port}",
                f"redis://127.0.0.1:{redis_server.port}/1", f"redis://127.0.0.1:{redis_server.port}/?db=0"):
        client = connect(url)
        try:
            assert await client.ping()
        finally:
            await client.aclose()
    for url in ("redis+cluster://127.0.0.1:7000", "redis+cluster://127.0.0.1:7000,127.0.0.1:7001/0",
                "rediss+cluster://u:p@[::1]:7000,127.0.0.1:7001", "unix:///tmp/redis.sock?db=0"):
        await connect(url).aclose()  # clients connect lazily: taken, not used


def test_connect_raises_invalid_argument_naming_the_setting():
    with pytest.raises(InvalidArgument, match=r"^redis_url \(--redis-url / KVMESH_CP_REDIS_URL\) "):
        connect("redis+cluster://")


def test_other_redis_errors_are_still_reported_as_bugs():
    """Negative control of the mapping: only the URL's mistakes are the user's."""
    for exc in (redis.exceptions.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
                redis.exceptions.RedisClusterException("GET - all keys must map to the same key slot")):
        line, status = describe(exc)
        assert line.startswith("internal error") and status == RUNTIME, line


# ---- kvmesh bench faults --cases ----

class SetUpStarted(Exception):
    pass


@pytest.fixture
def faults(monkeypatch):
    """kvmesh_apps.bench.faults with its set-up (the work directory, then the Matrix) replaced by a tripwire, and
    the root check passed: whatever reaches the set-up raises SetUpStarted."""
    from kvmesh_apps.bench import faults

    def tripwire(*_args, **_kwargs):
        raise SetUpStarted

    monkeypatch.setattr(faults, "tempfile", types.SimpleNamespace(mkdtemp=tripwire))
    monkeypatch.setattr(faults, "Matrix", tripwire)
    monkeypatch.setattr(faults.os, "geteuid", lambda: 0)
    return faults


@pytest.mark.parametrize("argv, says", [
    (["--cases", "baselin"], "unknown 'baselin' (known: baseline, "),
    (["--cases", "baseline,node_restrat"], "unknown 'node_restrat'"),
    (["--cases", ","], "names none"),
    (["--cases", "redis_failover", "--single-redis"], "--cases redis_failover needs the Redis Cluster"),
])
def test_a_misspelled_fault_case_is_one_line_before_any_set_up(faults, capsys, argv, says):
    started = time.monotonic()
    rc = run_command("kvmesh bench faults", faults.main, argv)  # SetUpStarted would be rc 1, "internal error"
    err = capsys.readouterr().err.splitlines()
    one_line(rc, err, "bench faults", 2, says)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("argv", [[], ["--cases", "baseline"], ["--cases", "baseline,node_restart,redis_failover"],
                                  ["--cases", "node_restart", "--single-redis"]])
def test_valid_fault_cases_reach_the_set_up(faults, argv):
    """Positive control: the same checks let valid cases through to the set-up."""
    with pytest.raises(SetUpStarted):
        faults.main(argv)
