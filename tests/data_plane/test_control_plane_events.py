"""Tier changes reach a real control plane: commits, evictions and pulls show up in LookupPrefix."""

from __future__ import annotations

import os

import grpc
import numpy as np
import pytest

from kvmesh.v1 import common_pb2, control_plane_pb2 as cp_pb, control_plane_pb2_grpc as cp_grpc

from control_plane.config import ControlPlaneConfig
from control_plane.server import serve as serve_control_plane

from data_plane.client import DataPlaneClient, SharedTier


@pytest.fixture
async def control_plane(redis_server, key_prefix):
    running = await serve_control_plane(ControlPlaneConfig(listen="127.0.0.1:0", redis_url=redis_server.url,
                                                           key_prefix=key_prefix))
    yield f"127.0.0.1:{running.port}"
    await running.stop()


async def holders(address: str, ns, hashes: list[bytes]) -> dict[str, int]:
    async with grpc.aio.insecure_channel(address) as channel:
        r = await cp_grpc.ControlPlaneStub(channel).LookupPrefix(
            cp_pb.LookupPrefixRequest(namespace=ns.to_proto(), block_hashes=hashes,
                                      media=[common_pb2.MEDIUM_CPU]))
    return {h.node_id: h.leading_blocks for h in r.holders}


async def test_commit_pull_and_eviction_are_published(control_plane, local_node, ns, block_bytes):
    a = await local_node(node_id="cp-a", control_plane_address=control_plane, capacity_bytes=4 * block_bytes)
    b = await local_node(node_id="cp-b", control_plane_address=control_plane, capacity_bytes=4 * block_bytes)
    hashes = [os.urandom(32) for _ in range(3)]
    async with DataPlaneClient(a.address) as ca, DataPlaneClient(b.address) as cb:
        tier = SharedTier.open(await ca.describe_tier())
        for slot in await ca.reserve(ns, hashes):
            tier.slot(slot)[:] = np.uint8(slot)
        tier.close()
        await ca.commit(ns, hashes)
        assert (await cb.pull(ns, hashes, "cp-a", a.address)).pulled == 3
        assert await a.publisher.flush(5.0) and await b.publisher.flush(5.0)
        assert await holders(control_plane, ns, hashes) == {"cp-a": 3, "cp-b": 3}
        await ca.reserve(ns, [os.urandom(32) for _ in range(2)])  # evicts hashes[0] (LRU) on a
        assert await a.publisher.flush(5.0)
        assert await holders(control_plane, ns, hashes) == {"cp-b": 3}
        snapshot = list(a.core.snapshot())
        assert [(m, len(h)) for _, m, h in snapshot] == [(common_pb2.MEDIUM_CPU, 2)]
