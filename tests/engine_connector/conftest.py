"""Fixtures for the engine-connector tests: a tiny model and local fleets (real processes)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvmesh.namespace import CacheConfig, Namespace
from kvmesh_apps.fleet import Fleet

from data_plane.client import DataPlaneClient
from kvmesh_apps.tiny_model import TEST_INIT_STD, build_tiny_llama

os.environ.setdefault("UCX_NET_DEVICES", "lo")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # init_std 0.1 (not HF's 0.02): attention that picks out context, so what the model predicts depends on the
    # prefix's KV (a misplaced block moves logprobs by ~1, not ~0.01; docs/engine_connector.md).
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", init_std=TEST_INIT_STD)


@pytest.fixture(scope="session")
def start_fleet(tmp_path_factory: pytest.TempPathFactory, admin_key: str) -> Callable[..., Fleet]:
    """Starts Redis + control plane + two data planes (dp1, dp2) of ``block_bytes`` slots for blocks of
    ``block_tokens``; the caller stops it."""

    def start(block_bytes: int, block_tokens: int = 32, **kwargs) -> Fleet:
        return Fleet(tmp_path_factory.mktemp("fleet"), 2, admin_key, tenant="acme", block_bytes=block_bytes,
                     block_tokens=block_tokens, capacity=f"{256 * block_bytes}", **kwargs).start()

    return start


@pytest.fixture(scope="module")
def small_fleet(start_fleet) -> Iterator[Fleet]:
    """A fleet with 1 KiB slots, for tests without engines."""
    fleet = start_fleet(1024)
    asyncio.run(_handshake(fleet, "dp2", "dp1"))
    yield fleet
    fleet.stop()


async def _handshake(fleet: Fleet, consumer: str, source: str) -> None:
    """``consumer`` pulls one block from ``source`` with a long bound: the first pull between two nodes
    handshakes (metadata vetted in a child process, seconds on a loaded machine), which the tests' 5 s pull bounds
    are not about; later pulls reuse it."""
    ns = Namespace(fleet.tenant, "handshake", "", CacheConfig(block_size=32)).validate()
    block = [os.urandom(32)]
    async with DataPlaneClient(fleet.data_planes[source].address, key=fleet.node_keys[source],
                               tls=fleet.client_tls(f"engine-{source}")) as owner:
        await owner.reserve(ns, block)
        await owner.commit(ns, block)
    async with DataPlaneClient(fleet.data_planes[consumer].address, key=fleet.node_keys[consumer],
                               tls=fleet.client_tls(f"engine-{consumer}")) as engine:
        result = await engine.pull(ns, block, source, fleet.data_planes[source].address, timeout_ms=60_000)
    assert result.pulled == 1, f"{consumer} could not pull from {source}: {result}"
