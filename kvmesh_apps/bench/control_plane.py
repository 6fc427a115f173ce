"""``kvmesh bench control-plane``: lookup latency, ingest rate and Redis bytes per block.

A real redis-server and a real control-plane process; this process is the
client. The no-op RPC and the lookup are measured interleaved, with the same
scheduler key (so both pay for authentication), so their ratio compares like
with like. Then, one call at a time again, where a call's cost goes: the control
plane's CPU per no-op and per lookup, and Redis' own time per lookup (the script).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import platform
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import redis

from kvmesh.channels import channel
from kvmesh_apps.procs import ServiceProcess, cpu_seconds
from kvmesh_apps.redis_server import RedisServer
from kvmesh.v1 import common_pb2, control_plane_pb2 as pb, control_plane_pb2_grpc as pb_grpc
from kvmesh.v1 import tenant_admin_pb2, tenant_admin_pb2_grpc
from tenancy.api_keys import new_key

BLOCK_SIZE = 32
NS = common_pb2.Namespace(tenant="bench", model="bench-model", weight_version="v1",
                          cache_config=common_pb2.CacheConfig(block_size=BLOCK_SIZE))


def _hashes(n: int, tag: str) -> list[bytes]:
    return [hashlib.sha256(f"{tag}:{i}".encode()).digest() for i in range(n)]


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _register(stub, nodes: int) -> list[tuple[str, int]]:
    out = []
    for i in range(nodes):
        reply = await stub.RegisterNode(pb.RegisterNodeRequest(
            node=pb.NodeInfo(node_id=f"bench-node-{i}", data_plane_address=f"127.0.0.1:{20000 + i}")))
        out.append((f"bench-node-{i}", reply.incarnation))
    return out


async def _ingest(stub, nodes: list[tuple[str, int]], hashes: list[bytes], batch_blocks: int) -> float:
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


async def _latencies(stub, hashes: list[bytes], rounds: int) -> tuple[list[float], list[float]]:
    ping, lookup = [], []
    request = pb.LookupPrefixRequest(namespace=NS, block_hashes=hashes)
    for i in range(rounds + rounds // 10):
        t0 = time.perf_counter()
        await stub.Ping(common_pb2.PingRequest())
        t1 = time.perf_counter()
        reply = await stub.LookupPrefix(request)
        t2 = time.perf_counter()
        if i >= rounds // 10:  # the first tenth warms up
            ping.append((t1 - t0) * 1e3)
            lookup.append((t2 - t1) * 1e3)
    if reply.holders[0].leading_blocks != len(hashes):
        raise RuntimeError(f"lookup found {reply.holders[0].leading_blocks} of {len(hashes)} blocks")
    return ping, lookup


async def _cost_per_call(stub, hashes: list[bytes], rounds: int, pid: int, r: redis.Redis) -> dict:
    """What one call costs where, one call at a time: the control plane's CPU (/proc, its whole process) per
    no-op and per lookup, and Redis' own time per lookup (INFO commandstats: the script's run time)."""
    ping, lookup = common_pb2.PingRequest(), pb.LookupPrefixRequest(namespace=NS, block_hashes=hashes)
    cpu0 = cpu_seconds(pid)
    for _ in range(rounds):
        await stub.Ping(ping)
    cpu1 = cpu_seconds(pid)
    r.config_resetstat()
    for _ in range(rounds):
        await stub.LookupPrefix(lookup)
    cpu2 = cpu_seconds(pid)
    scripts = [v for k, v in r.info("commandstats").items() if k.startswith("cmdstat_evalsha")]
    return {"control_plane_cpu_ms_per_noop": round((cpu1 - cpu0) * 1000 / rounds, 3),
            "control_plane_cpu_ms_per_lookup": round((cpu2 - cpu1) * 1000 / rounds, 3),
            "redis_ms_per_lookup": round(sum(v["usec"] for v in scripts) / 1000 / rounds, 3)}


def _versions(r: redis.Redis) -> dict[str, str]:
    info = r.info("server")
    out = {"python": platform.python_version(), "redis_server": info.get("redis_version", "?")}
    for dist in ("kvmesh", "grpcio", "protobuf", "redis", "hiredis"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


async def _scheduler_key(address: str, admin_key: str) -> str:
    """Creates the bench tenant; returns a scheduler key for it (lookups authenticate like a real scheduler)."""
    async with channel(address, admin_key) as ch:
        admin = tenant_admin_pb2_grpc.TenantAdminStub(ch)
        await admin.CreateTenant(tenant_admin_pb2.CreateTenantRequest(tenant_id=NS.tenant))
        reply = await admin.IssueKey(tenant_admin_pb2.IssueKeyRequest(role=tenant_admin_pb2.ROLE_SCHEDULER,
                                                                      tenant_id=NS.tenant))
        return reply.secret


async def _bench(args, address: str, r: redis.Redis, admin_key: str, pid: int) -> dict:
    scheduler_key = await _scheduler_key(address, admin_key)
    async with channel(address, admin_key) as admin_channel, channel(address, scheduler_key) as sched_channel:
        stub = pb_grpc.ControlPlaneStub(admin_channel)
        nodes = await _register(stub, args.nodes)
        prompt = _hashes(args.prompt_tokens // BLOCK_SIZE, "prompt")
        await _ingest(stub, nodes, prompt, args.batch_blocks)
        ping, lookup = await _latencies(pb_grpc.ControlPlaneStub(sched_channel), prompt, args.rounds)
        costs = await _cost_per_call(pb_grpc.ControlPlaneStub(sched_channel), prompt, args.rounds, pid, r)

        nodes = await _register(stub, args.nodes)  # fresh incarnations: seq restarts, the prompt's entries fence
        await asyncio.sleep(0)
        mem_before = r.info("memory")["used_memory"]
        bulk = _hashes(args.blocks, "bulk")
        rate = await _ingest(stub, nodes, bulk, args.batch_blocks)
        mem_after = r.info("memory")["used_memory"]
    return {
        "noop_rpc_p50_ms": round(statistics.median(ping), 3),
        "lookup_p50_ms": round(statistics.median(lookup), 3),
        "lookup_p99_ms": round(_pct(lookup, 0.99), 3),
        "lookup_p50_over_noop_p50": round(statistics.median(lookup) / statistics.median(ping), 2),
        "lookup_blocks": len(prompt),
        "lookup_holders": args.nodes,
        **costs,
        "ingest_blocks_per_s": round(rate),
        "ingest_batch_blocks": args.batch_blocks,
        "redis_bytes_per_block": round((mem_after - mem_before) / args.blocks, 1),
        "indexed_blocks": args.blocks,
        "holders_per_block": args.nodes,
        "versions": _versions(r),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh bench control-plane", description=__doc__)
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32_768)
    parser.add_argument("--rounds", type=int, default=500, help="measured lookup/no-op pairs")
    parser.add_argument("--blocks", type=int, default=100_000, help="distinct blocks ingested per node")
    parser.add_argument("--batch-blocks", type=int, default=1024)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-") as tmp:
        server = RedisServer(Path(tmp) / "redis", extra_args=["--appendonly", "no"]).start()
        admin_key = new_key()[1]
        cp = ServiceProcess(["control-plane", "--listen", "127.0.0.1:0", "--redis-url", server.url],
                            env={"KVMESH_CP_ADMIN_KEY": admin_key})
        try:
            cp.start()
            r = redis.Redis.from_url(server.url)
            result = asyncio.run(_bench(args, cp.address, r, admin_key, cp.proc.pid))
        finally:
            cp.stop()
            server.stop()
    if not args.json:
        for key, value in result.items():
            print(f"{key:>28}: {value}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
