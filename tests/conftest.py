"""Shared fixtures: real Redis servers (one standalone, one cluster) per test session."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from kvmesh_apps.redis_server import RedisCluster, RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> RedisServer:
    server = RedisServer(Path(tmp_path_factory.mktemp("redis"))).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory) -> RedisCluster:
    cluster = RedisCluster(Path(tmp_path_factory.mktemp("redis-cluster"))).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def admin_key() -> str:
    """The bootstrap admin key every test control plane starts with."""
    from tenancy.api_keys import new_key

    return new_key()[1]


@pytest.fixture
def key_prefix() -> str:
    """A fresh key prefix per test: tests share servers but never keys."""
    return f"t{uuid.uuid4().hex[:10]}"
