"""A control plane and a data plane served in-process on a private event loop (a thread), so the sync
Hypothesis tests call them over real gRPC on loopback and read their logs."""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tenancy import api_keys

os.environ.setdefault("UCX_NET_DEVICES", "lo")
BLOCK_BYTES = 64 * 1024
TENANT = "fuzz"


@dataclass
class Services:
    cp_address: str
    dp_address: str
    admin_key: str
    node_key: str
    peer_key: str  # a node key of another node (calls the data plane's peer API as a peer)
    loop: asyncio.AbstractEventLoop
    signer: object  # the control plane's grant signer (tenancy.grants.GrantSigner): real grants for peers

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@pytest.fixture(scope="package")
def services(redis_server, tmp_path_factory):
    from control_plane.config import ControlPlaneConfig
    from control_plane.server import serve as serve_cp
    from data_plane.config import DataPlaneConfig
    from data_plane.server import serve as serve_dp
    from tenancy.model import Role, TenantPolicy

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="fuzz-services")
    thread.start()
    admin_key = api_keys.new_key()[1]
    shm_dir = Path("/dev/shm") / f"kvmesh-fuzz-{uuid.uuid4().hex[:8]}"
    shm_dir.mkdir()

    async def start():
        cp = await serve_cp(ControlPlaneConfig(
            listen="127.0.0.1:0", redis_url=redis_server.url, key_prefix=f"fz{uuid.uuid4().hex[:8]}",
            lease_ms=60_000, max_batch_blocks=64, max_lookup_blocks=64, admin_key=admin_key))
        await cp.core.tenants.create_tenant(TENANT, "Fuzz", TenantPolicy())
        node_key = (await cp.core.tenants.issue_key(Role.NODE, node_id="fuzz-node"))[1]
        peer_key = (await cp.core.tenants.issue_key(Role.NODE, node_id="fuzz-peer"))[1]
        dp = await serve_dp(DataPlaneConfig(
            node_id="fuzz-node", listen="127.0.0.1:0", shm_dir=shm_dir, block_bytes=BLOCK_BYTES,
            capacity_bytes=16 * BLOCK_BYTES, lock_memory=False, api_key=node_key,
            grant_public_key=_public_key(cp), pull_timeout_ms=300, max_pull_timeout_ms=500,
            pending_wait_ms=50, max_pending_wait_ms=100, lease_ms=2_000, max_lease_ms=5_000, max_hashes_per_request=64))
        return cp, dp, node_key, peer_key

    cp, dp, node_key, peer_key = asyncio.run_coroutine_threadsafe(start(), loop).result(120)
    yield Services(f"127.0.0.1:{cp.port}", dp.address, admin_key, node_key, peer_key, loop, cp.core.signer)
    asyncio.run_coroutine_threadsafe(_stop(dp, cp), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    for leftover in shm_dir.glob("*"):
        leftover.unlink()
    shm_dir.rmdir()


def _public_key(cp) -> str:
    import base64

    return base64.b64encode(cp.core.signer.public_key).decode()


async def _stop(dp, cp) -> None:
    await dp.stop()
    await cp.stop()
