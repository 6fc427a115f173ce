"""A node's certificate does not let it answer as another node, nor as the control plane: the impostor at an
address.

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

import asyncio
import base64
import contextlib
import os
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc

import numpy as np
import pytest

from kvmesh.channels import channel
from kvmesh.namespace import CacheConfig, Namespace
from tenancy.api_keys import new_key
from tenancy.grants import Grant, GrantSigner
from tenancy.peer_proof import encode_public_key

from data_plane.client import DataPlaneClient, SharedTier
from data_plane.config import DataPlaneConfig
from engine_connector.config import ConnectorConfig
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
                DataPlaneClient(impostor.address, key=impostor.api_key, tls=tls.client("dp1", "dp1")) as ic, \
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



class _Recorder(grpc.GenericRpcHandler):
    """A server that answers nothing and records the API keys its callers send (what an impostor collects)."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    def service(self, call_details):
        for name, value in call_details.invocation_metadata or ():
            if name == "authorization":
                self.keys.append(value.removeprefix("Bearer "))
        return None  # UNIMPLEMENTED


def _serve(tls: FleetTLS, cert_of: str) -> tuple[grpc.Server, _Recorder, str]:
    recorder = _Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[recorder])
    pair = [(Path(tls.key_file(cert_of)).read_bytes(), Path(tls.cert_file(cert_of)).read_bytes())]
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(pair, tls.ca_file.read_bytes(), True))
    server.start()
    return server, recorder, f"127.0.0.1:{port}"


def _call(address: str, key: str, client_tls) -> None:
    async def go():
        async with channel(address, key, client_tls) as ch:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await ch.unary_unary("/kvmesh.v1.ControlPlane/GetGrantKeys")(b"", timeout=3)
    asyncio.run(go())


def test_a_node_certificate_does_not_answer_as_the_control_plane_nor_as_an_engines_data_plane(tmp_path):
    """Where the control plane (or dp2) listened, another process of the host holding dp1's certificate and key
    serves once the port is free (a restart): the clients `kvmesh up` configures and prints must not send it their
    keys (a node's key, an engine's, the admin key) nor trust its answers (grant keys it would choose). Positive
    control: each client sends its key to a server holding the right certificate at the same kind of address."""
    tls = FleetTLS.ensure(tmp_path / "tls", ["dp1", "dp2"])
    dp_flags = tls.data_plane_flags("dp2")
    node = DataPlaneConfig(node_id="dp2", capacity_bytes=1 << 20, block_bytes=1 << 16,
                           **{dp_flags[i][2:].replace("-", "_"): dp_flags[i + 1] for i in range(0, len(dp_flags), 2)})
    engine = ConnectorConfig.from_extra_config({"data_plane_address": "127.0.0.1:1", **tls.connector_settings("dp2")})
    key_file = tmp_path / "admin.key"
    key_file.write_text("admin-key\n")

    def admin(address: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvmesh_apps.cli", "admin", "--control-plane", address,
                               "--key-file", str(key_file), *tls.admin_flags(), "tenants", "list"],
                              capture_output=True, text=True, timeout=60)

    clients = {  # who, the server it believes it dials, how it calls
        "dp2 -> control plane": ("control-plane", lambda a: _call(a, "node-key", node.client_tls())),
        "engine -> control plane": ("control-plane",
                                    lambda a: _call(a, "engine-key", engine.tls(engine.control_plane_tls_name))),
        "engine -> its data plane dp2": ("dp2",
                                         lambda a: _call(a, "engine-key", engine.tls(engine.data_plane_tls_name))),
        "admin line": ("control-plane", admin),
    }
    got: dict[tuple[str, str], list[str]] = {}
    for who, (real_cert, call) in clients.items():
        for cert_of in (real_cert, "dp1"):
            server, recorder, address = _serve(tls, cert_of)
            try:
                outcome = call(address)
            finally:
                server.stop(0)
            got[who, cert_of] = recorder.keys
            if who == "admin line" and cert_of == "dp1":
                lines = outcome.stderr.strip().splitlines()
                assert outcome.returncode != 0 and len(lines) == 1 and "Traceback" not in outcome.stderr, \
                    outcome.stderr
    assert not [who for (who, cert_of), keys in got.items() if cert_of != "dp1" and not keys], \
        f"positive control: each client sends its key to the server it means: {got}"
    leaked = {who: keys for (who, cert_of), keys in got.items() if cert_of == "dp1" and keys}
    assert not leaked, f"a server holding dp1's certificate was sent: {leaked}"
