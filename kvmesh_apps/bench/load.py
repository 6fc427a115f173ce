"""``kvmesh bench load``: control-plane throughput at saturation, with replicas, and a churn soak.

Real redis-server (one server, then a 3-primary Redis Cluster) and real control-plane processes; the load
comes from client processes (``--clients``, each ``--concurrency`` calls in flight):

- saturation: ``LookupPrefix`` of 4,096-token prompts (128 blocks of 32, each held by 8 nodes), authenticated
  with a scheduler key, while ``--streams`` simulated nodes stream BlockStored / BlockRemoved batches into the
  same process; lookups/s and the p99 latency (hashes in ``packed_block_hashes``);
- on one replica, the floor (the same load of no-op RPCs), the same lookups on one ``LookupPrefixStream`` per
  client process, and on one ``LookupPrefixBatches`` per client process, ``--stream-batch`` lookups a message
  (at most ``--concurrency``; each lookup counted and its answer checked);
- the same load spread over 1, 2 and 4 replicas on one Redis, then on a Redis Cluster;
- a soak (``--soak-minutes``): nodes join, stream, evict, restart (new incarnation, full resync) and leave,
  with lookups alongside; the control plane's RSS and open fds and Redis' used_memory are sampled and
  reported as least-squares slopes per hour.

Every figure is measured; on a small machine the clients share the cores with the server (see the report's
``cpu`` section and docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import multiprocessing
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import redis

from kvmesh.command_line import (
    Parser, non_negative_float, non_negative_int, positive_float, positive_int, run_command,
)
from kvmesh.channels import channel
from kvmesh.grpc_server import channel_options
from kvmesh.v1 import common_pb2, control_plane_pb2 as pb, control_plane_pb2_grpc as pb_grpc
from kvmesh.v1 import tenant_admin_pb2, tenant_admin_pb2_grpc
from kvmesh_apps.procs import ServiceProcess, cpu_seconds
from kvmesh_apps.redis_server import RedisCluster, RedisServer
from tenancy.api_keys import new_key
from tenancy.auth import auth_metadata

BLOCK_SIZE = 32
PROMPT_BLOCKS = 4096 // BLOCK_SIZE
HOLDERS = 8
PROMPTS = 32
TENANT = "load"
# Simulated holders do not heartbeat while the load runs: a lease longer than the run keeps them live
# (the soak's churning nodes heartbeat, leave and re-register on their own).
LEASE_MS = 24 * 3_600_000
NS = common_pb2.Namespace(tenant=TENANT, model="load-model", weight_version="v1",
                          cache_config=common_pb2.CacheConfig(block_size=BLOCK_SIZE))


def prompt(i: int) -> list[bytes]:
    return [hashlib.sha256(f"prompt{i}:{b}".encode()).digest() for b in range(PROMPT_BLOCKS)]


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


# ---- load generators (child processes) ----

def _lookup_worker(address: str, key: str, seconds: float, concurrency: int,
                   seed: int, rate: float = 0.0, rpc: str = "lookup",
                   batch: int = 1) -> tuple[int, list[float], float, float]:
    """(calls, their latencies in ms, seconds of the measured window, this process's CPU seconds in it);
    ``rate`` > 0 paces them (per s). ``rpc`` "ping" drives the no-op RPC instead (the floor), "stream" the
    same lookups on one ``LookupPrefixStream`` per process with ``concurrency`` of them in flight, "batches"
    on one ``LookupPrefixBatches`` per process, ``batch`` (at most ``concurrency``) lookups a message and
    ``concurrency // batch`` messages in flight; every lookup of a batch counts as one call, its latency the
    batch's.

    The generator is kept cheap so that it measures the server: a plain channel with the key as call metadata
    (client interceptors cost a task per call), requests built once, ``concurrency`` calls in flight on one
    channel. Every lookup's answer is still checked."""

    async def run() -> tuple[int, list[float], float, float]:
        requests = [pb.LookupPrefixRequest(namespace=NS, packed_block_hashes=b"".join(prompt(i)))
                    for i in range(PROMPTS)]
        ping = common_pb2.PingRequest()
        metadata = auth_metadata(key)
        rng = random.Random(seed)
        latencies: list[float] = []
        async with grpc.aio.insecure_channel(address, options=channel_options()) as ch:
            stub = pb_grpc.ControlPlaneStub(ch)
            await stub.Ping(ping, timeout=10, metadata=metadata)
            cpu0 = _own_cpu_s()
            start = time.perf_counter()
            deadline = start + seconds

            async def streamed() -> None:
                """Writes while fewer than ``concurrency`` are unanswered; answers come back in request order."""
                call = stub.LookupPrefixStream(metadata=metadata)
                room = asyncio.Semaphore(concurrency)
                sent: collections.deque[float] = collections.deque()

                async def write() -> None:
                    while time.perf_counter() < deadline:
                        await room.acquire()
                        sent.append(time.perf_counter())
                        await call.write(rng.choice(requests))
                    await call.done_writing()

                writer = asyncio.ensure_future(write())
                while (reply := await call.read()) is not grpc.aio.EOF:
                    if not reply.holders or reply.holders[0].leading_blocks != PROMPT_BLOCKS:
                        raise RuntimeError("a lookup did not find the prompt held in full")
                    latencies.append((time.perf_counter() - sent.popleft()) * 1000)
                    room.release()
                await writer

            async def batched() -> None:
                """As streamed(), ``batch`` lookups a message; every answer of every batch checked."""
                call = stub.LookupPrefixBatches(metadata=metadata)
                room = asyncio.Semaphore(concurrency // batch)
                sent: collections.deque[float] = collections.deque()

                async def write() -> None:
                    while time.perf_counter() < deadline:
                        await room.acquire()
                        sent.append(time.perf_counter())
                        await call.write(pb.LookupPrefixBatch(lookups=rng.choices(requests, k=batch)))
                    await call.done_writing()

                writer = asyncio.ensure_future(write())
                while (reply := await call.read()) is not grpc.aio.EOF:
                    if len(reply.answers) != batch or any(
                            not a.holders or a.holders[0].leading_blocks != PROMPT_BLOCKS for a in reply.answers):
                        raise RuntimeError("a batched lookup did not find the prompt held in full")
                    latencies.extend([(time.perf_counter() - sent.popleft()) * 1000] * batch)
                    room.release()
                await writer

            async def loop() -> None:
                while time.perf_counter() < deadline:
                    if rate:
                        await asyncio.sleep(max(0.0, start + len(latencies) / rate - time.perf_counter()))
                    t0 = time.perf_counter()
                    if rpc == "ping":
                        await stub.Ping(ping, timeout=30, metadata=metadata)
                    else:
                        reply = await stub.LookupPrefix(rng.choice(requests), timeout=30, metadata=metadata)
                        if not reply.holders or reply.holders[0].leading_blocks != PROMPT_BLOCKS:
                            raise RuntimeError("a lookup did not find the prompt held in full")
                    latencies.append((time.perf_counter() - t0) * 1000)

            if rpc == "stream":
                await streamed()
            elif rpc == "batches":
                await batched()
            else:
                await asyncio.gather(*(loop() for _ in range(concurrency)))
            window = time.perf_counter() - start
            cpu = _own_cpu_s() - cpu0
        return len(latencies), latencies, window, cpu

    return asyncio.run(run())


def stream_batch(args) -> int:
    """Lookups a LookupPrefixBatches message: --stream-batch, but no more than the lookups in flight."""
    return min(args.stream_batch, args.concurrency)


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _stream_worker(address: str, key: str, seconds: float, nodes: int, rate: float, seed: int) -> int:
    """``nodes`` simulated nodes, each storing then evicting batches of 32 blocks, ``rate`` batches/s each;
    returns the batches sent."""

    async def one(stub, node_id: str) -> int:
        reply = await stub.RegisterNode(pb.RegisterNodeRequest(
            node=pb.NodeInfo(node_id=node_id, data_plane_address="10.0.0.1:7000")), timeout=30)
        inc, seq, sent = reply.incarnation, reply.next_seq - 1, 0
        deadline = time.perf_counter() + seconds
        queue: asyncio.Queue = asyncio.Queue(maxsize=4)

        async def batches():
            while True:
                item = await queue.get()
                if item is None:
                    return
                yield item

        call = stub.StreamEvents(batches(), timeout=seconds + 60)

        async def produce() -> None:
            nonlocal seq, sent
            i = 0
            start = time.perf_counter()
            while time.perf_counter() < deadline:
                await asyncio.sleep(max(0.0, start + sent / rate - time.perf_counter()))
                hashes = [hashlib.sha256(f"{node_id}:{i}:{b}".encode()).digest() for b in range(32)]
                for event in (pb.KvEvent(stored=pb.BlockStored(block_hashes=hashes, block_size=BLOCK_SIZE,
                                                                medium=common_pb2.MEDIUM_CPU)),
                              pb.KvEvent(removed=pb.BlockRemoved(block_hashes=hashes))):
                    seq += 1
                    await queue.put(pb.EventBatch(node_id=node_id, incarnation=inc, seq=seq, namespace=NS,
                                                  events=[event]))
                    sent += 1
                i += 1
            await queue.put(None)

        producer = asyncio.create_task(produce())
        async for ack in call:
            if ack.status not in (pb.ACK_STATUS_APPLIED, pb.ACK_STATUS_DUPLICATE):
                raise RuntimeError(f"{node_id}: batch {ack.seq} answered {ack.status}")
        await producer
        return sent

    async def run() -> int:
        async with channel(address, key) as ch:
            stub = pb_grpc.ControlPlaneStub(ch)
            return sum(await asyncio.gather(*(one(stub, f"sim-{seed}-{n}") for n in range(nodes))))

    return asyncio.run(run())


# ---- the fleet ----

class Backend:
    """Redis (one server or a cluster) and control-plane replicas on it."""

    def __init__(self, workdir: Path, cluster: bool) -> None:
        self.redis = (RedisCluster(workdir / "cluster", masters=3) if cluster
                      else RedisServer(workdir / "redis", extra_args=["--appendonly", "no"]))
        self.admin_key = new_key()[1]
        self.replicas: list[ServiceProcess] = []
        self.workdir = workdir

    def start(self) -> "Backend":
        self.redis.start()
        return self

    def scale(self, n: int) -> list[str]:
        while len(self.replicas) < n:
            self.replicas.append(ServiceProcess(
                ["control-plane", "--listen", "127.0.0.1:0", "--redis-url", self.redis.url,
                 "--lease-ms", str(LEASE_MS)],
                env={"KVMESH_CP_ADMIN_KEY": self.admin_key},
                log_path=self.workdir / f"cp{len(self.replicas)}.log").start())
        return [r.address for r in self.replicas[:n]]

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()
        self.redis.stop()

    def redis_pids(self) -> list[int]:
        nodes = self.redis.nodes if isinstance(self.redis, RedisCluster) else [self.redis]
        return [n.proc.pid for n in nodes]

    def redis_memory(self) -> int:
        nodes = self.redis.nodes if isinstance(self.redis, RedisCluster) else [self.redis]
        total = 0
        for node in nodes:
            client = redis.Redis(port=node.port)
            total += client.info("memory")["used_memory"]
            client.close()
        return total


async def prepare(address: str, admin_key: str) -> str:
    """Tenant, scheduler key, and PROMPTS prompts of 128 blocks held by HOLDERS nodes; returns the key."""
    async with channel(address, admin_key) as ch:
        admin = tenant_admin_pb2_grpc.TenantAdminStub(ch)
        await admin.CreateTenant(tenant_admin_pb2.CreateTenantRequest(tenant_id=TENANT))
        key = (await admin.IssueKey(tenant_admin_pb2.IssueKeyRequest(role=tenant_admin_pb2.ROLE_SCHEDULER,
                                                                     tenant_id=TENANT))).secret
        stub = pb_grpc.ControlPlaneStub(ch)
        for n in range(HOLDERS):
            node_id = f"holder-{n}"
            reply = await stub.RegisterNode(pb.RegisterNodeRequest(
                node=pb.NodeInfo(node_id=node_id, data_plane_address=f"10.0.1.{n}:7000")))
            batches = [pb.EventBatch(node_id=node_id, incarnation=reply.incarnation, seq=reply.next_seq + i,
                                     namespace=NS, events=[pb.KvEvent(stored=pb.BlockStored(
                                         block_hashes=prompt(i), block_size=BLOCK_SIZE,
                                         medium=common_pb2.MEDIUM_CPU))]) for i in range(PROMPTS)]
            await stub.PublishEvents(batches[0])
            for b in batches[1:]:
                await stub.PublishEvents(b)
        return key


def saturate(pool, addresses: list[str], key: str, admin_key: str, args, backend: "Backend",
             rpc: str = "lookup") -> dict:
    """Lookups (``rpc`` "stream": on lookup streams; "ping": no-op RPCs instead) from ``args.clients`` processes over ``addresses`` with event
    streams alongside; with the CPU the control-plane replicas, Redis and the clients used per call (what
    bounds throughput on a small machine)."""
    cp_pids = [r.proc.pid for r in backend.replicas if r.address in addresses]
    redis_pids = backend.redis_pids()
    cpu0 = (sum(map(cpu_seconds, cp_pids)), sum(map(cpu_seconds, redis_pids)))
    streams = [pool.apply_async(_stream_worker, (addresses[0], admin_key, args.seconds + 1, args.streams,
                                                 args.stream_rate, s))
               for s in range(1)] if args.streams else []
    calls = [pool.apply_async(_lookup_worker, (addresses[i % len(addresses)], key, args.seconds,
                                               args.concurrency, i, 0.0, rpc, stream_batch(args)))
             for i in range(args.clients)]
    t0 = time.perf_counter()
    results = [r.get(args.seconds + 120) for r in calls]
    elapsed = time.perf_counter() - t0
    batches = sum(r.get(args.seconds + 120) for r in streams)
    latencies = [x for _, lat, _, _ in results for x in lat]
    cp_cpu, redis_cpu = sum(map(cpu_seconds, cp_pids)) - cpu0[0], sum(map(cpu_seconds, redis_pids)) - cpu0[1]
    client_cpu = sum(cpu for _, _, _, cpu in results)
    done = max(1, len(latencies))
    what = {"lookup": "lookup", "stream": "stream_lookup", "batches": "batched_stream_lookup", "ping": "noop"}[rpc]
    return {f"{what}s_per_s": round(sum(n / window for n, _, window, _ in results), 1),
            f"control_plane_cpu_ms_per_{what}": round(cp_cpu * 1000 / done, 3),
            f"redis_cpu_ms_per_{what}": round(redis_cpu * 1000 / done, 3),
            f"client_cpu_ms_per_{what}": round(client_cpu * 1000 / done, 3),
            "control_plane_cores_busy": round(cp_cpu / elapsed, 2), "redis_cores_busy": round(redis_cpu / elapsed, 2),
            "client_cores_busy": round(client_cpu / elapsed, 2),
            "p50_ms": round(statistics.median(latencies), 2) if latencies else None,
            "p99_ms": round(_pct(latencies, 0.99), 2), "event_batches_per_s": round(batches / elapsed, 1)}


def measure_backend(workdir: Path, cluster: bool, pool, args) -> dict:
    backend = Backend(workdir, cluster).start()
    try:
        addresses = backend.scale(max(args.replicas))
        key = asyncio.run(prepare(addresses[0], backend.admin_key))
        out = {}
        for n in args.replicas:
            out[str(n)] = saturate(pool, addresses[:n], key, backend.admin_key, args, backend)
            print(f"{'cluster' if cluster else 'redis'} x{n}: {out[str(n)]}", file=sys.stderr, flush=True)
        if not cluster:  # the floor: the same load of no-op RPCs on one replica (same clients, same streams)
            out["noop"] = saturate(pool, addresses[:1], key, backend.admin_key, args, backend, rpc="ping")
            print(f"redis x1 no-op: {out['noop']}", file=sys.stderr, flush=True)
            # the same lookups on one LookupPrefixStream per client process (same clients, same in flight)
            out["stream"] = saturate(pool, addresses[:1], key, backend.admin_key, args, backend, rpc="stream")
            print(f"redis x1 stream: {out['stream']}", file=sys.stderr, flush=True)
            # the same lookups, --stream-batch a message on one LookupPrefixBatches per client process
            out["batches"] = saturate(pool, addresses[:1], key, backend.admin_key, args, backend, rpc="batches")
            print(f"redis x1 batched stream: {out['batches']}", file=sys.stderr, flush=True)
        return out
    except Exception:  # a failed call: say what the replicas logged (their logs vanish with the workdir)
        for log in sorted(workdir.glob("cp*.log")):
            errors = [line for line in log.read_text().splitlines() if "ERROR" in line or "Error" in line]
            if errors:
                print(f"{log.name}:\n" + "\n".join(errors[-20:]), file=sys.stderr, flush=True)
        raise
    finally:
        backend.stop()


# ---- soak ----

def _proc_stats(pid: int) -> tuple[float, int]:
    rss_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def slope_per_hour(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) samples, per hour."""
    if len(samples) < 2:
        return 0.0
    ts = [t for t, _ in samples]
    vs = [v for _, v in samples]
    mt, mv = statistics.fmean(ts), statistics.fmean(vs)
    den = sum((t - mt) ** 2 for t in ts)
    return 0.0 if den == 0 else sum((t - mt) * (v - mv) for t, v in zip(ts, vs)) / den * 3600


async def churn(address: str, admin_key: str, seconds: float, nodes: int, seed: int, rate: float) -> dict:
    """Simulated nodes join, stream, evict, restart and leave for ``seconds``, ``rate`` actions/s; counts each."""
    rng = random.Random(seed)
    counts = {"join": 0, "evict": 0, "restart": 0, "leave": 0, "stored_blocks": 0, "register_refused": 0}
    live: dict[str, tuple[int, int, list[list[bytes]]]] = {}  # node -> (incarnation, seq, runs)
    async with channel(address, admin_key) as ch:
        stub = pb_grpc.ControlPlaneStub(ch)

        async def publish(node_id: str, events: list) -> None:
            inc, seq, runs = live[node_id]
            seq += 1
            await stub.PublishEvents(pb.EventBatch(node_id=node_id, incarnation=inc, seq=seq, namespace=NS,
                                                   events=events), timeout=10)
            live[node_id] = (inc, seq, runs)

        async def join(node_id: str) -> bool:
            """Registers (again) and streams a snapshot; False when the control plane refused (the node
            re-registered faster than garbage collection retires its old slots: a real node retries later)."""
            try:
                reply = await stub.RegisterNode(pb.RegisterNodeRequest(
                    node=pb.NodeInfo(node_id=node_id, data_plane_address="10.0.2.1:7000")), timeout=10)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                counts["register_refused"] += 1
                return False
            runs = [[hashlib.sha256(f"{node_id}:{rng.random()}:{b}".encode()).digest() for b in range(64)]
                    for _ in range(4)]
            live[node_id] = (reply.incarnation, reply.next_seq - 1, runs)
            for run in runs:  # the snapshot a (re)started node streams
                await publish(node_id, [pb.KvEvent(stored=pb.BlockStored(
                    block_hashes=run, block_size=BLOCK_SIZE, medium=common_pb2.MEDIUM_CPU))])
                counts["stored_blocks"] += len(run)
            return True

        start = time.monotonic()
        deadline = start + seconds
        pool = [f"churn-{seed}-{i}" for i in range(nodes)]
        actions = 0
        while time.monotonic() < deadline:
            await asyncio.sleep(max(0.0, start + actions / rate - time.monotonic()))
            actions += 1
            node_id = rng.choice(pool)
            if node_id not in live:
                counts["join"] += await join(node_id)
                continue
            action = rng.choices(["evict", "restart", "leave", "heartbeat"], [5, 2, 2, 3])[0]
            inc, seq, runs = live[node_id]
            if action == "evict":
                victim = runs.pop(rng.randrange(len(runs))) if runs else []
                if victim:
                    await publish(node_id, [pb.KvEvent(removed=pb.BlockRemoved(block_hashes=victim))])
                fresh = [hashlib.sha256(f"{node_id}:{rng.random()}:{b}".encode()).digest() for b in range(64)]
                runs.append(fresh)
                await publish(node_id, [pb.KvEvent(stored=pb.BlockStored(
                    block_hashes=fresh, block_size=BLOCK_SIZE, medium=common_pb2.MEDIUM_CPU))])
                counts["evict"] += 1
                counts["stored_blocks"] += len(fresh)
            elif action == "restart":
                counts["restart"] += await join(node_id)  # a new incarnation fences the old one's entries
            elif action == "leave":
                await stub.DeregisterNode(pb.DeregisterNodeRequest(node_id=node_id, incarnation=inc), timeout=10)
                del live[node_id]
                counts["leave"] += 1
            else:
                await stub.Heartbeat(pb.HeartbeatRequest(node_id=node_id, incarnation=inc), timeout=10)
    return counts


def soak(workdir: Path, pool, args) -> dict:
    backend = Backend(workdir / "soak", cluster=False).start()
    try:
        (address,) = backend.scale(1)
        key = asyncio.run(prepare(address, backend.admin_key))
        seconds = args.soak_minutes * 60
        pid = backend.replicas[0].proc.pid
        job = pool.apply_async(_churn_process, (address, backend.admin_key, seconds, args.soak_nodes,
                                                args.churn_rate))
        lookups = pool.apply_async(_lookup_worker, (address, key, seconds, 2, 99, args.soak_lookup_rate))
        # Sampled on a fixed schedule, every 10 s (or a twelfth of a short soak, so even the CI's has a dozen).
        rss, fds, mem = [], [], []
        t0 = time.monotonic()
        interval = min(10.0, seconds / 12)
        while not job.ready():
            t = time.monotonic() - t0
            r, f = _proc_stats(pid)
            rss.append((t, r))
            fds.append((t, f))
            mem.append((t, backend.redis_memory() / (1 << 20)))
            job.wait(max(0.0, t0 + len(rss) * interval - time.monotonic()))
        counts = job.get()
        lookups.get(seconds + 120)
        # The slopes leave out the first tenth: caches, pools and the first registrations warm up there. They
        # are least-squares fits over every later sample; first/last/max of those samples say whether a slope is
        # a trend or one step (a pool opening one more connection reads as a slope over a short window).
        warmup = seconds * 0.1
        series = {"rss_mib": rss, "redis_mib": mem, "fds": fds}
        warm = {name: [s for s in samples if s[0] >= warmup] for name, samples in series.items()}

        def summary(samples: list[tuple[float, float]], digits: int) -> dict:
            values = [round(v, digits) for _, v in samples]
            return {"first": values[0], "last": values[-1], "max": max(values)} if values else {}

        return {"minutes": args.soak_minutes,
                "rss_slope_mib_per_h": round(slope_per_hour(warm["rss_mib"]), 2),
                "redis_slope_mib_per_h": round(slope_per_hour(warm["redis_mib"]), 2),
                "fd_slope_per_h": round(slope_per_hour(warm["fds"]), 2),
                "rss_mib": [round(rss[0][1], 1), round(rss[-1][1], 1)],
                "redis_mib": [round(mem[0][1], 2), round(mem[-1][1], 2)],
                "fds": [fds[0][1], fds[-1][1]], "samples": len(rss),
                "after_warmup": {"warmup_s": round(warmup, 1), "interval_s": round(interval, 2),
                                 "samples": len(warm["fds"]), "rss_mib": summary(warm["rss_mib"], 1),
                                 "redis_mib": summary(warm["redis_mib"], 2), "fds": summary(warm["fds"], 0)},
                "churn": counts}
    finally:
        backend.stop()


def _churn_process(address: str, admin_key: str, seconds: float, nodes: int, rate: float) -> dict:
    return asyncio.run(churn(address, admin_key, seconds, nodes, seed=7, rate=rate))


def main(argv: list[str]) -> int:
    parser = Parser(prog="kvmesh bench load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    parser.add_argument("--seconds", type=positive_float, default=8.0, help="length of each saturation run")
    parser.add_argument("--clients", type=positive_int, default=3, help="lookup client processes")
    parser.add_argument("--concurrency", type=positive_int, default=32, help="lookups in flight per client process")
    parser.add_argument("--streams", type=non_negative_int, default=16,
                        help="simulated nodes streaming events meanwhile")
    parser.add_argument("--stream-batch", type=positive_int, default=32,
                        help="lookups per LookupPrefixBatches message (the batched stream run; at most --concurrency)")
    parser.add_argument("--stream-rate", type=positive_float, default=10.0, help="event batches/s per simulated node")
    parser.add_argument("--replicas", type=lambda s: [positive_int(x) for x in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--soak-minutes", type=non_negative_float, default=10.0)
    parser.add_argument("--soak-nodes", type=positive_int, default=24, help="simulated nodes the churn cycles through")
    parser.add_argument("--churn-rate", type=positive_float, default=50.0, help="soak: churn actions per second")
    parser.add_argument("--soak-lookup-rate", type=positive_float, default=100.0, help="soak: lookups per second")
    parser.add_argument("--no-cluster", action="store_true", help="skip the Redis Cluster runs")
    parser.add_argument("--soak-only", action="store_true", help="skip the saturation runs")
    args = parser.parse_args(argv)

    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="kvmesh-load-") as tmp, \
            ctx.Pool(args.clients + 2) as pool:
        workdir = Path(tmp)
        pool.map(cpu_seconds, [os.getpid()] * (args.clients + 2))  # start the workers before anything is timed
        single = {} if args.soak_only else measure_backend(workdir / "single", False, pool, args)
        cluster = {} if args.no_cluster or args.soak_only else measure_backend(workdir / "cluster", True, pool, args)
        soaked = soak(workdir, pool, args) if args.soak_minutes > 0 else {}
    noop = single.pop("noop", None)
    streamed = single.pop("stream", None)
    batched = single.pop("batches", None)
    first = single.get(str(args.replicas[0]), {})
    result = {
        "lookups_per_s": {n: r["lookups_per_s"] for n, r in single.items()},
        "lookup_p99_ms_at_saturation": first.get("p99_ms"),
        "lookup_p50_ms_at_saturation": first.get("p50_ms"),
        "control_plane_cpu_ms_per_lookup": first.get("control_plane_cpu_ms_per_lookup"),
        "stream_lookups_per_s": streamed and streamed["stream_lookups_per_s"],
        "stream_lookup_p99_ms_at_saturation": streamed and streamed["p99_ms"],
        "control_plane_cpu_ms_per_stream_lookup": streamed and streamed["control_plane_cpu_ms_per_stream_lookup"],
        "batched_stream_lookups_per_s": batched and batched["batched_stream_lookups_per_s"],
        "batched_stream_lookup_p99_ms_at_saturation": batched and batched["p99_ms"],
        "control_plane_cpu_ms_per_batched_stream_lookup":
            batched and batched["control_plane_cpu_ms_per_batched_stream_lookup"],
        "stream_batch_lookups": stream_batch(args),
        "cluster": {"lookups_per_s": {n: r["lookups_per_s"] for n, r in cluster.items()},
                    "lookup_p99_ms_at_saturation": cluster[str(args.replicas[0])]["p99_ms"] if cluster else None},
        "soak": soaked,
        "floor": noop and {"noops_per_s": noop["noops_per_s"],
                           "control_plane_cpu_ms_per_noop": noop["control_plane_cpu_ms_per_noop"],
                           "client_cpu_ms_per_noop": noop["client_cpu_ms_per_noop"]},
        "detail": {"single": single, "cluster": cluster, "noop": noop, "stream": streamed, "batches": batched},
        "load": {"clients": args.clients, "concurrency": args.concurrency, "streams": args.streams, "stream_batches_per_s_per_node": args.stream_rate,
                 "soak_churn_actions_per_s": args.churn_rate, "soak_lookups_per_s": args.soak_lookup_rate,
                 "prompt_blocks": PROMPT_BLOCKS, "holders": HOLDERS, "seconds": args.seconds,
                 "cpus": os.cpu_count()},
    }
    if not args.json:
        for key, value in result.items():
            print(f"{key:>30}: {value}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_command("kvmesh bench load", main, sys.argv[1:]))  # one line for any error, as `kvmesh` gives
