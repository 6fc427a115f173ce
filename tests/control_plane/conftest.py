from __future__ import annotations

import pytest

from kvmesh.namespace import CacheConfig, Namespace

from control_plane.redis_block_map import RedisBlockMap


@pytest.fixture
def ns() -> Namespace:
    return Namespace("acme", "tiny-llama", "v1", CacheConfig(block_size=32)).validate()


@pytest.fixture(params=["redis", "redis-cluster"])
def store_url(request) -> str:
    """Every block-map test runs against one Redis server and against a Redis Cluster."""
    fixture = "redis_server" if request.param == "redis" else "redis_cluster"
    return request.getfixturevalue(fixture).url


@pytest.fixture
async def block_map(store_url, key_prefix):
    bm = RedisBlockMap(store_url, lease_ms=60_000, key_prefix=key_prefix)
    yield bm
    await bm.close()
