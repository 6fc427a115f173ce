"""A tenant's namespace count goes down again (RedisBlockMap.release_empty_namespaces), on one Redis server and on
a Redis Cluster: a namespace is released only once its block map is empty AND no node claimed it for the quiet
time (a control plane that cached a claim may still write to it for up to a quarter of that); a later claim counts
it anew, against the limit."""

from __future__ import annotations

import asyncio

from control_plane.model import Removed
from control_plane.redis_block_map import RedisBlockMap
from kvmesh.namespace import Namespace

from tests.control_plane.test_block_map_conformance import Publisher, hashes

QUIET_MS = 1500


async def test_an_empty_namespace_is_released_after_its_quiet_time_and_counted_again_when_claimed(
        store_url, key_prefix, ns):
    bm = RedisBlockMap(store_url, lease_ms=60_000, key_prefix=key_prefix, namespace_release_after_ms=QUIET_MS)
    kept, emptied, new = (Namespace(ns.tenant, model, "v1", ns.cache_config) for model in ("kept", "emptied", "new"))
    keys = bm._keys
    try:
        hs = hashes(4)
        for namespace in (kept, emptied):
            assert await bm.claim_namespace("node-1", namespace, 2)
        p_kept, p_emptied = await Publisher(bm, kept, 1).register(), await Publisher(bm, emptied, 2).register()
        await p_kept.store(hs)
        await p_emptied.store(hs)
        assert not await bm.claim_namespace("node-1", new, 2)  # the limit: 2
        await p_emptied.send(Removed(tuple(hs), None))  # its block map is empty now, its claim fresh
        assert await bm.release_empty_namespaces() == 0, "released within its quiet time"
        # the script checks the claim's time itself (a claim made after the collector read it keeps the namespace)
        emptied_key = await bm.blocks_key(emptied)
        assert await bm._eval("release_namespace", [keys.namespace_claims, keys.tenant_namespaces(ns.tenant),
                                                    keys.namespaces], [emptied_key, QUIET_MS]) == 0
        assert not await bm.claim_namespace("node-2", new, 2)
        await asyncio.sleep(QUIET_MS / 1000 + 0.2)
        assert await bm.release_empty_namespaces() == 1  # "emptied"; "kept" holds blocks, claimed as long ago
        kept_key = await bm.blocks_key(kept)
        redis = bm._redis
        assert {m.decode() for m in await redis.smembers(keys.tenant_namespaces(ns.tenant))} == {kept_key}
        assert not await redis.sismember(keys.namespaces, emptied_key)
        assert not await redis.sismember(keys.node_namespaces("node-1"), emptied_key)
        assert await bm.claim_namespace("node-2", new, 2)  # its place is free
        assert not await bm.claim_namespace("node-1", emptied, 2), "a released namespace was not counted again"
        assert await bm.release_empty_namespaces() == 0
    finally:
        await bm.close()


async def test_a_namespace_an_earlier_version_left_without_a_claim_is_claimed_then_released(store_url, key_prefix, ns):
    """A map written before claims were recorded (an upgrade) has namespaces counted against their tenant with no
    claim: the collector never looked at them, so an empty one counted for good. Now the collector claims each such
    namespace when it first sees it (dated then: the quiet time starts) and releases it once quiet, like any other.
    Control: a namespace with its claim on record keeps that claim's time."""
    bm = RedisBlockMap(store_url, lease_ms=60_000, key_prefix=key_prefix, namespace_release_after_ms=QUIET_MS)
    old, recent = (Namespace(ns.tenant, model, "v1", ns.cache_config) for model in ("old", "recent"))
    keys, redis = bm._keys, bm._redis
    try:
        hs = hashes(2)
        for i, namespace in enumerate((old, recent)):
            assert await bm.claim_namespace("node-1", namespace, 2)
            publisher = await Publisher(bm, namespace, i + 1).register()
            await publisher.store(hs)
            await publisher.send(Removed(tuple(hs), None))
        old_key, recent_key = await bm.blocks_key(old), await bm.blocks_key(recent)
        await redis.hdel(keys.namespace_claims, old_key)  # as an earlier version left it
        recent_claim = await redis.hget(keys.namespace_claims, recent_key)

        assert await bm.release_empty_namespaces() == 0  # within the quiet time of both
        assert (await redis.hget(keys.namespace_claims, old_key)).decode().endswith(f"\t{ns.tenant}")
        assert await redis.hget(keys.namespace_claims, recent_key) == recent_claim
        await asyncio.sleep(QUIET_MS / 1000 + 0.2)
        assert await bm.release_empty_namespaces() == 2
        assert await redis.scard(keys.tenant_namespaces(ns.tenant)) == 0
        assert not await redis.hexists(keys.namespace_claims, old_key)
    finally:
        await bm.close()
