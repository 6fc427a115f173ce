"""A node's certificate does not let it answer as another node: the impostor at a node's address.

Played with real data-plane processes over mutual TLS, certificates from the local fleet's CA (`kvmesh up`'s,
kvmesh_apps.fleet_tls): dp2 (the real source), dp3 (the consumer) and an impostor that holds dp1's certificate
and key (stolen, or dp1's own operator) and runs a data plane that calls itself dp2, at an address of its own: where
dp2's registered address points once dp2 is gone and its port is taken (a stale route). The impostor stores
blocks of its choosing under the hashes the consumer will pull, and answers the consumer's pull with them, their
checksums and all. Before, the consumer committed them: dp1's certificate let whoever held it write any tenant's
KV into any node. The consumer must instead refuse the impostor (its certificate does not name dp2) and answer
MISS, at once; the positive control: the same pull from the real dp2 brings dp2's bytes.
"""

from __future__ import annotations

import base64
import os
import time

import numpy as np
import pytest

from kvmesh.namespace import CacheConfig, Namespace
from tenancy.api_keys import new_key
from tenancy.grants import Grant, GrantSigner
from tenancy.peer_proof import encode_public_key

from data_plane.client import DataPlaneClient, SharedTier
from kvmesh_apps.dp_process import DataPlaneProcess
from kvmesh_apps.fleet_tls import FleetTLS, engine_name

pytestmark = pytest.mark.slow

NS = Namespace("tenant-a", "model", "r0", CacheConfig(block_size=16))
BLOCK_BYTES = 64 << 10
N = 8


def _flags(tls: FleetTLS, cert_of: str, shm_dir, signer: GrantSigner) -> dict:
    flags = dict(listen="127.0.0.1:0", shm_dir=shm_dir, block_bytes=BLOCK_BYTES, capacity_bytes=BLOCK_BYTES * 4 * N,
                 api_key=new_key()[1], grant_public_key=base64.b64encode(signer.public_key).decode())
    tls_flags = tls.data_plane_flags(cert_of)
    flags |= {tls_flags[i][2:].replace("-", "_"): tls_flags[i + 1] for i in range(0, len(tls_flags), 2)}
    return flags


async def _store(client: DataPlaneClient, hashes: list[bytes], fill: int) -> None:
    tier = SharedTier.open(await client.describe_tier())
    try:
        slots = await client.reserve(NS, hashes)
        assert -1 not in slots
        for slot in slots:
            tier.slot(slot)[:] = fill
        assert await client.commit(NS, hashes) == len(hashes)
    finally:
        tier.close()


async def _bytes_held(client: DataPlaneClient, hashes: list[bytes]) -> set[int] | None:
    """The byte values the consumer holds under ``hashes`` (None: it holds none of them)."""
    slots, lease = await client.acquire(NS, hashes)
    if not slots:
        return None
    tier = SharedTier.open(await client.describe_tier())
    try:
        return {int(v) for slot in slots for v in np.unique(tier.slot(slot))}
    finally:
        tier.close()
        await client.release(lease)


async def test_a_node_certificate_does_not_answer_as_another_node(tmp_path):
    tls = FleetTLS.ensure(tmp_path / "tls", ["dp1", "dp2", "dp3"])
    signer = GrantSigner.generate()
    shm = [tmp_path / name for name in ("real", "impostor", "consumer")]
    for d in shm:
        d.mkdir()
    real = DataPlaneProcess("dp2", _flags(tls, "dp2", shm[0], signer))
    impostor = DataPlaneProcess("dp2", _flags(tls, "dp1", shm[1], signer))  # dp1's certificate, dp2's name
    consumer = DataPlaneProcess("dp3", _flags(tls, "dp3", shm[2], signer))
    try:
        async with DataPlaneClient(real.address, key=real.api_key, tls=tls.client(engine_name("dp2"))) as rc, \
                DataPlaneClient(impostor.address, key=impostor.api_key, tls=tls.client("dp1")) as ic, \
                DataPlaneClient(consumer.address, key=consumer.api_key, tls=tls.client(engine_name("dp3"))) as cc:
            hashes = [os.urandom(32) for _ in range(N)]
            await _store(rc, hashes, 0x11)  # dp2's blocks
            await _store(ic, hashes, 0xEE)  # the impostor's, under the same hashes
            key = (await cc.describe_tier()).peer_public_key
            grant = signer.sign(Grant(NS.tenant, NS.fingerprint, "dp3", encode_public_key(key), "dp2",
                                      int(time.time() * 1000) + 600_000))

            t0 = time.monotonic()
            attack = await cc.pull(NS, hashes, "dp2", impostor.address, grant=grant, timeout_ms=10_000)
            elapsed = time.monotonic() - t0
            held = await _bytes_held(cc, hashes)
            assert (attack.pulled, held) == (0, None), \
                f"the consumer took {attack.pulled} blocks from dp1's certificate as dp2's: bytes {held}"
            assert elapsed < 5.0, f"the refused pull took {elapsed:.1f}s"

            control = await cc.pull(NS, hashes, "dp2", real.address, grant=grant, timeout_ms=10_000)
            assert control.pulled == N, "positive control: the real dp2 serves the same pull"
            assert await _bytes_held(cc, hashes) == {0x11}
    finally:
        for proc in (real, impostor, consumer):
            proc.stop()
    assert any("certificate" in line and "dp2" in line for line in consumer.output), \
        "the consumer's log says why it refused the impostor:\n" + "\n".join(consumer.output)

