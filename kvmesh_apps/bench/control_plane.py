"""``kvmesh bench control-plane``: lookup latency, where it goes, ingest rate and Redis bytes per block.

A real redis-server and a real control-plane process; this process is the client. Seven calls are measured
interleaved, one at a time, over the same kind of client channel (the scheduler key as call metadata), so load
drift hits all alike and their differences compare like with like:

- to a *bare* grpc.aio server in a process of its own (kvmesh's server options, no kvmesh interceptor or code):
  a no-op ``Ping``, what gRPC in Python costs on this machine with zero application work; and a call whose
  handler awaits one Redis round trip (redis-py's asyncio client), what any handler that reads Redis pays;
- the control plane's gRPC health ``Check`` (auth-exempt: kvmesh's interceptors, authentication, metrics and
  the decode guard, all pass ``/grpc.*`` methods through) and its authenticated ``Ping``: their difference bounds
  what authentication costs a call (the other interceptors included);
- ``LookupPrefix`` of the full prompt (1,024 blocks by default) and of its first block, each held by every node,
  their hashes in ``packed_block_hashes`` (one field); and of the full prompt with the same hashes as the
  repeated ``block_hashes`` (``lookup_repeated_*``: what decoding 1,024 separate hashes costs).

Then, one call at a time again, where a call's cost goes: the server's CPU per call of each kind and Redis' own
time per lookup (the script; none while lookups are answered from the control plane's in-memory replica).

And the replica on its own (control_plane/replica.py), in a process of its own as a scheduler or a control plane
embeds it: its in-process lookup of the prompt (``replica_lookup_p50_us``), its lag behind Redis while every node
streams the bulk ingest (``replica_lag_p99_ms``: Redis' clock at the change to the replica's clock at applying
it) and its memory per block held by every node (``replica_bytes_per_block``: its arrays and interned values;
``replica_rss_bytes_per_block``: the process's RSS growth over the same blocks). The registered nodes heartbeat every third of their lease while the bench runs, as a
real node's publisher does, so they stay holders however long it runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing
import platform
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import grpc
import redis
import redis.asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.command_line import Parser, positive_int, run_command
from kvmesh.channels import channel
from kvmesh.grpc_server import server_options
from kvmesh_apps.procs import ServiceProcess, cpu_seconds
from kvmesh.redis_keys import Keys
from kvmesh_apps.redis_server import RedisServer
from kvmesh.v1 import common_pb2, control_plane_pb2 as pb, control_plane_pb2_grpc as pb_grpc
from kvmesh.v1 import tenant_admin_pb2, tenant_admin_pb2_grpc
from tenancy.api_keys import new_key

BLOCK_SIZE = 32
BLOCK_HASH_BYTES = 32  # sha256, the namespace's default
NS = common_pb2.Namespace(tenant="bench", model="bench-model", weight_version="v1",
                          cache_config=common_pb2.CacheConfig(block_size=BLOCK_SIZE))


def _hashes(n: int, tag: str) -> list[bytes]:
    return [hashlib.sha256(f"{tag}:{i}".encode()).digest() for i in range(n)]


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class LiveNodes:
    """The bench's simulated nodes: registered, then heartbeated every third of the lease the control plane
    grants (as ``control_plane.publisher.EventPublisher`` does) until the bench ends, so their entries stay
    live however long it runs. A failed heartbeat is kept and named by :meth:`check`."""

    def __init__(self, stub: pb_grpc.ControlPlaneStub) -> None:
        self._stub = stub
        self._lock = asyncio.Lock()  # a registration and a round of heartbeats never interleave
        self.nodes: list[tuple[str, int]] = []
        self.lease_ms = 0
        self.heartbeats = 0  # rounds, one heartbeat per node each
        self.error: str | None = None
        self._task: asyncio.Task | None = None

    async def register(self, count: int) -> list[tuple[str, int]]:
        """(Re-)registers ``count`` nodes (new incarnations); returns (node_id, incarnation) pairs."""
        async with self._lock:
            nodes = []
            for i in range(count):
                reply = await self._stub.RegisterNode(pb.RegisterNodeRequest(
                    node=pb.NodeInfo(node_id=f"bench-node-{i}", data_plane_address=f"127.0.0.1:{20000 + i}")))
                nodes.append((f"bench-node-{i}", reply.incarnation))
                self.lease_ms = reply.lease_ms
            self.nodes = nodes
        if self._task is None:
            self._task = asyncio.create_task(self._beat(), name="bench-heartbeats")
        return nodes

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            async with self._lock:
                try:
                    await asyncio.gather(*(self._stub.Heartbeat(
                        pb.HeartbeatRequest(node_id=node_id, incarnation=inc), timeout=self.lease_ms / 1000)
                        for node_id, inc in self.nodes))
                except grpc.aio.AioRpcError as exc:
                    self.error = f"{exc.code().name}: {exc.details()}"
                    return
                self.heartbeats += 1

    def check(self) -> None:
        if self.error:
            raise RuntimeError(f"a bench node's heartbeat failed ({self.error}); lease {self.lease_ms} ms")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def check_lookup(reply: pb.LookupPrefixResponse, blocks: int, nodes: LiveNodes) -> None:
    """Every node holds every block looked up; anything else is a clear error, not an IndexError."""
    found = sorted(h.leading_blocks for h in reply.holders)
    if found != [blocks] * len(nodes.nodes):
        nodes.check()
        raise RuntimeError(f"a lookup of {blocks} blocks expected {len(nodes.nodes)} holders of all of them, found "
                           f"{len(found)} holding {found or 'nothing'} (node lease {nodes.lease_ms} ms, "
                           f"{nodes.heartbeats} heartbeat rounds so far)")


async def ingest(stub, nodes: list[tuple[str, int]], hashes: list[bytes], batch_blocks: int) -> float:
    """Every node streams BlockStored for all ``hashes``; returns block events per second."""

    async def one(node_id: str, inc: int, first_seq: int) -> int:
        async def batches():
            seq = first_seq
            for start in range(0, len(hashes), batch_blocks):
                yield pb.EventBatch(node_id=node_id, incarnation=inc, seq=seq, namespace=NS, events=[
                    pb.KvEvent(stored=pb.BlockStored(block_hashes=hashes[start:start + batch_blocks],
                                                     block_size=BLOCK_SIZE, medium=common_pb2.MEDIUM_CPU))])
                seq += 1

        applied = 0
        async for ack in stub.StreamEvents(batches()):
            if ack.status != pb.ACK_STATUS_APPLIED:
                raise RuntimeError(f"{node_id}: batch {ack.seq} not applied: {ack}")
            applied += ack.blocks_applied
        return applied

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(node_id, inc, 1) for node_id, inc in nodes))
    return sum(counts) / (time.perf_counter() - start)


class _BareServicer(pb_grpc.ControlPlaneServicer):
    """``Ping`` answers at once; ``LookupPrefix`` makes one Redis round trip (a PING, redis-py's asyncio client)
    and answers an empty match: what a handler that awaits Redis once costs, with no kvmesh code."""

    def __init__(self, redis_url: str) -> None:
        self._redis = redis.asyncio.Redis.from_url(redis_url)

    async def Ping(self, request, context):
        return common_pb2.PingResponse()

    async def LookupPrefix(self, request, context):
        await self._redis.ping()
        return pb.LookupPrefixResponse()


def _serve_bare(ports: multiprocessing.Queue, redis_url: str) -> None:
    """A grpc.aio server with kvmesh's server options and nothing else: no interceptor, no health or reflection
    service, the :class:`_BareServicer`. Puts its port on ``ports``, serves until killed."""

    async def serve() -> None:
        server = grpc.aio.server(options=server_options())
        pb_grpc.add_ControlPlaneServicer_to_server(_BareServicer(redis_url), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ports.put(port)
        await server.wait_for_termination()

    asyncio.run(serve())


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _replica_probe(redis_url: str, prompt_blocks: int, commands: multiprocessing.Queue,
                   results: multiprocessing.Queue) -> None:
    """An in-memory replica in a process of its own: "load" loads it (every namespace) and times lookups of the
    prompt; "lag" starts the lag sample afresh; "report" waits for ``blocks`` blocks and reports lag and memory."""
    from control_plane.replica import BlockMapReplica

    async def run() -> None:
        loop = asyncio.get_running_loop()
        rss0 = _rss_bytes()
        replica = BlockMapReplica.from_url(redis_url)
        await replica.resync()
        (blocks_key,) = [k.decode() for k in redis.Redis.from_url(redis_url).smembers(Keys().namespaces)]
        prompt = _hashes(prompt_blocks, "prompt")
        latencies = []
        for _ in range(1000):
            t0 = time.perf_counter()
            match = replica.lookup(blocks_key, prompt)
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0)  # the replica's followers run between lookups (heartbeats keep leases live)
        results.put({"replica_lookup_p50_us": round(statistics.median(latencies) * 1e6, 1),
                     "replica_lookup_p99_us": round(_pct(latencies, 0.99) * 1e6, 1),
                     "replica_lookup_holders": len(match.holders), "replica_lookup_longest": match.longest})
        while True:
            command = await loop.run_in_executor(None, commands.get)
            if command == "lag":
                replica.lag_ms.clear()
                results.put("ok")
                continue
            blocks = command
            deadline = time.monotonic() + 120
            while replica.block_count() < blocks and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            lag = list(replica.lag_ms)
            results.put({"replica_lag_p50_ms": round(statistics.median(lag), 1) if lag else None,
                         "replica_lag_p99_ms": round(_pct(lag, 0.99), 1) if lag else None,
                         "replica_lag_samples": len(lag),
                         "replica_blocks": replica.block_count(),
                         "replica_bytes_per_block": round(replica.memory_bytes() / max(replica.block_count(), 1), 1),
                         "replica_rss_bytes_per_block": round((_rss_bytes() - rss0) / max(replica.block_count(), 1),
                                                              1),
                         "replica_resyncs": replica.resyncs})
            await replica.close()
            return

    asyncio.run(run())


class _Calls:
    """The seven calls the bench compares: ``calls[kind]()`` makes one, ``check(kind, reply)`` checks its answer."""

    def __init__(self, bare: grpc.aio.Channel, sched: grpc.aio.Channel, prompt: list[bytes], nodes: LiveNodes):
        bare_stub, stub = pb_grpc.ControlPlaneStub(bare), pb_grpc.ControlPlaneStub(sched)
        health = health_pb2_grpc.HealthStub(sched)
        ping, probe = common_pb2.PingRequest(), health_pb2.HealthCheckRequest()
        self.lookups = {"lookup": pb.LookupPrefixRequest(namespace=NS, packed_block_hashes=b"".join(prompt)),
                        "lookup_repeated": pb.LookupPrefixRequest(namespace=NS, block_hashes=prompt),
                        "lookup_1": pb.LookupPrefixRequest(namespace=NS, packed_block_hashes=prompt[0])}
        self.calls = {"bare": lambda: bare_stub.Ping(ping),
                      "bare_redis": lambda: bare_stub.LookupPrefix(self.lookups["lookup_1"]),
                      "health": lambda: health.Check(probe),
                      "ping": lambda: stub.Ping(ping),
                      **{kind: (lambda r=request: stub.LookupPrefix(r)) for kind, request in self.lookups.items()}}
        self.nodes = nodes

    def check(self, kind: str, reply) -> None:
        if kind in self.lookups:
            check_lookup(reply, reply.blocks_queried, self.nodes)
            if reply.blocks_queried != len(self.lookups[kind].block_hashes) + len(
                    self.lookups[kind].packed_block_hashes) // BLOCK_HASH_BYTES:
                raise RuntimeError(f"a {kind} call answered for {reply.blocks_queried} blocks")
        elif kind == "health" and reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"the control plane's health check answered {reply.status}")


async def _latencies(calls: _Calls, rounds: int) -> dict[str, list[float]]:
    """Each round makes every kind of call once, in an order rotated every round (so what precedes a call is
    the same for all kinds over the run); the first tenth warms up. Latencies in ms, by kind; every answer is
    checked after its clock stops."""
    kinds = list(calls.calls)
    out: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(rounds + rounds // 10):
        for kind in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:
            t0 = time.perf_counter()
            reply = await calls.calls[kind]()
            t1 = time.perf_counter()
            calls.check(kind, reply)
            if i >= rounds // 10:
                out[kind].append((t1 - t0) * 1e3)
    return out


async def _cost_per_call(calls: _Calls, rounds: int, pids: dict[str, int], r: redis.Redis) -> dict:
    """What one call costs where, one kind at a time, one call at a time: the serving process's CPU (/proc, the
    whole process: the bare server's for "bare", the control plane's for the others) per call, and Redis' own
    time per lookup (INFO commandstats: the script's run time)."""
    cpu, redis_ms = {}, {}
    for kind, call in calls.calls.items():
        pid = pids["bare" if kind.startswith("bare") else "control_plane"]
        r.config_resetstat()
        cpu0 = cpu_seconds(pid)
        for _ in range(rounds):
            reply = await call()
        cpu[kind] = (cpu_seconds(pid) - cpu0) * 1000 / rounds
        calls.check(kind, reply)
        scripts = [v for k, v in r.info("commandstats").items() if k.startswith("cmdstat_evalsha")]
        redis_ms[kind] = sum(v["usec"] for v in scripts) / 1000 / rounds
    return {"control_plane_cpu_ms_per_noop": round(cpu["ping"], 3),
            "control_plane_cpu_ms_per_lookup": round(cpu["lookup"], 3),
            "redis_ms_per_lookup": round(redis_ms["lookup"], 3),
            "bare_grpc_cpu_ms_per_noop": round(cpu["bare"], 3),
            "bare_grpc_cpu_ms_per_redis_call": round(cpu["bare_redis"], 3),
            "control_plane_cpu_ms_per_health_check": round(cpu["health"], 3),
            "control_plane_cpu_ms_per_1_block_lookup": round(cpu["lookup_1"], 3),
            "control_plane_cpu_ms_per_lookup_repeated": round(cpu["lookup_repeated"], 3),
            "redis_ms_per_1_block_lookup": round(redis_ms["lookup_1"], 3)}


def _versions(r: redis.Redis) -> dict[str, str]:
    info = r.info("server")
    out = {"python": platform.python_version(), "redis_server": info.get("redis_version", "?")}
    for dist in ("kvmesh", "grpcio", "protobuf", "redis", "hiredis"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


async def scheduler_key(address: str, admin_key: str) -> str:
    """Creates the bench tenant; returns a scheduler key for it (lookups authenticate like a real scheduler)."""
    async with channel(address, admin_key) as ch:
        admin = tenant_admin_pb2_grpc.TenantAdminStub(ch)
        await admin.CreateTenant(tenant_admin_pb2.CreateTenantRequest(tenant_id=NS.tenant))
        reply = await admin.IssueKey(tenant_admin_pb2.IssueKeyRequest(role=tenant_admin_pb2.ROLE_SCHEDULER,
                                                                      tenant_id=NS.tenant))
        return reply.secret


async def _bench(args, address: str, bare_address: str, r: redis.Redis, admin_key: str,
                 pids: dict[str, int], probe, probe_commands, probe_results) -> dict:
    sched_key = await scheduler_key(address, admin_key)
    # The bare server gets the same channel and metadata as the control plane (it ignores the key).
    async with channel(address, admin_key) as admin_channel, channel(address, sched_key) as sched_channel, \
            channel(bare_address, sched_key) as bare_channel:
        stub = pb_grpc.ControlPlaneStub(admin_channel)
        nodes = LiveNodes(stub)
        try:
            prompt = _hashes(args.prompt_tokens // BLOCK_SIZE, "prompt")
            await ingest(stub, await nodes.register(args.nodes), prompt, args.batch_blocks)
            probe.start()
            replica_lookups = await asyncio.get_running_loop().run_in_executor(None, probe_results.get, True, 120)
            calls = _Calls(bare_channel, sched_channel, prompt, nodes)
            latency = await _latencies(calls, args.rounds)
            costs = await _cost_per_call(calls, args.rounds, pids, r)

            fresh = await nodes.register(args.nodes)  # new incarnations: seq restarts, the prompt's entries fence
            mem_before = r.info("memory")["used_memory"]
            bulk = _hashes(args.blocks, "bulk")
            probe_commands.put("lag")
            await asyncio.get_running_loop().run_in_executor(None, probe_results.get, True, 60)
            rate = await ingest(stub, fresh, bulk, args.batch_blocks)
            mem_after = r.info("memory")["used_memory"]
            stream_bytes = sum(r.memory_usage(Keys.block_changes(k.decode()), samples=0) or 0
                               for k in r.smembers(Keys().namespaces))
            probe_commands.put(len(prompt) + len(bulk))
            replica = await asyncio.get_running_loop().run_in_executor(None, probe_results.get, True, 180)
            nodes.check()
        finally:
            await nodes.close()
    p50 = {kind: statistics.median(values) for kind, values in latency.items()}
    return {
        "noop_rpc_p50_ms": round(p50["ping"], 3),
        "lookup_p50_ms": round(p50["lookup"], 3),
        "lookup_p99_ms": round(_pct(latency["lookup"], 0.99), 3),
        "lookup_p50_over_noop_p50": round(p50["lookup"] / p50["ping"], 2),
        "lookup_blocks": len(prompt),
        "lookup_holders": args.nodes,
        "bare_grpc_noop_p50_ms": round(p50["bare"], 3),
        "bare_grpc_redis_call_p50_ms": round(p50["bare_redis"], 3),
        "health_check_p50_ms": round(p50["health"], 3),
        "auth_cost_p50_ms": round(p50["ping"] - p50["health"], 3),
        "lookup_repeated_p50_ms": round(p50["lookup_repeated"], 3),
        "lookup_repeated_p50_over_noop_p50": round(p50["lookup_repeated"] / p50["ping"], 2),
        "lookup_1_block_p50_ms": round(p50["lookup_1"], 3),
        "lookup_1_block_over_noop_p50": round(p50["lookup_1"] / p50["ping"], 2),
        **costs,
        "ingest_blocks_per_s": round(rate),
        "ingest_batch_blocks": args.batch_blocks,
        "redis_bytes_per_block": round((mem_after - mem_before) / args.blocks, 1),
        "redis_change_stream_bytes": stream_bytes,  # the replicas' change stream (MAXLEN ~1024 records)
        "redis_bytes_per_block_without_change_stream": round((mem_after - mem_before - stream_bytes) / args.blocks, 1),
        "indexed_blocks": args.blocks,
        "holders_per_block": args.nodes,
        **replica_lookups,
        **replica,
        "rounds": args.rounds,
        "node_lease_ms": nodes.lease_ms,
        "node_heartbeat_rounds": nodes.heartbeats,
        "versions": _versions(r),
    }


def main(argv: list[str]) -> int:
    parser = Parser(prog="kvmesh bench control-plane", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    parser.add_argument("--nodes", type=positive_int, default=8)
    parser.add_argument("--prompt-tokens", type=positive_int, default=32_768)
    parser.add_argument("--rounds", type=positive_int, default=500,
                        help="measured rounds (each makes every kind of call once)")
    parser.add_argument("--blocks", type=positive_int, default=100_000, help="distinct blocks ingested per node")
    parser.add_argument("--batch-blocks", type=positive_int, default=1024)
    args = parser.parse_args(argv)

    ports = multiprocessing.get_context("spawn").Queue()
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-") as tmp:
        server = RedisServer(Path(tmp) / "redis", extra_args=["--appendonly", "no"]).start()
        bare = multiprocessing.get_context("spawn").Process(target=_serve_bare, args=(ports, server.url), daemon=True)
        spawn = multiprocessing.get_context("spawn")
        probe_commands, probe_results = spawn.Queue(), spawn.Queue()
        probe = spawn.Process(target=_replica_probe, daemon=True,
                              args=(server.url, args.prompt_tokens // BLOCK_SIZE, probe_commands, probe_results))
        admin_key = new_key()[1]
        cp = ServiceProcess(["control-plane", "--listen", "127.0.0.1:0", "--redis-url", server.url],
                            env={"KVMESH_CP_ADMIN_KEY": admin_key})
        try:
            bare.start()
            bare_address = f"127.0.0.1:{ports.get(timeout=60)}"
            cp.start()
            r = redis.Redis.from_url(server.url)
            result = asyncio.run(_bench(args, cp.address, bare_address, r, admin_key,
                                        {"control_plane": cp.proc.pid, "bare": bare.pid},
                                        probe, probe_commands, probe_results))
        finally:
            cp.stop()
            server.stop()
            for proc in (bare, probe):
                if proc.is_alive():
                    proc.kill()
                if proc.pid is not None:
                    proc.join()
    if not args.json:
        for key, value in result.items():
            print(f"{key:>40}: {value}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_command("kvmesh bench control-plane", main, sys.argv[1:]))  # one line for any error, as `kvmesh` gives
