"""Shared pieces of the data-plane tests: a transport wrapper to change what one READ or WRITE does around the
real NIXL transport, and committing blocks of known bytes on a node."""

from __future__ import annotations

import contextlib
import os

import numpy as np

from data_plane.client import DataPlaneClient, SharedTier
from data_plane.shm import SharedRegion
from data_plane.transfer import NixlTransport, Transport


class WrappedTransport(Transport):
    """The real transport, as is; a test subclasses it to change ``read`` or ``write``."""

    def __init__(self, real: Transport) -> None:
        self._real = real

    @property
    def agent_name(self) -> str:
        return self._real.agent_name

    async def rotate(self):
        return await self._real.rotate()

    async def ready(self, timeout_s):
        await self._real.ready(timeout_s)

    def metadata(self):
        return self._real.metadata()

    def landing_metadata(self, node_id):
        return self._real.landing_metadata(node_id)

    def landing_arena(self, node_id):
        return self._real.landing_arena(node_id)

    def renew_landing_arena(self, node_id):
        return self._real.renew_landing_arena(node_id)

    def describe_peer(self, metadata):
        return self._real.describe_peer(metadata)

    async def vet_peer(self, metadata, timeout_s):
        await self._real.vet_peer(metadata, timeout_s)

    def add_peer(self, metadata):
        return self._real.add_peer(metadata)

    def notify(self, agent_name, message):
        self._real.notify(agent_name, message)

    async def notification(self, sender, timeout_s, digest=b""):
        return await self._real.notification(sender, timeout_s, digest)

    def remove_peer(self, agent_name):
        self._real.remove_peer(agent_name)

    async def read(self, peer, local_addrs, remote_addrs, length, timeout_s):
        await self._real.read(peer, local_addrs, remote_addrs, length, timeout_s)

    async def write(self, peer, local_offsets, remote_addrs, length, timeout_s, tag=b""):
        await self._real.write(peer, local_offsets, remote_addrs, length, timeout_s, tag)

    def landed(self, sender, tag, on_landed):
        return self._real.landed(sender, tag, on_landed)

    def close(self):
        self._real.close()


async def commit_blocks(client: DataPlaneClient, ns, n: int) -> list[bytes]:
    """Commits n blocks of distinct bytes (block i is all i + 1) on the client's node; their hashes."""
    hashes = [os.urandom(32) for _ in range(n)]
    tier = SharedTier.open(await client.describe_tier())
    for i, slot in enumerate(await client.reserve(ns, hashes)):
        tier.slot(slot)[:] = np.uint8(i + 1)
    tier.close()
    assert await client.commit(ns, hashes) == n
    return hashes


@contextlib.asynccontextmanager
async def nixl_pair(shm_dir, monkeypatch, name: str, block: int, slots: int, **transport_args):
    """Two NixlTransports in this process over UCX's tcp transport (bytes cross a socket, as between hosts;
    in-process UCX would copy), each on a region of its own: yields ``(src, dst, regions)``."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    regions = [SharedRegion(shm_dir / f"{name}{i}.tier", block, slots, owner=True) for i in range(2)]
    src, dst = (NixlTransport(f"{name}{i}", region, progress_wait_ms=10, **transport_args)
                for i, region in enumerate(regions))
    try:
        for t in (src, dst):
            await t.ready(60.0)
        yield src, dst, regions
    finally:
        for t in (src, dst):
            t.close()
        for region in regions:
            region.close()
