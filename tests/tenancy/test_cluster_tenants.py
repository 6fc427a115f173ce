"""Tenants on a Redis Cluster: the tenant's Redis ACL user exists on every node (ACLs are not replicated) and
can use the block map through a cluster client (which must read the slot map first)."""

from __future__ import annotations

import redis

from redis.asyncio.cluster import RedisCluster

from tenancy.model import TenantPolicy
from tenancy.store import RedisTenantStore


async def test_create_tenant_sets_its_acl_user_on_every_cluster_node(redis_cluster, key_prefix):
    store = RedisTenantStore(redis_cluster.url, key_prefix=key_prefix, tenant_secret=b"test secret")
    try:
        tenant = await store.create_tenant("clustered", "", TenantPolicy())
        username, password, _epoch = await store.redis_credentials("clustered")
    finally:
        await store.close()
    host, port = redis_cluster.url.removeprefix("redis+cluster://").split(":")
    as_tenant = RedisCluster(host=host, port=int(port), username=username, password=password)
    try:
        key = f"{key_prefix}:{{t:clustered:fp}}:blocks"
        await as_tenant.hset(key, "h", "v")
        assert await as_tenant.hget(key, "h") == b"v"
    finally:
        await as_tenant.aclose()
    for node in redis_cluster.nodes:
        client = redis.Redis(port=node.port)
        try:
            assert client.acl_getuser(tenant.redis_user) is not None, f"no ACL user on node {node.port}"
            assert client.acl_getuser(f"{tenant.redis_user}-nobody") is None  # negative control
        finally:
            client.close()
