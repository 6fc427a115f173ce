"""``kvmesh bench scale``: a block map of ten million blocks over a thousand nodes, on one Redis and on a Redis Cluster.

Real Valkey servers (the set-up's, :func:`kvmesh_apps.redis_server.find_redis_server`): one server, then a cluster
of ``--shards`` primaries with one replica each. The map is built through the real write path, the objects
``control_plane.server`` builds: the tenant is created through a real control plane's admin RPC, the nodes
register (each gets its slot), and every node's event batches go through ``RedisBlockMap.apply_batch`` (the
begin/apply/end Lua scripts, as the tenant's Redis user), many batches in flight at once. So the bytes in Redis are
the bytes a fleet writes.

What the map holds: prompts of ``--prompt-blocks`` blocks (random 32-byte hashes), spread over ``--namespaces``
namespaces of one tenant (chosen so that each shard of the cluster holds as many); prompt ``p`` is held, on the
CPU tier, by ``--holders`` consecutive nodes of the ``--nodes`` (group ``p // namespaces`` modulo the number of
groups), so every block has ``--holders`` entries and every node holds about the same number of blocks.

At each checkpoint (100k, 1M, 10M blocks, or ``--checkpoints``), on each backend:

- Redis bytes per block: ``INFO memory`` ``used_memory`` of the primaries (less their replication buffers), less
  what they used before the first block, over the blocks stored; and the same without the namespaces' change
  streams (``redis_map_bytes_per_block``: the map itself; the streams are trimmed to a bounded length, so their
  share shrinks as the map grows);
- lookup latency of whole prompts held by ``--holders`` nodes, every answer checked, two ways interleaved: the
  ``LookupPrefix`` RPC of a control-plane process on the same Redis, called with a scheduler key
  (``lookup_*``: the server answers from its in-memory replica once it has loaded the namespace), and
  ``RedisBlockMap.lookup_prefix`` in this process without a replica (``direct_lookup_*``: lookup.lua in Redis);
- a cold in-memory replica resynced from the backend: resync time, bytes per block, in-process lookups.

``--cluster-only`` skips the single server, so that the two backends can be built in two runs (the top-level
figures are then the cluster's: ``sizes_backend`` names the backend they come from).

At the full size, on each backend, the sweep cost: one node leaves and the garbage collection frees its entries
(``gc_sweep_s``: every namespace's map is scanned). Then, on the cluster, a shard failover: the primary holding a
namespace is killed (SIGKILL) and the time is taken until a lookup of a prompt of that namespace answers in full again, both through kvmesh's own client
(``RedisBlockMap``, which must follow the cluster to the promoted replica: ``failover_recovery_s``) and through the
control plane's RPC (``failover_recovery_rpc_s``; its replica keeps answering while the shard is down).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import random
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path

import redis
from redis.crc import key_slot

from control_plane.config import ControlPlaneConfig
from control_plane.model import ALL_TIERS, Ack, AckStatus, EventBatch, Medium, NodeInfo, Stored
from control_plane.redis_block_map import RedisBlockMap
from kvmesh import errors
from kvmesh.channels import channel
from kvmesh.command_line import Parser, positive_float, positive_int, run_command
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh.redis_keys import Keys
from kvmesh.v1 import control_plane_pb2 as pb, control_plane_pb2_grpc as pb_grpc
from kvmesh.v1 import tenant_admin_pb2, tenant_admin_pb2_grpc
from kvmesh_apps.procs import ServiceProcess
from kvmesh_apps.redis_server import RedisCluster, RedisServer, find_redis_server
from tenancy.api_keys import new_key
from tenancy.store import RedisTenantStore

BLOCK_SIZE = 32
HASH_LEN = 32
TENANT = "scale"
LEASE_MS = 24 * 3_600_000  # the simulated nodes never heartbeat: their lease outlasts the run
CHECKPOINTS = (100_000, 1_000_000, 10_000_000)
CLUSTER_SLOTS = 16384
WRITE_ATTEMPTS = 3


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which blocks the map holds and who holds them (see the module docstring)."""

    namespaces: tuple[Namespace, ...]
    nodes: int
    holders: int
    prompt_blocks: int

    @property
    def groups(self) -> int:
        return self.nodes // self.holders

    def node_id(self, n: int) -> str:
        return f"scale-node-{n:05d}"

    def namespace(self, p: int) -> Namespace:
        return self.namespaces[p % len(self.namespaces)]

    def holders_of(self, p: int) -> range:
        group = (p // len(self.namespaces)) % self.groups
        return range(group * self.holders, (group + 1) * self.holders)

    def prompt(self, p: int) -> list[bytes]:
        """Prompt ``p``'s block hashes: deterministic, so a lookup regenerates any prompt instead of keeping 10M."""
        blob = hashlib.shake_256(f"scale-prompt:{p}".encode()).digest(HASH_LEN * self.prompt_blocks)
        return [blob[i:i + HASH_LEN] for i in range(0, len(blob), HASH_LEN)]

    def prompts_for(self, blocks: int) -> int:
        return -(-blocks // self.prompt_blocks)


def namespaces_for_epoch(count: int, shards: int, epoch: str) -> tuple[Namespace, ...]:
    """``count`` namespaces of the tenant whose block-map keys (hash tag: tenant, fingerprint and the tenant's
    epoch) fall on the ``shards`` equal slot ranges ``valkey-cli --cluster create`` assigns, round-robin:
    namespace ``i`` lands on shard ``i % shards``."""
    wanted = [len(range(s, count, shards)) for s in range(shards)]
    per_shard: list[list[Namespace]] = [[] for _ in range(shards)]
    i = 0
    while any(len(found) < n for found, n in zip(per_shard, wanted)):
        ns = Namespace(TENANT, f"scale-model-{i}", "v1", CacheConfig(block_size=BLOCK_SIZE))
        shard = shard_of(Keys().blocks(ns, epoch), shards)
        if len(per_shard[shard]) < wanted[shard]:
            per_shard[shard].append(ns)
        i += 1
    return tuple(per_shard[i % shards][i // shards] for i in range(count))


def shard_of(key: str, shards: int) -> int:
    """The shard of ``shards`` equal slot ranges that ``key`` (its hash tag) falls on."""
    return key_slot(key.encode()) * shards // CLUSTER_SLOTS


# ---- the backends ----

class Backend:
    """One Redis or a cluster, a control-plane process on it, and the in-process RedisBlockMap the control plane
    would build (tenant credentials and all)."""

    def __init__(self, workdir: Path, shards: int) -> None:
        self.shards = shards
        self.cluster = shards > 0
        self.redis = (RedisCluster(workdir / "cluster", masters=shards, replicas=1) if self.cluster
                      else RedisServer(workdir / "redis", extra_args=["--appendonly", "no"]))
        self.workdir = workdir
        self.admin_key = new_key()[1]
        self.cp: ServiceProcess | None = None

    @property
    def url(self) -> str:
        return self.redis.seeds_url if self.cluster else self.redis.url

    @property
    def name(self) -> str:
        return "cluster" if self.cluster else "redis"

    def start(self) -> "Backend":
        self.redis.start()
        for node in self._servers():
            with redis.Redis(port=node.port) as r:
                r.config_set("appendonly", "no")  # the map is rebuilt every run: no AOF of 80M writes
                r.config_set("repl-diskless-sync-delay", 0)  # replicas sync at once (a failover needs a synced one)
        self.cp = ServiceProcess(["control-plane", "--listen", "127.0.0.1:0", "--redis-url", self.url,
                                  "--lease-ms", str(LEASE_MS)],
                                 env={"KVMESH_CP_ADMIN_KEY": self.admin_key},
                                 log_path=self.workdir / f"cp-{self.name}.log").start()
        return self

    def _servers(self) -> list[RedisServer]:
        return self.redis.nodes if self.cluster else [self.redis]

    def primaries(self) -> list[RedisServer]:
        out = []
        for node in self._servers():
            if node.proc is None or node.proc.poll() is not None:
                continue
            with redis.Redis(port=node.port) as r:
                if r.info("replication")["role"] == "master":
                    out.append(node)
        return out

    def used_memory(self, nodes: list[RedisServer] | None = None) -> int:
        """``used_memory`` of the primaries (or ``nodes``) less their replication buffers (the backlog, 10 MiB
        by default, is there whatever the map's size, and sent to replicas, not stored)."""
        total = 0
        for node in self.primaries() if nodes is None else nodes:
            with redis.Redis(port=node.port) as r:
                info = r.info("memory")
            total += info["used_memory"] - info.get("mem_total_replication_buffers", 0)
        return total

    def script_seconds(self) -> float:
        """Time the primaries have spent running scripts (``INFO commandstats``, EVALSHA and EVALSHA_RO)."""
        total = 0
        for node in self.primaries():
            with redis.Redis(port=node.port) as r:
                total += sum(v["usec"] for k, v in r.info("commandstats").items() if k.startswith("cmdstat_evalsha"))
        return total / 1e6

    def key_bytes(self, keys: list[str]) -> int:
        """What ``keys`` take in Redis (``MEMORY USAGE ... SAMPLES 0``: every element counted), wherever they live."""
        primary = self.primaries()[0]
        client = (redis.RedisCluster(host="127.0.0.1", port=primary.port) if self.cluster
                  else redis.Redis(port=primary.port))
        with client:
            return sum(client.memory_usage(key, samples=0) or 0 for key in keys)

    def replicas(self) -> list[RedisServer]:
        primaries = {n.port for n in self.primaries()}
        return [n for n in self._servers() if n.port not in primaries and n.proc is not None]

    def wait_replicas_synced(self, timeout_s: float) -> None:
        """Until every replica's link to its primary is up and it has applied all its primary has sent; a replica
        that never synced cannot take over (Valkey refuses: "disconnected from primary for longer than allowed")."""
        deadline = time.monotonic() + timeout_s
        lagging: list[str] = []
        while time.monotonic() < deadline:
            lagging = []
            for node in self.replicas():
                with redis.Redis(port=node.port) as r:
                    info = r.info("replication")
                with redis.Redis(host=info["master_host"], port=info["master_port"]) as primary:
                    sent = primary.info("replication")["master_repl_offset"]
                if info.get("master_link_status") != "up" or info.get("slave_repl_offset", -1) < sent:
                    lagging.append(f"127.0.0.1:{node.port}")
            if not lagging:
                return
            time.sleep(0.2)
        raise errors.Unavailable(f"cluster replicas {', '.join(lagging)} did not catch up with their primaries "
                                 f"within {timeout_s:g} s; a failover cannot be measured (see their redis.log)")

    def block_map(self) -> tuple[RedisBlockMap, RedisTenantStore]:
        """The RedisBlockMap and tenant store ``control_plane.server`` builds for this Redis."""
        config = ControlPlaneConfig(redis_url=self.url, admin_key=self.admin_key, lease_ms=LEASE_MS)
        tenants = RedisTenantStore(self.url, key_prefix=config.key_prefix, tenant_secret=config.tenant_secret())
        return (RedisBlockMap(self.url, lease_ms=LEASE_MS, key_prefix=config.key_prefix,
                              tenant_credentials=tenants.redis_credentials), tenants)

    def stop(self) -> None:
        if self.cp is not None:
            self.cp.stop()
        self.redis.stop()


async def scheduler_key(address: str, admin_key: str) -> str:
    """Creates the tenant through the control plane; returns a scheduler key for it."""
    async with channel(address, admin_key) as ch:
        admin = tenant_admin_pb2_grpc.TenantAdminStub(ch)
        await admin.CreateTenant(tenant_admin_pb2.CreateTenantRequest(tenant_id=TENANT))
        reply = await admin.IssueKey(tenant_admin_pb2.IssueKeyRequest(role=tenant_admin_pb2.ROLE_SCHEDULER,
                                                                      tenant_id=TENANT))
        return reply.secret


# ---- building the map ----

class Writer:
    """The fleet's writes: registered nodes, each with its incarnation and next sequence number."""

    def __init__(self, block_map: RedisBlockMap, layout: Layout, concurrency: int) -> None:
        self.block_map = block_map
        self.layout = layout
        self.concurrency = concurrency
        self.incarnations: dict[int, int] = {}
        self.next_seq: dict[int, int] = {}
        self.prompts = 0  # prompts stored so far (prompts 0 .. prompts-1)
        self.resends = 0  # batches sent again after the connection failed under them

    async def register(self) -> None:
        for n in range(self.layout.nodes):
            reg = await self.block_map.register_node(NodeInfo(
                self.layout.node_id(n), f"10.{n // 250}.{n % 250}.1:7000"))
            self.incarnations[n], self.next_seq[n] = reg.incarnation, 1

    async def _apply(self, batch: EventBatch) -> Ack:
        """Applies ``batch``, sent again (as a node's publisher does) when the connection failed under it: setting
        tier bits is idempotent and the sequence number is only taken at the end, so a resend is safe."""
        for attempt in range(1, WRITE_ATTEMPTS):
            try:
                return await self.block_map.apply_batch(batch)
            except errors.Unavailable:
                self.resends += 1
                await asyncio.sleep(0.1 * attempt)
        return await self.block_map.apply_batch(batch)

    async def sweep_one_node(self) -> dict:
        """Node 0 leaves (its slot is fenced at once); the garbage collection then frees its entries, sweeping every
        namespace's whole map (``sweep.lua`` over HSCAN chunks): its time is the sweep cost at this size."""
        await self.block_map.deregister_node(self.layout.node_id(0), self.incarnations[0])
        t0 = time.perf_counter()
        slots = await self.block_map.collect_garbage()
        return {"gc_sweep_s": round(time.perf_counter() - t0, 2), "gc_swept_slots": slots}

    async def store_until(self, prompts: int, window: int) -> None:
        """Stores prompts up to ``prompts``, ``window`` at a time: each node's batches (one per prompt it holds)
        in sequence order, ``concurrency`` nodes at once."""
        while self.prompts < prompts:
            last = min(prompts, self.prompts + window)
            hashes = {p: tuple(self.layout.prompt(p)) for p in range(self.prompts, last)}
            per_node: dict[int, list[int]] = defaultdict(list)
            for p in hashes:
                for n in self.layout.holders_of(p):
                    per_node[n].append(p)
            room = asyncio.Semaphore(self.concurrency)

            async def node_batches(n: int, mine: list[int]) -> None:
                async with room:
                    for p in mine:
                        batch = EventBatch(self.layout.node_id(n), self.incarnations[n], self.next_seq[n],
                                           self.layout.namespace(p),
                                           (Stored(hashes[p], Medium.CPU, BLOCK_SIZE),))
                        ack = await self._apply(batch)
                        if ack.status != AckStatus.APPLIED:
                            raise RuntimeError(f"{batch.node_id}: batch {batch.seq} answered {ack.status.name}")
                        self.next_seq[n] += 1

            async with asyncio.TaskGroup() as group:  # one failure cancels the others (no writes after close)
                for n, mine in per_node.items():
                    group.create_task(node_batches(n, mine))
            self.prompts = last


# ---- lookups ----

class Lookups:
    """Whole-prompt lookups, both ways, every answer checked: ``LookupPrefix`` on the control plane (gRPC, a
    scheduler key) and ``RedisBlockMap.lookup_prefix`` in this process."""

    def __init__(self, block_map: RedisBlockMap, stub: pb_grpc.ControlPlaneStub | None, layout: Layout) -> None:
        self.block_map = block_map
        self.stub = stub
        self.layout = layout
        self.left: set[int] = set()  # nodes that have left the fleet: holders no more

    def check(self, p: int, holders: list[tuple[str, int]]) -> None:
        expected = sorted((self.layout.node_id(n), self.layout.prompt_blocks) for n in self.layout.holders_of(p)
                          if n not in self.left)
        if sorted(holders) != expected:
            raise RuntimeError(f"a lookup of prompt {p} ({self.layout.prompt_blocks} blocks) expected "
                               f"{len(expected)} holders of all of them, found {sorted(holders)[:4]}...")

    async def direct(self, p: int) -> None:
        match = await self.block_map.lookup_prefix(self.layout.namespace(p), self.layout.prompt(p), ALL_TIERS)
        self.check(p, [(h.node_id, h.leading_blocks) for h in match.holders])

    async def rpc(self, p: int, timeout: float | None = None) -> None:
        reply = await self.stub.LookupPrefix(pb.LookupPrefixRequest(
            namespace=self.layout.namespace(p).to_proto(), block_hashes=self.layout.prompt(p)), timeout=timeout)
        self.check(p, [(h.node_id, h.leading_blocks) for h in reply.holders])

    async def measure(self, prompts: int, count: int, rng: random.Random) -> dict:
        """``count`` lookups of each kind, interleaved, of prompts drawn from the ``prompts`` stored; p50/p99 ms."""
        kinds = {"lookup": self.rpc, "direct_lookup": self.direct} if self.stub else {"direct_lookup": self.direct}
        latencies: dict[str, list[float]] = {k: [] for k in kinds}
        for i in range(count + count // 10):
            p = rng.randrange(prompts)
            for kind, call in kinds.items():
                t0 = time.perf_counter()
                await call(p)
                if i >= count // 10:  # the first tenth warms up
                    latencies[kind].append((time.perf_counter() - t0) * 1e3)
        out = {}
        for kind, values in latencies.items():
            out[f"{kind}_p50_ms"] = round(statistics.median(values), 3)
            out[f"{kind}_p99_ms"] = round(_pct(values, 0.99), 3)
        return out


# ---- failover ----

async def failover(backend: Backend, lookups: Lookups, p: int, timeout_s: float) -> dict:
    """Kills (SIGKILL) the primary holding prompt ``p``'s namespace; returns the seconds from the kill until a
    lookup of ``p`` answers in full again through this process's RedisBlockMap and through the control plane.
    Raises :class:`kvmesh.errors.Unavailable` (one line) when either has not recovered within ``timeout_s``."""
    victim = primary_for(backend, await lookups.block_map.blocks_key(lookups.layout.namespace(p)))
    await lookups.direct(p)  # both answer before the kill (the positive control)
    await lookups.rpc(p)
    victim.proc.kill()
    killed = time.perf_counter()
    deadline = killed + timeout_s

    async def until_answered(call) -> float | str:
        """Seconds from the kill to the first correct answer, or (past the deadline) the last failure."""
        last = "no attempt"
        while time.perf_counter() < deadline:
            try:
                await asyncio.wait_for(call(p), max(0.1, min(5.0, deadline - time.perf_counter())))
                return round(time.perf_counter() - killed, 3)
            except Exception as exc:  # noqa: BLE001 - any failure is "not yet recovered"; the last one is named
                last = f"{type(exc).__name__}: {str(exc)[:120]}"
                await asyncio.sleep(0.05)
        return last

    direct_s, rpc_s = await asyncio.gather(until_answered(lookups.direct), until_answered(lookups.rpc))
    for how, found in (("RedisBlockMap", direct_s), ("the control plane's LookupPrefix", rpc_s)):
        if isinstance(found, str):
            raise errors.Unavailable(
                f"lookups through {how} on the shard of primary 127.0.0.1:{victim.port} did not answer correctly "
                f"within {timeout_s:g} s of killing it (last: {found.splitlines()[0] if found else found}); "
                "is a replica of it running?")
    return {"failover_recovery_s": direct_s, "failover_recovery_rpc_s": rpc_s,
            "failover_killed_primary": f"127.0.0.1:{victim.port}"}


def primary_for(backend: Backend, key: str) -> RedisServer:
    """The cluster node serving ``key``'s slot as primary."""
    slot = key_slot(key.encode())
    with redis.Redis(port=backend.primaries()[0].port) as r:
        for start, end, (host, port, *_), *_replicas in r.execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return next(n for n in backend.primaries() if n.port == int(port))
    raise RuntimeError(f"no primary serves slot {slot}")


# ---- the in-memory replica (control_plane.replica) ----

async def replica_figures(url: str, lookups: Lookups, prompts: int, count: int, rng: random.Random) -> dict:
    """A cold :class:`BlockMapReplica` resynced from ``url`` (the map as it stands): how long the resync took, its
    memory per block (its own count, and this process's RSS growth as a cross-check) and the latency of whole-prompt
    lookups answered from it (each checked). Null figures and ``replica_unavailable`` when this install has none."""
    try:
        from control_plane.replica import BlockMapReplica
    except ImportError as exc:
        return {"replica_bytes_per_block": None, "replica_resync_s": None,
                "replica_unavailable": f"control_plane.replica is not in this install ({exc})"}
    replica = BlockMapReplica.from_url(url)
    try:
        rss0 = _rss_bytes()
        t0 = time.perf_counter()
        blocks = await replica.resync()
        resync_s = time.perf_counter() - t0
        rss = _rss_bytes() - rss0
        latencies = []
        for i in range(count + count // 10):
            p = rng.randrange(prompts)
            key, hashes = await lookups.block_map.blocks_key(lookups.layout.namespace(p)), lookups.layout.prompt(p)
            t0 = time.perf_counter()
            match = replica.lookup(key, hashes)
            elapsed = time.perf_counter() - t0
            if match is None:
                raise RuntimeError(f"the replica is not in sync with {key} after its resync")
            lookups.check(p, [(h.node_id, h.leading_blocks) for h in match.holders])
            if i >= count // 10:
                latencies.append(elapsed * 1e3)
        return {"replica_resync_s": round(resync_s, 2), "replica_blocks": blocks,
                "replica_bytes_per_block": round(replica.memory_bytes() / blocks, 1),
                "replica_rss_bytes_per_block": round(rss / blocks, 1),
                "replica_lookup_p50_ms": round(statistics.median(latencies), 3),
                "replica_lookup_p99_ms": round(_pct(latencies, 0.99), 3)}
    finally:
        await replica.close()


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@contextlib.asynccontextmanager
async def fleet(backend: Backend, *, namespaces: int, nodes: int, holders: int, prompt_blocks: int,
                concurrency: int) -> AsyncIterator[tuple[Writer, Lookups]]:
    """The tenant (created through the control plane), its namespaces (spread evenly over the shards), the nodes
    registered; yields the map's writer and its lookups."""
    block_map, tenants = backend.block_map()
    try:
        async with channel(backend.cp.address, await scheduler_key(backend.cp.address, backend.admin_key)) as ch:
            epoch = (await tenants.redis_credentials(TENANT))[2]
            layout = Layout(namespaces_for_epoch(namespaces, max(1, backend.shards), epoch), nodes, holders,
                            prompt_blocks)
            writer = Writer(block_map, layout, concurrency)
            await writer.register()
            yield writer, Lookups(block_map, pb_grpc.ControlPlaneStub(ch), layout)
    finally:
        await block_map.close()
        await tenants.close()


async def run_backend(backend: Backend, args, checkpoints: list[int], rng: random.Random) -> dict:
    async with fleet(backend, namespaces=args.namespaces, nodes=args.nodes, holders=args.holders,
                     prompt_blocks=args.prompt_blocks, concurrency=args.concurrency) as (writer, lookups):
        layout = writer.layout
        base = backend.used_memory()
        sizes, started = {}, time.perf_counter()
        for checkpoint in checkpoints:
            t0, script_s = time.perf_counter(), backend.script_seconds()
            await writer.store_until(layout.prompts_for(checkpoint), args.window)
            stored = writer.prompts * layout.prompt_blocks
            ingest_s = time.perf_counter() - t0
            entries = (stored - _prev(sizes)) * layout.holders
            script_s = backend.script_seconds() - script_s
            used = backend.used_memory()
            change_logs = backend.key_bytes([Keys.block_changes(await writer.block_map.blocks_key(ns))
                                             for ns in layout.namespaces])
            sizes[str(checkpoint)] = {
                "blocks": stored,
                **await lookups.measure(writer.prompts, args.lookups, rng),
                "redis_bytes_per_block": round((used - base) / stored, 1),
                "redis_map_bytes_per_block": round((used - base - change_logs) / stored, 1),
                "redis_change_log_bytes": change_logs,
                "redis_used_memory_bytes": used,
                "ingest_block_entries_per_s": round(entries / ingest_s),
                # Redis' own time per entry written (the batch scripts, summed over primaries): a shard's write capacity
                "redis_script_us_per_entry": round(script_s * 1e6 / entries, 2),
            }
            sizes[str(checkpoint)].update(await replica_figures(backend.url, lookups, writer.prompts, args.lookups, rng))
            print(f"{backend.name} {checkpoint}: {sizes[str(checkpoint)]}", file=sys.stderr, flush=True)
        out = {"sizes": sizes, "build_s": round(time.perf_counter() - started, 1),
               "namespaces": len(layout.namespaces), "nodes": layout.nodes, "holders_per_block": layout.holders,
               "prompt_blocks": layout.prompt_blocks, "batches_resent": writer.resends}
        out.update(await writer.sweep_one_node())
        lookups.left.add(0)
        if backend.cluster:
            out["shards"] = backend.shards
            out["replica_node_used_memory_bytes"] = backend.used_memory(backend.replicas())
            backend.wait_replicas_synced(args.failover_timeout_s)
            out.update(await failover(backend, lookups, 0, args.failover_timeout_s))
        return out


def _prev(sizes: dict) -> int:
    return list(sizes.values())[-1]["blocks"] if sizes else 0


def checkpoints_for(blocks: int, given: str | None) -> list[int]:
    if given:
        try:
            points = sorted({int(x) for x in given.split(",") if x.strip()})
        except ValueError:
            raise errors.InvalidArgument(f"--checkpoints {given!r} is not a list of block counts; give e.g. --checkpoints 100000,1000000") from None
        if not points or points[0] <= 0 or points[-1] > blocks:
            raise errors.InvalidArgument(f"--checkpoints {given!r} are not all in 1..{blocks}; give block counts up to --blocks")
        return points if points[-1] == blocks else [*points, blocks]
    return sorted({c for c in CHECKPOINTS if c < blocks} | {blocks})


def main(argv: list[str]) -> int:
    parser = Parser(prog="kvmesh bench scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    parser.add_argument("--blocks", type=positive_int, default=10_000_000, help="blocks in the full map")
    parser.add_argument("--checkpoints", help="block counts to measure at on the way (default 100000,1000000)")
    parser.add_argument("--nodes", type=positive_int, default=1000)
    parser.add_argument("--holders", type=positive_int, default=8, help="nodes holding each block")
    parser.add_argument("--prompt-blocks", type=positive_int, default=1024, help="blocks per prompt (and lookup)")
    parser.add_argument("--namespaces", type=positive_int, default=12)
    parser.add_argument("--shards", type=int, default=3, help="cluster primaries (0: one server only)")
    parser.add_argument("--cluster-only", action="store_true",
                        help="build the map on the cluster only (no single server): the two backends as two runs")
    parser.add_argument("--lookups", type=positive_int, default=300, help="lookups of each kind per checkpoint")
    parser.add_argument("--concurrency", type=positive_int, default=16, help="nodes writing at once")
    parser.add_argument("--window", type=positive_int, default=1500, help="prompts generated at a time")
    parser.add_argument("--failover-timeout-s", type=positive_float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.holders > args.nodes:
        raise errors.InvalidArgument(f"--holders {args.holders} exceeds --nodes {args.nodes}; give at most as many holders as nodes")
    if 0 < args.shards < 3:
        raise errors.InvalidArgument("--shards must be 0 (no cluster) or at least 3; a Redis Cluster needs 3 primaries")
    if args.cluster_only and not args.shards:
        raise errors.InvalidArgument("--cluster-only needs a cluster: give --shards 3 or more, or drop --cluster-only")
    checkpoints = checkpoints_for(args.blocks, args.checkpoints)
    find_redis_server()  # no server binary: one line now, before anything starts
    rng = random.Random(args.seed)
    started = time.perf_counter()
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-scale-") as tmp:
        for shards in ([args.shards] if args.cluster_only else [0, args.shards] if args.shards else [0]):
            backend = Backend(Path(tmp) / f"shards{shards}", shards)
            try:
                backend.start()
                result[backend.name] = asyncio.run(run_backend(backend, args, checkpoints, rng))
            finally:
                backend.stop()
    first = result.get("redis") or result["cluster"]  # the single server's figures, unless only the cluster ran
    out = {"sizes": first["sizes"], "sizes_backend": "redis" if "redis" in result else "cluster",
           "redis_bytes_per_block": list(first["sizes"].values())[-1]["redis_bytes_per_block"],
           **{k: v for k, v in list(first["sizes"].values())[-1].items() if k.startswith("replica_")},
           "failover_recovery_s": result.get("cluster", {}).get("failover_recovery_s"),
           "backends": result,
           "bench_max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
           "wall_s": round(time.perf_counter() - started)}
    if not args.json:
        print(json.dumps(out, indent=2))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(run_command("kvmesh bench scale", main, sys.argv[1:]))  # one line for any error, as `kvmesh` gives
