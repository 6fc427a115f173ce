"""Tenants on a Redis Cluster: the tenant's Redis ACL user exists on every node (ACLs are not replicated)."""

from __future__ import annotations

import redis

from tenancy.model import TenantPolicy
from tenancy.store import RedisTenantStore


async def test_create_tenant_sets_its_acl_user_on_every_cluster_node(redis_cluster, key_prefix):
    store = RedisTenantStore(redis_cluster.url, key_prefix=key_prefix)
    try:
        tenant = await store.create_tenant("clustered", "", TenantPolicy())
    finally:
        await store.close()
    for node in redis_cluster.nodes:
        client = redis.Redis(port=node.port)
        try:
            assert client.acl_getuser(tenant.redis_user) is not None, f"no ACL user on node {node.port}"
            assert client.acl_getuser(f"{tenant.redis_user}-nobody") is None  # negative control
        finally:
            client.close()
