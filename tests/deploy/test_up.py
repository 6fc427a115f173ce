"""`kvmesh up`: starts the local topology, every service answers gRPC health, Ctrl-C stops it all; slot sizes
from --model or --block-bytes, bad input refused with one line and exit status 2. As a local service: stopped
each way (SIGINT, SIGTERM, SIGHUP, SIGKILL, Ctrl-C during start) it leaves no process and no /dev/shm directory
and starts again in the same work directory with its tenants and keys; a second `up` on a work directory in use
is refused in one line and touches nothing; SIGTERM stops everything within 2 s; without --workdir the state
goes to the per-user state directory, nothing to /tmp."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from data_plane.client import DataPlaneClient
from kvmesh.channels import channel
from kvmesh.v1 import common_pb2, control_plane_pb2 as cp_pb, control_plane_pb2_grpc as cp_grpc
from kvmesh.v1 import tenant_admin_pb2 as ta_pb, tenant_admin_pb2_grpc as ta_grpc
from kvmesh_apps import up
from kvmesh_apps.redis_server import write_secret
from tenancy import api_keys


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_up_starts_serves_and_stops(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh_apps.cli", "up", "--data-planes", "1", "--json",
                             "--workdir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        info = json.loads(line)
        assert serving(info["control_plane"])
        for address in info["data_planes"].values():
            assert serving(address)
        assert Path(info["admin_key_file"]).read_text().startswith("kvm_")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        assert list((tmp_path / "redis").glob("appendonly*"))  # Redis ran with AOF in the workdir
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- a well-behaved local service: every way of stopping, restart, lock, no orphans ----

UP = [sys.executable, "-m", "kvmesh_apps.cli", "up", "--data-planes", "1", "--json"]


def _start(workdir: Path, env: dict | None = None, args: tuple[str, ...] = ()) -> tuple[subprocess.Popen, dict]:
    cmd = [*UP, *args] + (["--workdir", str(workdir)] if workdir else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(f"kvmesh up did not start: {proc.stderr.read()}")
    return proc, json.loads(line)


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out.update(int(p) for p in (task / "children").read_text().split())
    return out


def _alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (a zombie has ended: only its exit status is left)."""
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def _wait_gone(pids: set[int], timeout: float) -> float:
    start = time.monotonic()
    while _alive(pids) and time.monotonic() - start < timeout:
        time.sleep(0.02)
    assert not _alive(pids), f"still running {timeout}s later: " + ", ".join(
        Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")[:100] for p in _alive(pids))
    return time.monotonic() - start


def _admin(info: dict):
    return channel(info["control_plane"], Path(info["admin_key_file"]).read_text().strip())


async def _create_tenant_and_key(info: dict) -> str:
    async with _admin(info) as ch:
        admin = ta_grpc.TenantAdminStub(ch)
        await admin.CreateTenant(ta_pb.CreateTenantRequest(tenant_id="kept"))
        reply = await admin.IssueKey(ta_pb.IssueKeyRequest(role=ta_pb.ROLE_SCHEDULER, tenant_id="kept"))
        return reply.secret


async def _tenant_works(info: dict, scheduler_key: str) -> None:
    """The tenant created before the restart, its scheduler key and its Redis user (a lookup reads the block map
    through it) all work."""
    async with _admin(info) as ch:
        assert (await ta_grpc.TenantAdminStub(ch).GetTenant(ta_pb.GetTenantRequest(tenant_id="kept"))).redis_user
    ns = common_pb2.Namespace(tenant="kept", model="m", cache_config=common_pb2.CacheConfig(block_size=32))
    async with channel(info["control_plane"], scheduler_key) as ch:
        reply = await cp_grpc.ControlPlaneStub(ch).LookupPrefix(cp_pb.LookupPrefixRequest(namespace=ns,
                                                                                          token_ids=list(range(64))))
        assert reply is not None


def test_restarts_in_its_workdir_after_every_way_of_stopping(tmp_path) -> None:
    """SIGINT, SIGTERM, SIGHUP, SIGKILL in turn on one work directory: each time every child ends (by pid), the
    /dev/shm directory is gone, and the next start serves the tenant and scheduler key made on the first."""
    proc, info = _start(tmp_path)
    scheduler_key = asyncio.run(_create_tenant_and_key(info))
    node_key = Path(info["node_key_files"]["dp1"]).read_text()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL):
        children = _children(proc.pid)
        assert len(children) == 4  # the reaper, Redis, the control plane, the data plane
        assert Path(info["shm_dir"]).is_dir()  # positive control for the check below
        proc.send_signal(sig)
        assert proc.wait(10) == (-signal.SIGKILL if sig == signal.SIGKILL else 0)
        _wait_gone(children, 10)
        assert not Path(info["shm_dir"]).exists(), sig
        proc, info = _start(tmp_path)
        assert serving(info["control_plane"]) and serving(info["data_planes"]["dp1"])
        asyncio.run(_tenant_works(info, scheduler_key))
        assert Path(info["node_key_files"]["dp1"]).read_text() == node_key  # still valid: kept
    children = _children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    _wait_gone(children, 10)


def test_sigterm_stops_everything_within_2s(tmp_path) -> None:
    proc, info = _start(tmp_path, args=("--data-planes", "2"))
    children = _children(proc.pid)
    assert len(children) == 5
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(10)
    _wait_gone(children, 10)
    elapsed = time.monotonic() - start
    assert elapsed < 2.0, f"stopping took {elapsed:.2f}s"


def test_a_second_up_on_a_workdir_in_use_is_refused_in_one_line(tmp_path) -> None:
    proc, info = _start(tmp_path)
    try:
        secrets = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (tmp_path / "secrets").iterdir()}
        acl = tmp_path / "redis" / "users.acl"
        acl_before = (acl.read_bytes(), acl.stat().st_mtime_ns)
        second = subprocess.run([*UP, "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=60)
        lines = second.stderr.strip().splitlines()
        assert second.returncode != 0 and len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
        assert "in use by another kvmesh up" in lines[0] and str(tmp_path) in lines[0], lines[0]
        assert second.stdout == ""
        # nothing of the running fleet touched: secrets, ACL file, its processes; and it still answers
        assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (tmp_path / "secrets").iterdir()} == secrets
        assert (acl.read_bytes(), acl.stat().st_mtime_ns) == acl_before
        assert len(_children(proc.pid)) == 4
        assert serving(info["control_plane"]) and serving(info["data_planes"]["dp1"])
        async def list_tenants():
            async with _admin(info) as ch:
                return await ta_grpc.TenantAdminStub(ch).ListTenants(ta_pb.ListTenantsRequest())
        assert "demo" in {t.tenant_id for t in asyncio.run(list_tenants()).tenants}
        # positive control: once it has stopped, the same command starts
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        proc, info = _start(tmp_path)
        assert serving(info["control_plane"])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)


def test_ctrl_c_during_start_prints_one_line_and_leaves_nothing(tmp_path) -> None:
    proc = subprocess.Popen([*UP, "--workdir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    seen: dict[int, str] = {}
    deadline = time.monotonic() + 60
    while not (tmp_path / "control-plane.log").exists() and time.monotonic() < deadline:  # mid-start
        for pid in _children(proc.pid):  # read again until exec has replaced the command line forked with
            seen[pid] = Path(f"/proc/{pid}/cmdline").read_text()
        time.sleep(0.01)
    reaper = [cmd for cmd in seen.values() if "kvmesh_apps.reaper" in cmd]
    assert len(seen) >= 2 and reaper  # positive control: it had started something (the reaper, Redis, ...)
    shm_dir = Path(reaper[0].split("\0")[-2])
    assert shm_dir.is_dir()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and out == "", (out, err)
    assert err.strip() == "kvmesh up: SIGINT during start: stopped what had started; nothing is left running"
    _wait_gone(set(seen), 10)
    assert not shm_dir.exists()
    proc, info = _start(tmp_path)  # and it starts afterwards
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0


def test_without_workdir_the_state_lives_in_the_user_state_dir_not_in_tmp(tmp_path) -> None:
    state, tmp = tmp_path / "state", tmp_path / "tmp"
    tmp.mkdir()
    proc, info = _start(None, env={"XDG_STATE_HOME": str(state), "TMPDIR": str(tmp)})
    assert Path(info["workdir"]) == state / "kvmesh" / "up"
    assert (state / "kvmesh" / "up" / "secrets" / "admin.key").exists()
    assert oct((state / "kvmesh" / "up").stat().st_mode & 0o777) == "0o700"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    assert list(tmp.iterdir()) == []  # no secret, nothing at all, left in the temp dir


def test_another_admin_key_on_a_restart_is_refused_in_one_line(tmp_path) -> None:
    """Tenant Redis passwords derive from the admin key a work directory was first started with."""
    first = api_keys.new_key()[1]
    write_secret(tmp_path / "secrets" / "admin.key", first)
    other = subprocess.run([*UP, "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "KVMESH_ADMIN_KEY": api_keys.new_key()[1]})
    assert other.returncode == 2 and other.stderr.count("\n") == 1 and "KVMESH_ADMIN_KEY differs" in other.stderr
    assert (tmp_path / "secrets" / "admin.key").read_text() == first and not (tmp_path / "redis").exists()


# ---- slot size: derived from --model, explicit, or refused before anything starts ----

SHAPE = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 1, "num_hidden_layers": 3, "intermediate_size": 256, "vocab_size": 512,
         "torch_dtype": "float32"}


def _model(tmp_path: Path, config: dict | str = SHAPE, name: str = "model") -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return path


def _refused(argv: list[str], capsys) -> str:
    code = up.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvmesh up: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("argv, message", [
    (["--model", "{tmp}/missing"], "is not a directory"),
    (["--model", "{tmp}/no-config"], "cannot read"),
    (["--model", "{tmp}/broken"], "not valid JSON"),
    (["--model", "{tmp}/bad-head"], "head size 48"),
    (["--model", "{tmp}/model", "--block-tokens", "48"], "positive multiple of 32"),
    (["--block-tokens", "0"], "positive multiple of 32"),
    (["--block-bytes", "0"], "--block-bytes must be a positive"),
    (["--block-bytes", "-5"], "--block-bytes must be a positive"),
    (["--model", "{tmp}/model", "--block-bytes", "4096"], "contradicts --model: its 32-token blocks are 12288"),
    (["--dtype", "float32"], "give --model too"),
    (["--model", "{tmp}/model", "--dtype", "int8"], "dtype 'int8'"),
    (["--model", "{tmp}/model", "--kv-cache-dtype", "int8"], "kv cache dtype 'int8'"),
    (["--model", "{tmp}/model", "--capacity", "8KiB"], "holds no 12288-byte block"),
    (["--capacity", "lots"], "is not a size"),
    (["--data-planes", "-1"], "--data-planes must be 0 or more"),
    (["--block-tokens", "abc"], "--block-tokens: invalid int value"),
    (["--no-such-flag"], "unrecognized arguments"),
])
def test_bad_input_exits_2_with_one_line_before_starting_anything(tmp_path, capsys, argv, message) -> None:
    _model(tmp_path)
    (tmp_path / "no-config").mkdir()
    _model(tmp_path, "{oops", "broken")
    _model(tmp_path, {**SHAPE, "hidden_size": 192}, "bad-head")
    line = _refused([a.format(tmp=tmp_path) for a in argv] + ["--workdir", str(tmp_path / "work")], capsys)
    assert message in line, line
    assert not (tmp_path / "work").exists()  # nothing was started


def test_model_sizes_the_slots_and_the_engine_hint(tmp_path) -> None:
    """--model: 3 layers x 1 KV head x 32 x 2 bytes (float32 served as bfloat16 on CPU) x 2 x 64 tokens = 24,576."""
    model = _model(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh_apps.cli", "up", "--data-planes", "1", "--json",
                             "--model", str(model), "--block-tokens", "64", "--capacity", "1MiB",
                             "--workdir", str(tmp_path / "work")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        info = json.loads(proc.stdout.readline())
        assert (info["block_bytes"], info["block_tokens"], info["capacity_bytes"]) == (24576, 64, 1 << 20)
        assert (info["model"], info["dtype"], info["kv_cache_dtype"]) == (str(model), "bfloat16", "auto")
        (node, address), = info["data_planes"].items()

        async def describe():
            key = Path(info["node_key_files"][node]).read_text().strip()
            async with DataPlaneClient(address, key=key) as client:
                return await client.describe_tier()

        tier = asyncio.run(describe())
        assert (tier.block_bytes, tier.block_tokens, tier.num_slots) == (24576, 64, (1 << 20) // 24576)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_printed_engine_line_names_the_model_dtype_and_block_size(tmp_path) -> None:
    """The ``vllm serve`` line of the human output (formatted without starting a fleet)."""
    model = _model(tmp_path)
    args = up._parser().parse_args(["--model", str(model), "--block-tokens", "64"])
    slots = up.resolve_slots(args)
    hint = up.ENGINE_HINT.format(model=slots.model, dtype=slots.engine_flags(), block_tokens=slots.block_tokens,
                                 address="127.0.0.1:1", key_file="k", cp="127.0.0.1:2", tenant="t")
    assert hint.startswith(f"vllm serve {model} --dtype bfloat16 --block-size 64 --kv-transfer-config ")
    kv = up._parser().parse_args(["--model", str(model), "--dtype", "float32", "--kv-cache-dtype", "fp8"])
    assert up.resolve_slots(kv).engine_flags() == " --dtype float32 --kv-cache-dtype fp8"
    assert up.resolve_slots(kv).block_bytes == 2 * 3 * 32 * 1 * 32  # one byte per element
    plain = up.resolve_slots(up._parser().parse_args(["--block-bytes", "4096", "--block-tokens", "96"]))
    assert (plain.block_bytes, plain.block_tokens, plain.engine_flags()) == (4096, 96, "")
