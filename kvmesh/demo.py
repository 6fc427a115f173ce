"""``kvmesh demo``: a local fleet on embedded defaults, and a readable report of what it did.

Today the fleet is the control plane and its Redis: two nodes announce the KV
blocks of a shared system prompt and of their own conversations, and the demo
asks the global block map who holds what. (The engine-connector issue extends
this to real vLLM engines pulling prefixes from each other.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from kvmesh.hashing import BlockHasher
from kvmesh.procs import ServiceProcess
from kvmesh.redis_server import RedisServer
from kvmesh.channels import channel
from kvmesh.v1 import common_pb2, control_plane_pb2 as pb, control_plane_pb2_grpc as pb_grpc
from kvmesh.v1 import tenant_admin_pb2, tenant_admin_pb2_grpc
from tenancy.api_keys import new_key

BLOCK_SIZE = 32
NS = common_pb2.Namespace(tenant="demo", model="tiny-llama", weight_version="v1",
                          cache_config=common_pb2.CacheConfig(block_size=BLOCK_SIZE))


def _say(quiet: bool, text: str) -> None:
    if not quiet:
        print(text, flush=True)


async def _scenario(address: str, admin_key: str, quiet: bool) -> dict:
    system_prompt = list(range(1, 1 + 32 * BLOCK_SIZE))  # 1,024 tokens shared by everyone
    sessions = {f"node-{i}": system_prompt + list(range(10_000 * i, 10_000 * i + 8 * BLOCK_SIZE)) for i in (1, 2)}
    hasher = BlockHasher()
    async with channel(address, admin_key) as ch:
        await tenant_admin_pb2_grpc.TenantAdminStub(ch).CreateTenant(
            tenant_admin_pb2.CreateTenantRequest(tenant_id=NS.tenant, display_name="the demo tenant"))
        stub = pb_grpc.ControlPlaneStub(ch)
        for i, (node_id, tokens) in enumerate(sessions.items(), start=1):
            reg = await stub.RegisterNode(pb.RegisterNodeRequest(
                node=pb.NodeInfo(node_id=node_id, data_plane_address=f"127.0.0.1:{7000 + i}")))
            hashes = hasher.block_hashes(tokens, BLOCK_SIZE)
            ack = await stub.PublishEvents(pb.EventBatch(
                node_id=node_id, incarnation=reg.incarnation, seq=1, namespace=NS, events=[pb.KvEvent(
                    stored=pb.BlockStored(block_hashes=hashes, block_size=BLOCK_SIZE, medium=common_pb2.MEDIUM_CPU))]))
            _say(quiet, f"  {node_id} (incarnation {reg.incarnation}) announced {ack.blocks_applied} CPU-tier blocks")
        query = system_prompt + list(range(10_000, 10_000 + 4 * BLOCK_SIZE)) + [7] * 3 * BLOCK_SIZE
        t0 = time.perf_counter()
        reply = await stub.LookupPrefix(pb.LookupPrefixRequest(namespace=NS, token_ids=query))
        lookup_ms = (time.perf_counter() - t0) * 1e3
    holders = {h.node_id: h.leading_blocks for h in reply.holders}
    _say(quiet, f"  a new prompt of {len(query)} tokens ({reply.blocks_queried} blocks) continues node-1's session:")
    for node_id, blocks in holders.items():
        _say(quiet, f"    {node_id} holds its first {blocks} blocks ({blocks * BLOCK_SIZE} tokens)")
    _say(quiet, f"  lookup took {lookup_ms:.2f} ms")
    return {"blocks_queried": reply.blocks_queried, "holders": holders, "lookup_ms": round(lookup_ms, 3),
            "best_source": reply.holders[0].node_id if reply.holders else None}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    args = parser.parse_args(argv)
    quiet = args.json
    with tempfile.TemporaryDirectory(prefix="kvmesh-demo-") as tmp:
        _say(quiet, "starting an embedded Redis ...")
        redis = RedisServer(Path(tmp) / "redis").start()
        admin_key = new_key()[1]
        cp = ServiceProcess(["control-plane", "--listen", "127.0.0.1:0", "--redis-url", redis.url],
                            env={"KVMESH_CP_ADMIN_KEY": admin_key}, log_path=Path(tmp) / "control-plane.log")
        try:
            _say(quiet, f"starting the control plane (Redis on {redis.url}) ...")
            cp.start()
            _say(quiet, f"control plane on {cp.address}")
            result = asyncio.run(_scenario(cp.address, admin_key, quiet))
        finally:
            cp.stop()
            redis.stop()
    print(json.dumps(result) if args.json else "done.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
