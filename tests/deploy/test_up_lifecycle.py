"""`kvmesh up` as a well-behaved local service: stopped each way (SIGINT, SIGTERM, SIGHUP, SIGKILL, Ctrl-C during
start) it leaves no process (checked by pid) and no /dev/shm directory, and starts again in the same work directory
with its tenants and keys; a second `up` on a work directory in use is refused in one line and touches nothing;
SIGTERM stops everything within 2 s; another admin key on a restart is refused; without --workdir the state goes
to the per-user state directory, nothing to /tmp."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest

from kvmesh.channels import channel
from kvmesh.v1 import common_pb2, control_plane_pb2 as cp_pb, control_plane_pb2_grpc as cp_grpc
from kvmesh.v1 import tenant_admin_pb2 as ta_pb, tenant_admin_pb2_grpc as ta_grpc
from kvmesh_apps.redis_server import write_secret
from kvmesh_apps.up import RESTARTS_ALLOWED
from tenancy import api_keys
from tests.deploy.up_fleet import UP, admin_channel, alive, children, client_tls, healthy, start_up, stop_all_ups, wait_gone

ONE = ("--data-planes", "1")


@pytest.fixture
def ups():
    """Every `kvmesh up` a test starts, stopped at the end whatever the test's outcome."""
    started: list[subprocess.Popen] = []
    yield started
    stop_all_ups(started)


def _run_up(ups: list, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """A `kvmesh up` expected to end by itself, run to its end (stopped by the ``ups`` fixture if it does not)."""
    proc = subprocess.Popen([*UP, *ONE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    ups.append(proc)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _all_healthy(info: dict) -> bool:
    addresses = [info["control_plane"], *info["data_planes"].values()]
    return all(asyncio.run(healthy(info, address)) for address in addresses)


async def _create_tenant_and_key(info: dict) -> str:
    async with admin_channel(info) as ch:
        admin = ta_grpc.TenantAdminStub(ch)
        await admin.CreateTenant(ta_pb.CreateTenantRequest(tenant_id="kept"))
        reply = await admin.IssueKey(ta_pb.IssueKeyRequest(role=ta_pb.ROLE_SCHEDULER, tenant_id="kept"))
        return reply.secret


async def _tenant_works(info: dict, scheduler_key: str) -> None:
    """The tenant created before the restart, its scheduler key and its Redis user (a lookup reads the block map
    through it) all work."""
    async with admin_channel(info) as ch:
        assert (await ta_grpc.TenantAdminStub(ch).GetTenant(ta_pb.GetTenantRequest(tenant_id="kept"))).redis_user
    ns = common_pb2.Namespace(tenant="kept", model="m", cache_config=common_pb2.CacheConfig(block_size=32))
    async with channel(info["control_plane"], scheduler_key, client_tls(info)) as ch:
        reply = await cp_grpc.ControlPlaneStub(ch).LookupPrefix(cp_pb.LookupPrefixRequest(namespace=ns,
                                                                                          token_ids=list(range(64))))
        assert reply is not None


def test_restarts_in_its_workdir_after_every_way_of_stopping(tmp_path, ups) -> None:
    """SIGINT, SIGTERM, SIGHUP, SIGKILL in turn on one work directory: each time every child ends (by pid), the
    /dev/shm directory is gone, and the next start serves the tenant and scheduler key made on the first, with the
    same TLS CA, certificates and keys."""
    proc, info = start_up(tmp_path, *ONE, started=ups)
    scheduler_key = asyncio.run(_create_tenant_and_key(info))
    node_key = Path(info["node_key_files"]["dp1"]).read_text()
    tls_files = {p.name: p.read_bytes() for p in Path(info["tls"]["ca_file"]).parent.iterdir()}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL):
        kids = children(proc.pid)
        assert len(kids) == 4  # the reaper, Redis, the control plane, the data plane
        assert Path(info["shm_dir"]).is_dir()  # positive control for the check below
        proc.send_signal(sig)
        assert proc.wait(10) == (-signal.SIGKILL if sig == signal.SIGKILL else 0)
        wait_gone(kids, 10)
        assert not Path(info["shm_dir"]).exists(), sig
        proc, info = start_up(tmp_path, *ONE, started=ups)
        assert _all_healthy(info) and set(info["metrics"]) == {"control_plane", "dp1"}
        asyncio.run(_tenant_works(info, scheduler_key))
        assert Path(info["node_key_files"]["dp1"]).read_text() == node_key  # still valid: kept
        assert {p.name: p.read_bytes() for p in Path(info["tls"]["ca_file"]).parent.iterdir()} == tls_files  # kept
    kids = children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    wait_gone(kids, 10)


def test_sigterm_stops_everything_within_2s(tmp_path, ups) -> None:
    proc, info = start_up(tmp_path, "--data-planes", "2", started=ups)
    kids = children(proc.pid)
    assert len(kids) == 5
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(10)
    wait_gone(kids, 10)
    elapsed = time.monotonic() - start
    assert elapsed < 2.0, f"stopping took {elapsed:.2f}s"


def test_a_second_up_on_a_workdir_in_use_is_refused_in_one_line(tmp_path, ups) -> None:
    proc, info = start_up(tmp_path, *ONE, started=ups)
    try:
        secrets = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (tmp_path / "secrets").iterdir()}
        acl = tmp_path / "redis" / "users.acl"
        acl_before = (acl.read_bytes(), acl.stat().st_mtime_ns)
        second = _run_up(ups, "--workdir", str(tmp_path))
        lines = second.stderr.strip().splitlines()
        assert second.returncode != 0 and len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
        assert "in use by another kvmesh up" in lines[0] and str(tmp_path) in lines[0], lines[0]
        assert second.stdout == ""
        # nothing of the running fleet touched: secrets, ACL file, its processes; and it still answers
        assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (tmp_path / "secrets").iterdir()} == secrets
        assert (acl.read_bytes(), acl.stat().st_mtime_ns) == acl_before
        assert len(children(proc.pid)) == 4
        assert _all_healthy(info)

        async def list_tenants():
            async with admin_channel(info) as ch:
                return await ta_grpc.TenantAdminStub(ch).ListTenants(ta_pb.ListTenantsRequest())
        assert "demo" in {t.tenant_id for t in asyncio.run(list_tenants()).tenants}
        # positive control: once it has stopped, the same command starts
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        proc, info = start_up(tmp_path, *ONE, started=ups)
        assert asyncio.run(healthy(info, info["control_plane"]))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)


def test_ctrl_c_during_start_prints_one_line_and_leaves_nothing(tmp_path, ups) -> None:
    proc = subprocess.Popen([*UP, *ONE, "--workdir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    ups.append(proc)
    seen: dict[int, str] = {}
    deadline = time.monotonic() + 60
    while not (tmp_path / "control-plane.log").exists() and time.monotonic() < deadline:  # mid-start
        for pid in children(proc.pid):  # read again until exec has replaced the command line forked with
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
    wait_gone(set(seen), 10)
    assert not shm_dir.exists()
    proc, info = start_up(tmp_path, *ONE, started=ups)  # and it starts afterwards
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0


def test_without_workdir_the_state_lives_in_the_user_state_dir_not_in_tmp(tmp_path, ups) -> None:
    state, tmp = tmp_path / "state", tmp_path / "tmp"
    tmp.mkdir()
    proc, info = start_up(None, *ONE, env={"XDG_STATE_HOME": str(state), "TMPDIR": str(tmp)}, started=ups)
    assert Path(info["workdir"]) == state / "kvmesh" / "up"
    assert (state / "kvmesh" / "up" / "secrets" / "admin.key").exists()
    assert oct((state / "kvmesh" / "up").stat().st_mode & 0o777) == "0o700"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    assert list(tmp.iterdir()) == []  # no secret, nothing at all, left in the temp dir


def test_another_admin_key_on_a_restart_is_refused_in_one_line(tmp_path, ups) -> None:
    """Tenant Redis passwords derive from the admin key a work directory was first started with."""
    first = api_keys.new_key()[1]
    write_secret(tmp_path / "secrets" / "admin.key", first)
    other = _run_up(ups, "--workdir", str(tmp_path), env={**os.environ, "KVMESH_ADMIN_KEY": api_keys.new_key()[1]})
    assert other.returncode == 1 and other.stderr.count("\n") == 1 and "KVMESH_ADMIN_KEY differs" in other.stderr
    assert (tmp_path / "secrets" / "admin.key").read_text() == first and not (tmp_path / "redis").exists()


def test_a_workdir_others_may_write_to_is_refused_in_one_line(tmp_path, ups) -> None:
    """Found in review: `kvmesh up --workdir D` took D as it found it, so whoever could write to D (another user's
    /tmp/kvm made in advance) planted `secrets/admin.key`, and the fleet started with an admin key of their choosing.
    A work directory, and its secrets, must now be the user's own and writable by nobody else. (Every other test
    here starts in a directory of its own, mode 0700: the control.)"""
    shared = tmp_path / "shared"
    (shared / "secrets").mkdir(parents=True, mode=0o700)
    write_secret(shared / "secrets" / "admin.key", api_keys.new_key()[1])
    for loose in (shared, shared / "secrets"):
        loose.chmod(0o777)
        refused = _run_up(ups, "--workdir", str(shared))
        assert refused.returncode != 0 and refused.stderr.count("\n") == 1, refused.stderr
        assert "Traceback" not in refused.stderr and f"{loose} is not a directory of this user's" in refused.stderr
        assert not (shared / "redis").exists() and not (shared / "up.lock").exists()
        loose.chmod(0o700)


def _pid_of(up_pid: int, victim: str) -> int:
    # each service's subcommand and first flag (data planes name the control plane too: --tls-server-name)
    marks = {"data plane dp1": " data-plane --node-id dp1 ", "control plane": " control-plane --listen ",
             "redis": "-server "}
    return next(p for p in alive(children(up_pid))
                if marks[victim] in Path(f"/proc/{p}/cmdline").read_text().replace("\0", " "))


def _stderr_line(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    line = [""]
    reader = threading.Thread(target=lambda: line.__setitem__(0, proc.stderr.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert line[0], f"no line on up's stderr within {timeout}s"
    return line[0].strip()


@pytest.mark.parametrize("victim", ["data plane dp1", "control plane", "redis"])
def test_a_service_that_dies_is_started_again_in_place_with_one_line_naming_it(tmp_path, ups, victim) -> None:
    """As compose's restart: unless-stopped: the killed service comes back at the same address (clients keep
    theirs), with its data and keys (the tenant and scheduler key created before work after), and up says so in
    one line naming it, how it ended and its log."""
    proc, info = start_up(tmp_path, "--data-planes", "1", started=ups)
    scheduler_key = asyncio.run(_create_tenant_and_key(info))
    os.kill(_pid_of(proc.pid, victim), signal.SIGKILL)
    line = _stderr_line(proc)
    assert line.startswith(f"kvmesh up: {victim} stopped (killed by SIGKILL); its log: "), line
    assert line.endswith("; started it again at " + {"data plane dp1": info["data_planes"]["dp1"],
                                                     "control plane": info["control_plane"],
                                                     "redis": info["redis"]}[victim]), line
    deadline = time.monotonic() + 30
    while not _all_healthy(info):
        assert time.monotonic() < deadline, "the fleet is not healthy again at its addresses"
        time.sleep(0.5)
    deadline = time.monotonic() + 30
    while True:  # a control plane reconnects to a restarted Redis within its own bound
        try:
            asyncio.run(_tenant_works(info, scheduler_key))
            break
        except grpc.RpcError:
            assert time.monotonic() < deadline, "the tenant does not work again"
            time.sleep(0.5)
    assert proc.poll() is None


def test_a_service_in_a_crash_loop_stops_the_fleet_with_one_line(tmp_path, ups) -> None:
    proc, info = start_up(tmp_path, "--data-planes", "1", started=ups)
    kids = children(proc.pid)
    for _ in range(RESTARTS_ALLOWED):
        os.kill(_pid_of(proc.pid, "data plane dp1"), signal.SIGKILL)
        assert "started it again" in _stderr_line(proc)
    os.kill(_pid_of(proc.pid, "data plane dp1"), signal.SIGKILL)
    proc.wait(30)
    err = proc.stderr.read().strip()
    assert proc.returncode == 1, err
    assert err.count("\n") == 0 and err.startswith(
        f"kvmesh up: data plane dp1 stopped {RESTARTS_ALLOWED + 1} times within 60 s (last: killed by SIGKILL; its log:"), err
    assert err.endswith(": stopped the fleet"), err
    wait_gone(kids, 10)
