"""``kvmesh bench faults``: the fault matrix, on a real network stack (Linux network namespaces; root only).

Two data planes (``n1`` holds the blocks, ``n2`` serves the "engine") each run in their own network
namespace behind a bridge; the control plane runs in this namespace on the bridge's address, over a Redis
Cluster of three primaries with one replica each (on loopback). NIXL runs with ``UCX_TLS=tcp`` on the veth
(``UCX_NET_DEVICES=kv0``), so pulled bytes cross the kernel's TCP/IP stack: the report gives n1's veth
transmit counter against the bytes pulled as proof.

Each case writes fresh blocks with known byte patterns (every byte of block ``h`` is ``h`` repeated) on n1,
injects its fault, then plays an engine's request: LookupPrefix (deadline 1 s) names a holder, n2 pulls from
it (the pull's own bound), the engine Acquires what n2 holds and checks every pulled byte; what is not pulled
is recomputed. A case is ok when every request completed with correct bytes within the case's bound, after the
fault heals nothing a node still holds is missing from the map (within ``settle``), a pull works again, and
where a node lost its blocks, no route names it past the lease.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import grpc
import numpy as np
import redis

from data_plane.client import DataPlaneClient, SharedTier
from kvmesh.command_line import Parser, run_command, subset
from kvmesh.errors import PermissionDenied
from kvmesh.channels import channel
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh.v1 import control_plane_pb2 as cp_pb, control_plane_pb2_grpc as cp_grpc
from kvmesh.v1 import tenant_admin_pb2 as ta_pb, tenant_admin_pb2_grpc as ta_grpc
from kvmesh_apps.netns import Host, Network
from kvmesh_apps.procs import ServiceProcess
from kvmesh_apps.redis_server import RedisCluster, RedisServer
from tenancy.api_keys import new_key

BLOCK_BYTES = 128 * 1024
BLOCKS = 16
LEASE_MS = 5_000
PULL_TIMEOUT_MS = 2_000
LOOKUP_DEADLINE_S = 1.0
DP_PORT = 7000
TENANT = "faults"
NS = Namespace(TENANT, "fault-model", "v1", CacheConfig(block_size=32)).validate()
SETTLE_S = LEASE_MS / 1000 * 2 + 5  # heal -> map complete again, pulls working again


def pattern(block_hash: bytes) -> np.ndarray:
    return np.frombuffer(block_hash * (BLOCK_BYTES // len(block_hash)), dtype=np.uint8)


def block_ok(data: np.ndarray, block_hash: bytes) -> bool:
    """Every byte of a pulled block against its known pattern."""
    return data.shape == (BLOCK_BYTES,) and bool(np.array_equal(data, pattern(block_hash)))


@dataclass
class Request:
    """One engine request: how long it took, what it pulled (and checked), what it recomputed."""

    ms: float
    pulled: int
    recomputed: int
    bytes_ok: bool
    holder: str = ""
    note: str = ""  # why the request did not pull everything, when it did not


@dataclass
class CaseResult:
    ok: bool
    bound_ms: int
    measured_ms: int
    detail: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"ok": self.ok, "bound_ms": self.bound_ms, "measured_ms": self.measured_ms, **self.detail}


class Matrix:
    def __init__(self, workdir: Path, cluster: bool = True) -> None:
        self.workdir = workdir
        self.net = Network()
        self.redis = RedisCluster(workdir / "redis", masters=3, replicas=1) if cluster else RedisServer(
            workdir / "redis")
        self.admin_key = new_key()[1]
        self.cp: ServiceProcess | None = None
        self.dps: dict[str, ServiceProcess] = {}
        self.hosts: dict[str, Host] = {}
        self.keys: dict[str, str] = {}
        self.shm_dir = Path(tempfile.mkdtemp(prefix="kvmesh-faults-", dir="/dev/shm"))
        self.held: dict[str, list[list[bytes]]] = {"n1": [], "n2": []}  # block runs each node holds
        self._serial = 0
        self.frozen_pid = 0
        self._starts = 0

    # ---- the fleet ----

    def start(self) -> None:
        self.net.open()
        for name in ("n1", "n2"):
            self.hosts[name] = self.net.add_host(name)
        self.redis.start()
        self.cp = ServiceProcess(
            ["control-plane", "--listen", f"{self.net.host_ip}:0", "--redis-url",
             self.redis.seeds_url if isinstance(self.redis, RedisCluster) else self.redis.url,
             "--lease-ms", str(LEASE_MS), "--gc-interval-s", "1"],
            env={"KVMESH_CP_ADMIN_KEY": self.admin_key}, log_path=self.workdir / "control-plane.log").start()
        self.keys = asyncio.run(self._provision())
        for name in self.hosts:
            self.start_dp(name)
        asyncio.run(self._warm_up())

    async def _warm_up(self) -> None:
        """Pulls until one moves every block, so both nodes have built their NIXL agents (seconds under
        load; node_restart measures start-up) and hold the grant-verifying key and a NIXL connection, as
        nodes that served before a fault would."""
        last: list[Request] = []

        async def pulled() -> bool:
            last[:] = [await self.request(await self.prepared())]
            return last[0].pulled == BLOCKS and last[0].bytes_ok

        if await self.wait_for(pulled, 60.0) is None:
            raise RuntimeError(f"no warm-up pull moved every block within 60 s: {last}")

    async def _provision(self) -> dict[str, str]:
        async with channel(self.cp.address, self.admin_key) as ch:
            admin = ta_grpc.TenantAdminStub(ch)
            await admin.CreateTenant(ta_pb.CreateTenantRequest(tenant_id=TENANT))
            keys = {}
            for name in self.hosts:
                reply = await admin.IssueKey(ta_pb.IssueKeyRequest(role=ta_pb.ROLE_NODE, node_id=name))
                keys[name] = reply.secret
            return keys

    def start_dp(self, name: str) -> float:
        """Starts (or restarts) node ``name``; returns seconds until it served."""
        host = self.hosts[name]
        t0 = time.monotonic()
        self.dps[name] = ServiceProcess(
            ["data-plane", "--node-id", name, "--listen", f"{host.ip}:{DP_PORT}", "--control-plane-address",
             self.cp.address, "--shm-dir", str(self.shm_dir), "--capacity-bytes", "256MiB", "--block-bytes",
             str(BLOCK_BYTES), "--no-lock-memory", "--pull-timeout-ms", str(PULL_TIMEOUT_MS)],
            env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": "kv0", "KVMESH_DP_API_KEY": self.keys[name]},
            prefix=Network.prefix(host), log_path=self.workdir / f"{name}-{self._starts}.log").start()
        self._starts += 1
        return time.monotonic() - t0

    def stop(self) -> None:
        for proc in self.dps.values():
            if proc.proc is not None and proc.proc.poll() is None:
                os.kill(proc.proc.pid, signal.SIGCONT)
            proc.stop()
        if self.cp is not None:
            if self.cp.proc is not None and self.cp.proc.poll() is None:
                os.kill(self.cp.proc.pid, signal.SIGCONT)
            self.cp.stop()
        for node in self.redis_nodes():
            if node.proc is not None and node.proc.poll() is None:
                os.kill(node.proc.pid, signal.SIGCONT)
        self.redis.stop()
        self.net.close()
        shutil.rmtree(self.shm_dir, ignore_errors=True)

    def redis_nodes(self) -> list[RedisServer]:
        return self.redis.nodes if isinstance(self.redis, RedisCluster) else [self.redis]

    def address(self, name: str) -> str:
        return f"{self.hosts[name].ip}:{DP_PORT}"

    # ---- the engine's side ----

    def fresh(self) -> list[bytes]:
        self._serial += 1
        return [hashlib.sha256(f"{os.getpid()}:{self._serial}:{i}".encode()).digest() for i in range(BLOCKS)]

    async def put(self, name: str, hashes: list[bytes]) -> None:
        """Writes ``hashes`` with their patterns into node ``name``'s tier (as its engine would)."""
        async with DataPlaneClient(self.address(name), self.keys[name]) as dp:
            tier = SharedTier.open(await dp.describe_tier())
            try:
                slots = await dp.reserve(NS, hashes)
                for h, slot in zip(hashes, slots):
                    if slot < 0:
                        raise RuntimeError(f"{name} refused a block")
                    tier.slot(slot)[:] = pattern(h)
                await dp.commit(NS, hashes)
            finally:
                tier.close()
        self.held[name].append(hashes)

    async def holders(self, hashes: list[bytes], timeout: float = LOOKUP_DEADLINE_S) -> dict[str, tuple[str, int]]:
        async with channel(self.cp.address, self.admin_key) as ch:
            reply = await cp_grpc.ControlPlaneStub(ch).LookupPrefix(
                cp_pb.LookupPrefixRequest(namespace=NS.to_proto(), block_hashes=hashes), timeout=timeout)
        return {h.node_id: (h.data_plane_address, h.leading_blocks) for h in reply.holders}

    async def request(self, hashes: list[bytes]) -> Request:
        """An engine on n2: look up, pull from the best other holder, check every pulled byte, recompute the rest."""
        t0 = time.perf_counter()
        note = ""
        try:
            found = await self.holders(hashes)
        except grpc.aio.AioRpcError as exc:
            found, note = {}, f"lookup {exc.code().name}"  # no answer in time: recompute
        candidates = sorted(((lead, node, addr) for node, (addr, lead) in found.items() if node != "n2"),
                            reverse=True)
        if not candidates and not note:
            note = f"the lookup named no other holder ({sorted(found)})"
        pulled, ok, holder = 0, True, ""
        if candidates:
            lead, holder, addr = candidates[0]
            try:
                async with DataPlaneClient(self.address("n2"), self.keys["n2"]) as dp:
                    result = await dp.pull(NS, hashes[:lead], holder, addr, timeout_ms=PULL_TIMEOUT_MS,
                                           timeout=PULL_TIMEOUT_MS / 1000 + 1)
                    if result.pulled + result.already_local < lead:
                        note = f"pull answered {result.pulled} pulled of {lead}"
                    slots, lease = await dp.acquire(NS, hashes, timeout=1.0)
                    tier = SharedTier.open(await dp.describe_tier(timeout=1.0))
                    try:
                        for h, slot in zip(hashes, slots):
                            if slot < 0:
                                break
                            ok &= block_ok(tier.slot(slot), h)
                            pulled += 1
                    finally:
                        tier.close()
                    await dp.release(lease, timeout=1.0)
            except grpc.aio.AioRpcError as exc:  # the engine recomputes what it could not load
                note = f"{exc.code().name}: {exc.details()}"
        if pulled:
            self.held["n2"].append(hashes[:pulled])
        return Request((time.perf_counter() - t0) * 1000, pulled, len(hashes) - pulled, ok, holder, note)

    # ---- checks after a fault ----

    async def map_complete(self) -> bool:
        """Every block a node still holds (asked of the node itself: the data plane is the truth) is in the
        map under that node."""
        for name, runs in self.held.items():
            async with DataPlaneClient(self.address(name), self.keys[name]) as dp:
                for run in runs:
                    slots, lease = await dp.acquire(NS, run, timeout=2.0)
                    if lease:
                        await dp.release(lease, timeout=2.0)
                    held = next((i for i, s in enumerate(slots) if s < 0), len(run))
                    if held and (await self.holders(run, timeout=2.0)).get(name, ("", 0))[1] < held:
                        return False
        return True

    async def wait_for(self, condition: Callable[[], Awaitable[bool]], timeout_s: float) -> float | None:
        """Seconds until ``condition`` held, or None."""
        t0 = time.monotonic()
        while True:
            try:
                if await condition():
                    return time.monotonic() - t0
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() - t0 > timeout_s:
                return None
            await asyncio.sleep(0.2)

    async def recovered(self) -> tuple[float | None, float | None]:
        """(seconds until the map is complete, seconds until a fresh pull from n1 moves every block)."""
        map_s = await self.wait_for(self.map_complete, SETTLE_S)

        async def pulls() -> bool:
            hashes = self.fresh()
            await self.put("n1", hashes)
            if await self.wait_for(lambda: self._held_by(hashes, "n1"), 3.0) is None:
                return False
            req = await self.request(hashes)
            return req.pulled == len(hashes) and req.bytes_ok

        pull_s = await self.wait_for(pulls, SETTLE_S)
        return map_s, pull_s

    async def _held_by(self, hashes: list[bytes], name: str) -> bool:
        return (await self.holders(hashes, timeout=2.0)).get(name, ("", 0))[1] == len(hashes)

    async def prepared(self) -> list[bytes]:
        hashes = self.fresh()
        await self.put("n1", hashes)
        if await self.wait_for(lambda: self._held_by(hashes, "n1"), 10.0) is None:
            raise RuntimeError("n1's blocks did not reach the map")
        return hashes

    def pid(self, name: str) -> int:
        if name == "cp":
            return self.cp.proc.pid
        return self.dps[name].proc.pid


Inject = Callable[[Matrix], Awaitable[None]]


@dataclass
class Case:
    name: str
    bound_ms: int
    inject: Inject
    heal: Inject
    requests: int = 3
    expect_pull: bool | None = None  # True: the fault must not stop the pull; None: either
    max_recomputed: int | None = None  # at most this many requests may recompute (None: any)


async def _nothing(m: Matrix) -> None:
    return None


def _signal(target: str, sig: signal.Signals) -> Inject:
    async def send(m: Matrix) -> None:
        os.kill(m.pid(target), sig)

    return send


async def _freeze_redis(m: Matrix) -> None:
    m.frozen_pid = _blocks_primary(m)
    os.kill(m.frozen_pid, signal.SIGSTOP)


async def _thaw_redis(m: Matrix) -> None:
    os.kill(m.frozen_pid, signal.SIGCONT)


def _blocks_primary(m: Matrix) -> int:
    """The pid of the Redis primary that holds the namespace's block map (found, not derived: the key
    carries the tenant's epoch)."""
    if isinstance(m.redis, RedisServer):
        return m.redis.proc.pid
    holders = []
    for server in m.redis_nodes():
        if server.proc is None or server.proc.poll() is not None:
            continue
        client = redis.Redis(port=server.port)
        try:
            if client.info("replication")["role"] == "master" and \
                    any(client.scan_iter(match=f"*{NS.fingerprint}*:blocks")):
                holders.append(server.proc.pid)
        finally:
            client.close()
    if len(holders) != 1:
        raise RuntimeError(f"{len(holders)} Redis primaries hold the block map of {NS.fingerprint}")
    return holders[0]


async def _nixl_partition(m: Matrix) -> None:
    """Every packet between n1 and n2 except those of n1's gRPC port (UCX's connections)."""
    n1, n2 = m.hosts["n1"], m.hosts["n2"]
    m.net.drop(n1, "INPUT", ["-s", n2.ip, "-p", "tcp", "!", "--dport", str(DP_PORT)])
    m.net.drop(n1, "OUTPUT", ["-d", n2.ip, "-p", "tcp", "!", "--sport", str(DP_PORT)])


async def _heal_network(m: Matrix) -> None:
    for host in m.hosts.values():
        m.net.undelay(host)
        m.net.undrop(host)
        m.net.unshape(host)


def cases(m_lookup_ms: int = int(LOOKUP_DEADLINE_S * 1000)) -> list[Case]:
    pull_rpc_ms = PULL_TIMEOUT_MS + 1000
    pull_path = m_lookup_ms + pull_rpc_ms + 1000 + 500  # lookup + pull + acquire + margin
    return [
        Case("baseline", 1500, _nothing, _nothing, expect_pull=True),
        Case("latency_20ms_each_way", 2500, _delay(20), _heal_network, expect_pull=True),
        # The same step held for ~6 s of back-to-back pulls on the connection made before it: BBR keeps the
        # pre-step min RTT for its 10 s window and its cwnd collapses; the WRITE that times out closes the
        # endpoint, the next pull re-handshakes onto a fresh connection (docs/architecture.md).
        Case("latency_20ms_sustained", pull_path, _delay(20), _heal_network, requests=12, max_recomputed=1),
        Case("bandwidth_100mbit", 2500, _rate("100mbit"), _heal_network, expect_pull=True),
        Case("loss_5pct", pull_path, _loss(0.05), _heal_network),
        Case("nixl_partition_grpc_up", pull_path, _nixl_partition, _heal_network),
        Case("grpc_partition_nixl_up", pull_path, _drop_grpc, _heal_network),
        Case("freeze_source_dp", pull_path, _signal("n1", signal.SIGSTOP), _signal("n1", signal.SIGCONT)),
        Case("freeze_consumer_dp", pull_path, _signal("n2", signal.SIGSTOP), _signal("n2", signal.SIGCONT),
             requests=1),
        Case("freeze_control_plane", m_lookup_ms + 500, _signal("cp", signal.SIGSTOP),
             _signal("cp", signal.SIGCONT)),
        Case("freeze_redis_primary", m_lookup_ms + 500, _freeze_redis, _thaw_redis, requests=2),
    ]


def _delay(ms: float) -> Inject:
    async def delay(m: Matrix) -> None:
        for host in m.hosts.values():
            m.net.delay(host, ms)

    return delay


def _rate(rate: str) -> Inject:
    async def limit(m: Matrix) -> None:
        for host in m.hosts.values():
            m.net.limit_rate(host, rate)

    return limit


def _loss(fraction: float) -> Inject:
    async def lose(m: Matrix) -> None:
        for host in m.hosts.values():
            m.net.lose(host, fraction)

    return lose


async def _drop_grpc(m: Matrix) -> None:
    n1, n2 = m.hosts["n1"], m.hosts["n2"]
    m.net.drop(n1, "INPUT", ["-s", n2.ip, "-p", "tcp", "--dport", str(DP_PORT)])
    m.net.drop(n1, "OUTPUT", ["-d", n2.ip, "-p", "tcp", "--sport", str(DP_PORT)])


async def run_case(m: Matrix, case: Case) -> CaseResult:
    hashes_per_request = [await m.prepared() for _ in range(case.requests)]
    await case.inject(m)
    try:
        done = [await m.request(h) for h in hashes_per_request]
    finally:
        await case.heal(m)
    map_s, pull_s = await m.recovered()
    measured = max(r.ms for r in done)
    missed = sum(1 for r in done if r.pulled < BLOCKS)
    pulled_ok = (case.expect_pull is not True or not missed) and (
        case.max_recomputed is None or missed <= case.max_recomputed)
    ok = (all(r.bytes_ok for r in done) and measured <= case.bound_ms and pulled_ok and map_s is not None
          and pull_s is not None)
    return CaseResult(ok, case.bound_ms, round(measured), {
        "pulled": sum(r.pulled for r in done), "recomputed": sum(r.recomputed for r in done),
        "requests_recomputed": missed, "bytes_ok": all(r.bytes_ok for r in done),
        "map_complete_after_s": None if map_s is None else round(map_s, 2),
        "pulls_again_after_s": None if pull_s is None else round(pull_s, 2),
        "notes": sorted({r.note for r in done if r.note})})


async def run_partition_from_cp(m: Matrix) -> CaseResult:
    """n1 cut from the control plane only: pulls from it still work (the data plane is the truth), the
    map drops it within the lease, and it is back in full once the cut heals."""
    hashes = await m.prepared()
    n1 = m.hosts["n1"]
    cp_port = m.cp.port
    m.net.drop(n1, "OUTPUT", ["-d", m.net.host_ip, "-p", "tcp", "--dport", str(cp_port)])
    m.net.drop(n1, "INPUT", ["-s", m.net.host_ip, "-p", "tcp", "--sport", str(cp_port)])
    t0 = time.monotonic()
    try:
        req = await m.request(hashes)
        gone_s = await m.wait_for(lambda: _not_named(m, hashes, "n1"), LEASE_MS / 1000 * 3)
        if gone_s is not None:
            gone_s = time.monotonic() - t0
    finally:
        await _heal_network(m)
    map_s, pull_s = await m.recovered()
    bound = LEASE_MS + 2000  # lease + one GC interval + lookup
    ok = req.bytes_ok and req.pulled == BLOCKS and gone_s is not None and gone_s * 1000 <= bound \
        and map_s is not None and pull_s is not None
    return CaseResult(ok, bound, round((gone_s if gone_s is not None else time.monotonic() - t0) * 1000), {
        "what": "ms until the map stopped naming the cut node", "request_ms": round(req.ms),
        "pulled": req.pulled, "bytes_ok": req.bytes_ok,
        "map_complete_after_s": None if map_s is None else round(map_s, 2),
        "pulls_again_after_s": None if pull_s is None else round(pull_s, 2)})


async def _not_named(m: Matrix, hashes: list[bytes], name: str) -> bool:
    return name not in await m.holders(hashes, timeout=2.0)


async def run_node_restart(m: Matrix) -> CaseResult:
    """n1 killed (SIGKILL) and restarted: requests meanwhile recompute; its old routes end within the lease."""
    hashes = await m.prepared()
    old_runs = list(m.held["n1"])
    t0 = time.monotonic()
    m.dps["n1"].kill()
    req = await m.request(hashes)
    restarting = asyncio.create_task(asyncio.to_thread(m.start_dp, "n1"))
    stale_s = await m.wait_for(lambda: _none_named(m, old_runs, "n1"), LEASE_MS / 1000 * 3)
    stale_ms = (time.monotonic() - t0) * 1000
    restart_s = await restarting
    m.held["n1"] = []
    map_s, pull_s = await m.recovered()
    bound = LEASE_MS + 2000  # the lease, one GC interval and a lookup: whichever comes first, lease or restart
    ok = req.bytes_ok and stale_s is not None and stale_ms <= bound and map_s is not None and pull_s is not None
    return CaseResult(ok, bound, round(stale_ms), {
        "what": "ms from the kill until no route named the dead incarnation's blocks",
        "request_ms": round(req.ms), "pulled": req.pulled, "recomputed": req.recomputed,
        "restart_to_serving_ms": round(restart_s * 1000),
        "map_complete_after_s": None if map_s is None else round(map_s, 2),
        "pulls_again_after_s": None if pull_s is None else round(pull_s, 2)})


async def _none_named(m: Matrix, runs: list[list[bytes]], name: str) -> bool:
    for run in runs:
        if name in await m.holders(run, timeout=2.0):
            return False
    return True


async def run_redis_failover(m: Matrix) -> CaseResult:
    """The Redis primary holding the block map is killed; its replica is promoted. Requests keep completing
    (recomputing while the map is unreachable) and nothing is lost."""
    hashes_runs = [await m.prepared() for _ in range(3)]
    pid = _blocks_primary(m)
    (server,) = [n for n in m.redis_nodes() if n.proc is not None and n.proc.pid == pid]
    t0 = time.monotonic()
    server.proc.kill()
    server.proc.wait()
    done = [await m.request(hashes) for hashes in hashes_runs]
    answers_s = await m.wait_for(lambda: _map_answers(m), 30.0)
    if answers_s is not None:
        answers_s = time.monotonic() - t0
    map_s, pull_s = await m.recovered()
    measured = max(r.ms for r in done)
    bound = int(LOOKUP_DEADLINE_S * 1000) + PULL_TIMEOUT_MS + 2500
    ok = all(r.bytes_ok for r in done) and measured <= bound and answers_s is not None and map_s is not None \
        and pull_s is not None
    return CaseResult(ok, bound, round(measured), {
        "pulled": sum(r.pulled for r in done), "recomputed": sum(r.recomputed for r in done),
        "map_answers_again_after_kill_s": None if answers_s is None else round(answers_s, 2),
        "map_complete_after_s": None if map_s is None else round(map_s, 2),
        "pulls_again_after_s": None if pull_s is None else round(pull_s, 2)})


async def _map_answers(m: Matrix) -> bool:
    await m.holders(m.held["n1"][-1] if m.held["n1"] else m.fresh(), timeout=2.0)
    return True


# The cases with their own runner, after the matrix of cases().
SPECIAL: dict[str, Callable[[Matrix], Awaitable[CaseResult]]] = {
    "partition_node_from_control_plane": run_partition_from_cp, "node_restart": run_node_restart,
    "redis_failover": run_redis_failover}
NEEDS_CLUSTER = {"redis_failover"}


def case_names() -> list[str]:
    """Every case --cases may name, in the order they run."""
    return [case.name for case in cases()] + list(SPECIAL)


async def _matrix(m: Matrix, only: set[str] | None) -> dict:
    out: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    proof: dict = {}
    special = dict(SPECIAL)
    for case in cases():
        if only and case.name not in only:
            continue
        tx0 = m.net.tx_bytes(m.hosts["n1"])
        try:
            result = await run_case(m, case)
        except NotImplementedError as exc:  # a fault this kernel cannot inject
            await _heal_network(m)
            skipped[case.name] = str(exc)
            continue
        if case.name == "baseline":
            proof = {"pulled_bytes": result.detail["pulled"] * BLOCK_BYTES,
                     "n1_veth_tx_bytes": m.net.tx_bytes(m.hosts["n1"]) - tx0, "UCX_TLS": "tcp"}
        out[case.name] = result.to_json()
        print(f"{case.name}: {json.dumps(out[case.name])}", file=sys.stderr, flush=True)
    if isinstance(m.redis, RedisServer):
        for name in NEEDS_CLUSTER:
            del special[name]
    for name, runner in special.items():
        if only and name not in only:
            continue
        out[name] = (await runner(m)).to_json()
        print(f"{name}: {json.dumps(out[name])}", file=sys.stderr, flush=True)
    return {"cases": out, "failed": sum(1 for c in out.values() if not c["ok"]), "nixl_over_tcp": proof,
            "skipped": skipped}


def main(argv: list[str]) -> int:
    parser = Parser(prog="kvmesh bench faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    parser.add_argument("--cases", type=subset(case_names()), default=None,
                        help=f"comma-separated case names (default: all): {', '.join(case_names())}")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    parser.add_argument("--single-redis", action="store_true",
                        help="one redis-server instead of a Redis Cluster with replicas (no failover case)")
    args = parser.parse_args(argv)  # a misspelled case: one line, exit 2, before any set-up
    if args.single_redis and NEEDS_CLUSTER & set(args.cases or ()):
        parser.error(f"--cases {', '.join(sorted(NEEDS_CLUSTER & set(args.cases)))} needs the Redis Cluster; drop "
                     "--single-redis, or that case")
    if os.geteuid() != 0:
        raise PermissionDenied("needs root (it makes network namespaces); run it as root, e.g. with sudo")
    workdir = Path(tempfile.mkdtemp(prefix="kvmesh-faults-"))
    matrix = Matrix(workdir, cluster=not args.single_redis)
    try:
        matrix.start()
        result = asyncio.run(_matrix(matrix, set(args.cases) if args.cases else None))
        result["settings"] = {"lease_ms": LEASE_MS, "pull_timeout_ms": PULL_TIMEOUT_MS,
                              "lookup_deadline_ms": int(LOOKUP_DEADLINE_S * 1000), "block_bytes": BLOCK_BYTES,
                              "blocks_per_request": BLOCKS}
    finally:
        matrix.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"logs in {workdir}", file=sys.stderr)
    if not args.json:
        for name, case in result["cases"].items():
            print(f"{name:>36}: {'ok ' if case['ok'] else 'FAIL'} {case['measured_ms']:>6} ms (bound {case['bound_ms']})")
    print(json.dumps(result))
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(run_command("kvmesh bench faults", main, sys.argv[1:]))  # one line for any error, as `kvmesh` gives
