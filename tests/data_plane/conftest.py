"""Fixtures of the data-plane tests: namespaces, a private /dev/shm directory,
in-process data planes on free ports, and real data-plane processes."""

from __future__ import annotations

import base64
import os
import time
import shutil
import uuid
from pathlib import Path

import pytest

from kvmesh.namespace import CacheConfig, Namespace
from tenancy import api_keys
from tenancy.grants import Grant, GrantSigner
from tenancy.peer_proof import encode_public_key

from data_plane.config import DataPlaneConfig
from kvmesh_apps.dp_process import DataPlaneProcess
from data_plane.server import serve

os.environ.setdefault("UCX_NET_DEVICES", "lo")
BLOCK_BYTES = 64 * 1024


@pytest.fixture
def ns() -> Namespace:
    return Namespace("tenant-a", "tiny-llama", "rev1", CacheConfig(block_size=32)).validate()


@pytest.fixture
def block_bytes() -> int:
    """Slot size of every node these fixtures start."""
    return BLOCK_BYTES


@pytest.fixture
def shm_dir() -> Path:
    path = Path("/dev/shm") / f"kvmesh-test-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)  # a killed process leaves its region file behind


@pytest.fixture(scope="session")
def grant_signer() -> GrantSigner:
    """Stands in for the control plane's signing key where a test runs data planes without one."""
    return GrantSigner.generate()


@pytest.fixture
def grant(grant_signer):
    """Signs a pull grant for the consumer's peer key to pull ``ns`` from ``source_node_id``."""

    def sign(consumer_public_key: bytes, consumer_node_id: str, source_node_id: str, ns: Namespace,
             ttl_ms: int = 60_000) -> bytes:
        return grant_signer.sign(Grant(ns.tenant, ns.fingerprint, consumer_node_id,
                                       encode_public_key(consumer_public_key), source_node_id,
                                       int(time.time() * 1000) + ttl_ms))

    return sign


@pytest.fixture
def grant_public_key(grant_signer) -> str:
    return base64.b64encode(grant_signer.public_key).decode()


@pytest.fixture
def config(shm_dir, tmp_path, grant_public_key):
    """Builds a DataPlaneConfig for an in-process node (overrides as keyword arguments)."""

    def build(**overrides) -> DataPlaneConfig:
        fields = dict(node_id=f"n-{uuid.uuid4().hex[:6]}", listen="127.0.0.1:0", shm_dir=shm_dir,
                      block_bytes=BLOCK_BYTES, capacity_bytes=16 * BLOCK_BYTES, lock_memory=False,
                      lease_sweep_ms=20, api_key=api_keys.new_key()[1], grant_public_key=grant_public_key)
        fields.update(overrides)
        return DataPlaneConfig(**fields)

    return build


@pytest.fixture
async def local_node(config):
    """Starts in-process data planes (real gRPC server on a free port); stops them after the test."""
    running = []

    async def start(**overrides):
        node = await serve(config(**overrides))
        running.append(node)
        return node

    yield start
    for node in running:
        await node.stop()


@pytest.fixture
def dp_process(shm_dir, tmp_path, grant_public_key):
    """Starts `python -m data_plane.server` processes; kills leftovers after the test."""
    procs: list[DataPlaneProcess] = []

    def start(node_id: str, **flags) -> DataPlaneProcess:
        merged = dict(listen="127.0.0.1:0", shm_dir=shm_dir, block_bytes=BLOCK_BYTES,
                      capacity_bytes=64 * BLOCK_BYTES, lease_sweep_ms=50, api_key=api_keys.new_key()[1],
                      grant_public_key=grant_public_key)
        merged.update(flags)
        proc = DataPlaneProcess(node_id, merged)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.proc.poll() is None:
            assert proc.stop() == 0, "\n".join(proc.output)
            assert not (shm_dir / f"kvmesh-dp-{proc.node_id}.tier").exists(), "a clean stop removes the region"
