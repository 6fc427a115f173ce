"""The tenant registry in Redis: tenants and policies, API keys (hashed), Redis ACL users, audit.

Each tenant gets a Redis ACL user that may only touch its own key prefix
(``<prefix>:{t:<tenant>:*``) plus read the live-slot table; the control plane
does all of a tenant's block-map reads and writes through that user, so even a
bug in kvmesh cannot make one tenant's request touch another tenant's keys.

Threading model: coroutines, safe to call concurrently; replicas share the store.
"""

from __future__ import annotations

import collections
import json
import logging
import secrets
import time

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.cluster import RedisCluster

from kvmesh.errors import AlreadyExists, InvalidArgument, NotFound
from kvmesh.namespace import validate_tenant
from kvmesh.redis_client import connect

from kvmesh.redis_keys import Keys, decode_value
from kvmesh.namespace import validate_node_id
from tenancy import api_keys
from tenancy.key_cache import KEY_CHANGE, TENANT_CHANGE
from tenancy.keys import TenantKeys
from tenancy.redis_acl import TenantAcl, tenant_password
from tenancy.model import ApiKey, AuditEntry, Role, Tenant, TenantPolicy

log = logging.getLogger(__name__)

AUDIT_MAX = 100_000


def _s(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _now_ms() -> int:
    return int(time.time() * 1000)


def policy_to_json(policy: TenantPolicy) -> str:
    return json.dumps({
        "allowed_nodes": list(policy.allowed_nodes), "allowed_pools": list(policy.allowed_pools),
        "shared_with": list(policy.shared_with), "max_index_entries": policy.max_index_entries,
        "max_cpu_tier_bytes_per_node": policy.max_cpu_tier_bytes_per_node, "max_namespaces": policy.max_namespaces,
    }, sort_keys=True)


def policy_from_json(text: str) -> TenantPolicy:
    d = json.loads(text or "{}")
    return TenantPolicy(tuple(d.get("allowed_nodes", ())), tuple(d.get("allowed_pools", ())),
                        tuple(d.get("shared_with", ())), int(d.get("max_index_entries", 0)),
                        int(d.get("max_cpu_tier_bytes_per_node", 0)), int(d.get("max_namespaces", 0)))


class RedisTenantStore:
    def __init__(self, url: str, *, key_prefix: str = "kvm", username: str | None = None,
                 password: str | None = None, tenant_secret: bytes, acl_username: str | None = None,
                 acl_password: str | None = None) -> None:
        """``tenant_secret`` derives tenant Redis passwords (tenancy.redis_acl); ``acl_username`` /
        ``acl_password``: the Redis user for ACL changes (unset: the main connection makes them)."""
        self._url = url
        self._redis = connect(url, username=username, password=password)
        self._acl_redis = connect(url, username=acl_username, password=acl_password) if acl_username else None
        self._auth = {"username": username, "password": password, "socket_connect_timeout": 2.0,
                      "health_check_interval": 5}
        self._sub_client = None
        self._keys = TenantKeys(key_prefix)
        self._map_keys = Keys(key_prefix)
        self._key_prefix = key_prefix
        self._tenant_secret = tenant_secret
        self._acl: TenantAcl | None = None

    @property
    def url(self) -> str:
        return self._url

    # -- tenants ---------------------------------------------------------------

    async def create_tenant(self, tenant_id: str, display_name: str, policy: TenantPolicy) -> Tenant:
        validate_tenant(tenant_id)
        policy.validate()
        if len(display_name) > 256:
            raise InvalidArgument("display_name is longer than 256 characters")
        user = self._keys.redis_user(tenant_id)
        created = await self._redis.hsetnx(self._keys.tenant(tenant_id), "tenant_id", tenant_id)
        if not created:
            raise AlreadyExists(f"tenant {tenant_id!r} exists")
        # A fresh epoch per creation: a tenant deleted and created again never shares a block-map key
        # (or a Redis password) with its predecessor.
        epoch = secrets.token_hex(4)
        await self._set_acl_user(tenant_id, self._password(tenant_id, epoch, 0))
        now = _now_ms()
        await self._redis.hset(self._keys.tenant(tenant_id), mapping={
            "display_name": display_name, "policy": policy_to_json(policy), "created_ms": now,
            "redis_user": user, "epoch": epoch, "redis_generation": 0})
        await self._redis.sadd(self._keys.tenants, tenant_id)
        return Tenant(tenant_id, display_name, policy, now, user, epoch)

    async def refresh_redis_users(self) -> int:
        """Writes every tenant's Redis user again, with this version's rules and its current password: users an
        older version made lack commands this one runs (e.g. the block map's change streams). How many."""
        acl = await self._tenant_acl()
        tenant_ids = sorted(_s(t) for t in await self._redis.smembers(self._keys.tenants))
        for tenant_id in tenant_ids:
            record = await self._record(tenant_id)
            await acl.set_user(tenant_id, self._password(tenant_id, record.get("epoch", ""),
                                                         int(record.get("redis_generation", 0))))
        if tenant_ids:
            try:  # persist when Redis runs with an ACL file
                await acl.save()
            except redis.exceptions.ResponseError:
                pass
        return len(tenant_ids)

    def _password(self, tenant_id: str, epoch: str, generation: int) -> str:
        return tenant_password(self._tenant_secret, tenant_id, epoch, generation)

    async def _tenant_acl(self) -> TenantAcl:
        if self._acl is None:
            info = await self._redis.info("server")
            version = (info if "redis_version" in info else next(iter(info.values())))["redis_version"]
            self._acl = TenantAcl(self._key_prefix, self._on_every_node, int(str(version).split(".")[0]) >= 7,
                                  cluster=isinstance(self._redis, RedisCluster))
        return self._acl

    async def _set_acl_user(self, tenant_id: str, password: str) -> None:
        acl = await self._tenant_acl()
        await acl.set_user(tenant_id, password)
        try:  # persist when Redis runs with an ACL file; without one the user is re-created on demand
            await acl.save()
        except redis.exceptions.ResponseError:
            pass

    async def _on_every_node(self, *command: str) -> None:
        client = self._acl_redis or self._redis
        if isinstance(client, RedisCluster):
            # Every node, replicas too (ACLs are not replicated). Named nodes, not the ALL_NODES flag:
            # redis-py 8 ignores node flags on execute_command and then finds no key to route by.
            await client.initialize()
            await client.execute_command(*command, target_nodes=client.get_nodes())
        else:
            await client.execute_command(*command)

    async def _record(self, tenant_id: str) -> dict[str, str]:
        raw = await self._redis.hgetall(self._keys.tenant(tenant_id))
        record = {_s(k): _s(v) for k, v in raw.items()}
        if "created_ms" not in record:
            raise NotFound(f"unknown tenant {tenant_id!r}")
        return record

    @staticmethod
    def _tenant(record: dict[str, str]) -> Tenant:
        return Tenant(record["tenant_id"], record.get("display_name", ""), policy_from_json(record.get("policy")),
                      int(record["created_ms"]), record.get("redis_user", ""), record.get("epoch", ""))

    async def get_tenant(self, tenant_id: str) -> Tenant:
        validate_tenant(tenant_id)
        return self._tenant(await self._record(tenant_id))

    async def find_tenant(self, tenant_id: str) -> Tenant | None:
        try:
            return await self.get_tenant(tenant_id)
        except (NotFound, InvalidArgument):
            return None

    async def list_tenants(self) -> list[Tenant]:
        ids = sorted(_s(t) for t in await self._redis.smembers(self._keys.tenants))
        return [await self.get_tenant(t) for t in ids]

    async def set_policy(self, tenant_id: str, policy: TenantPolicy) -> Tenant:
        await self._record(tenant_id)
        await self._redis.hset(self._keys.tenant(tenant_id), "policy", policy_to_json(policy.validate()))
        await self.publish_change(TENANT_CHANGE + tenant_id)
        return await self.get_tenant(tenant_id)

    async def redis_credentials(self, tenant_id: str, refused_before: bool = False) -> tuple[str, str, str]:
        """The tenant's Redis user, password and epoch; re-creates the user after a refusal (a Redis
        restarted without an ACL file forgets its users; the password is derived again)."""
        record = await self._record(tenant_id)
        password = self._password(tenant_id, record.get("epoch", ""), int(record.get("redis_generation", 0)))
        if refused_before or "redis_password" in record:
            await self._set_acl_user(tenant_id, password)
            await self._redis.hdel(self._keys.tenant(tenant_id), "redis_password")  # stored by older versions
        return record["redis_user"], password, record.get("epoch", "")

    async def rotate_redis_password(self, tenant_id: str) -> Tenant:
        record = await self._record(tenant_id)
        generation = int(record.get("redis_generation", 0)) + 1
        await self._set_acl_user(tenant_id, self._password(tenant_id, record.get("epoch", ""), generation))
        await self._redis.hset(self._keys.tenant(tenant_id), "redis_generation", generation)
        return await self.get_tenant(tenant_id)

    async def tenant_namespaces(self, tenant_id: str) -> list[str]:
        prefix = self._map_keys.tenant_prefix(tenant_id)
        return sorted(_s(k) for k in await self._redis.smembers(self._map_keys.namespaces)
                      if _s(k).startswith(prefix))

    async def index_entries(self, tenant_id: str) -> int:
        total = 0
        for ns_key in await self.tenant_namespaces(tenant_id):
            total += await self._redis.hlen(ns_key)
        return total

    async def _uncount(self, ns_key: str) -> None:
        """Takes a namespace's blocks off the entry counts of the node slots holding them (max_entries_per_node),
        before its block map goes."""
        held: collections.Counter[int] = collections.Counter()
        async for _, value in self._redis.hscan_iter(ns_key, count=1000):
            held.update(slot for slot, _tiers in decode_value(value))
        if held:
            tenant = Keys.tenant_of(ns_key)
            pipe = self._redis.pipeline(transaction=False)
            for slot, n in held.items():
                pipe.hincrby(self._map_keys.slot_entries, slot, -n)
                pipe.hincrby(self._map_keys.slot_tenant_entries(slot), tenant, -n)
            await pipe.execute()

    async def delete_tenant(self, tenant_id: str) -> None:
        await self._record(tenant_id)
        for key in await self.list_keys(tenant_id):
            await self.revoke_key(key.key_id)
        for ns_key in await self.tenant_namespaces(tenant_id):
            await self._uncount(ns_key)
            await self._redis.delete(ns_key)
            await self._redis.srem(self._map_keys.namespaces, ns_key)
        await self._redis.delete(self._map_keys.tenant_namespaces(tenant_id))
        acl = await self._tenant_acl()
        try:
            await acl.delete_user(tenant_id)
            await acl.save()
        except redis.exceptions.ResponseError:
            pass
        await self._redis.delete(self._keys.tenant(tenant_id))
        await self._redis.srem(self._keys.tenants, tenant_id)
        await self.publish_change(TENANT_CHANGE + tenant_id)

    # -- API keys ----------------------------------------------------------------

    async def issue_key(self, role: Role, *, tenant_id: str = "", node_id: str = "", pool: str = "",
                        description: str = "") -> tuple[ApiKey, str]:
        if role is Role.SCHEDULER:
            if not tenant_id:
                raise InvalidArgument("a scheduler key needs a tenant_id")
            await self._record(tenant_id)
        elif tenant_id:
            raise InvalidArgument(f"a {role.name.lower()} key is not bound to a tenant")
        if role is Role.NODE:
            if not node_id:
                raise InvalidArgument("a node key needs a node_id")
            validate_node_id(node_id)
        elif node_id or pool:
            raise InvalidArgument(f"a {role.name.lower()} key is not bound to a node or pool")
        if len(description) > 256:
            raise InvalidArgument("description is longer than 256 characters")
        if len(pool) > 128:
            raise InvalidArgument("pool is longer than 128 characters")
        key_id, secret, secret_hash = api_keys.new_key()
        key = ApiKey(key_id, role, secret_hash, tenant_id, node_id, _now_ms(), False, description, pool)
        await self._redis.hset(self._keys.api_key(key_id), mapping={
            "role": int(role), "hash": secret_hash, "tenant_id": tenant_id, "node_id": node_id, "pool": pool,
            "created_ms": key.created_unix_ms, "revoked": 0, "description": description})
        await self._redis.sadd(self._keys.api_keys, key_id)
        return key, secret

    async def get_key(self, key_id: str) -> ApiKey | None:
        raw = await self._redis.hgetall(self._keys.api_key(key_id))
        if not raw:
            return None
        r = {_s(k): _s(v) for k, v in raw.items()}
        return ApiKey(key_id, Role(int(r["role"])), r["hash"], r.get("tenant_id", ""), r.get("node_id", ""),
                      int(r.get("created_ms", 0)), r.get("revoked") == "1", r.get("description", ""),
                      r.get("pool", ""))

    async def list_keys(self, tenant_id: str = "") -> list[ApiKey]:
        ids = sorted(_s(k) for k in await self._redis.smembers(self._keys.api_keys))
        keys = [k for k in [await self.get_key(i) for i in ids] if k is not None]
        return [k for k in keys if not tenant_id or k.tenant_id == tenant_id]

    async def revoke_key(self, key_id: str) -> ApiKey:
        key = await self.get_key(key_id)
        if key is None:
            raise NotFound(f"unknown key {key_id!r}")
        await self._redis.hset(self._keys.api_key(key_id), "revoked", 1)
        await self.publish_change(KEY_CHANGE + key_id)
        return key

    async def rotate_key(self, key_id: str) -> tuple[ApiKey, str]:
        old = await self.revoke_key(key_id)
        return await self.issue_key(old.role, tenant_id=old.tenant_id, node_id=old.node_id, pool=old.pool,
                                    description=old.description)

    # -- change notifications (tenancy.key_cache) ------------------------------------

    async def publish_change(self, change: str) -> None:
        """Tells every replica to drop what it caches about a key or tenant (best effort: caches
        also expire, see tenancy.key_cache)."""
        await self._redis.publish(self._keys.changes, change)

    async def subscribe_changes(self):
        """A PubSub subscribed to the change channel (in a cluster: on one node; PUBLISH reaches all)."""
        if self._sub_client is None:
            if isinstance(self._redis, RedisCluster):
                node = self._redis.get_random_node()
                self._sub_client = aioredis.Redis(host=node.host, port=node.port, **self._auth)
            else:
                self._sub_client = aioredis.Redis.from_url(self._url, **self._auth)
        pubsub = self._sub_client.pubsub()
        await pubsub.subscribe(self._keys.changes)
        return pubsub

    # -- grant signing key ---------------------------------------------------------

    async def drop_legacy_grant_key(self) -> None:
        """Deletes the grant-signing key earlier versions kept in Redis (it now lives in a file only)."""
        try:
            await self._redis.delete(self._keys.legacy_grant_signing_key)
        except redis.exceptions.NoPermissionError:
            log.warning("cannot delete %s (no permission): remove the old grant-signing key from Redis by hand",
                        self._keys.legacy_grant_signing_key)

    # -- audit -------------------------------------------------------------------

    async def audit(self, entry: AuditEntry) -> None:
        await self._redis.xadd(self._keys.audit, {
            "ms": entry.unix_ms, "actor": entry.actor, "action": entry.action, "target": entry.target,
            "outcome": entry.outcome, "detail": entry.detail}, maxlen=AUDIT_MAX, approximate=True)

    async def list_audit(self, limit: int = 100) -> list[AuditEntry]:
        rows = await self._redis.xrevrange(self._keys.audit, count=limit)
        out = []
        for _id, fields in rows:
            f = {_s(k): _s(v) for k, v in fields.items()}
            out.append(AuditEntry(int(f["ms"]), f["actor"], f["action"], f["target"], f["outcome"], f["detail"]))
        return out

    async def close(self) -> None:
        if self._acl_redis is not None:
            await self._acl_redis.aclose()
        if self._sub_client is not None:
            await self._sub_client.aclose()
        await self._redis.aclose()
