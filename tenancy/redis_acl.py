"""The only code that changes Redis ACL users: tenant users, made from one template, checked before sending.

Redis 7.0 cannot confine an ACL administrator: whoever may run ``ACL SETUSER``
may create any user with any rights (key patterns and selectors restrict keys
and channels, never the user names or rules an ACL command carries). So the
control plane does its ACL work on a connection of its own (``acl_username``,
allowed ``ACL SETUSER / DELUSER / SAVE`` and nothing else) and every command
sent on it goes through :class:`TenantAcl`, which refuses a user name outside
the tenant pattern and builds the rules itself. Its main Redis user has no ACL
rights at all. docs/security.md says what this does and does not stop.

Tenant passwords are never stored: each is an HMAC of a control-plane secret,
the tenant id, the tenant's epoch and a rotation counter, so Redis holds only
its SHA-256 (in the ACL) and every replica derives the same password.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re

from kvmesh.errors import InvalidArgument
from kvmesh.redis_keys import Keys

# What the control plane runs as a tenant: the block-map scripts and the quota count, nothing else
# (no SCAN / KEYS / RANDOMKEY: they list every tenant's key names; no SCRIPT / FUNCTION: FLUSH empties
# the cache every replica relies on; no pub/sub, no admin commands).
TENANT_COMMANDS = ("auth", "hello", "ping", "select", "client|setname", "time", "evalsha", "evalsha_ro",
                   "hget", "hmget", "hset", "hdel", "hlen", "hgetall", "hscan",
                   "incr", "get", "xadd", "xread")  # the change stream: apply.lua, sweep.lua, read replicas

CLUSTER_COMMANDS = ["cluster|slots", "cluster|shards", "cluster|nodes", "cluster|myid", "readonly", "command"]


def tenant_password(secret: bytes, tenant_id: str, epoch: str, generation: int) -> str:
    """The tenant's Redis password (derived; never stored)."""
    mac = hmac.new(secret, f"kvmesh-tenant-redis\x1f{tenant_id}\x1f{epoch}\x1f{generation}".encode(),
                   hashlib.sha256)
    return base64.urlsafe_b64encode(mac.digest()).decode().rstrip("=")


class TenantAcl:
    """Builds and checks the ACL commands for tenant users; ``send(*command)`` runs one on every node."""

    def __init__(self, key_prefix: str, send, read_only_keys: bool, cluster: bool = False) -> None:
        self._keys = Keys(key_prefix)
        self._cluster = cluster
        self._send = send
        self._read_only_keys = read_only_keys
        self._user_re = re.compile(re.escape(f"{key_prefix}-t-") + r"[a-z0-9][a-z0-9_.-]{0,62}")

    def user(self, tenant_id: str) -> str:
        return self._checked(f"{self._keys.prefix}-t-{tenant_id}")

    def _checked(self, user: str) -> str:
        if not self._user_re.fullmatch(user):
            raise InvalidArgument(f"refusing an ACL change for {user!r}: not a tenant user")
        return user

    def rules(self, tenant_id: str, password: str) -> list[str]:
        slots = ("%R~" if self._read_only_keys else "~") + self._keys.slots
        digest = hashlib.sha256(password.encode()).hexdigest()
        commands = [c for c in TENANT_COMMANDS if self._read_only_keys or c != "evalsha_ro"]  # Redis 7+
        if self._cluster:  # a cluster client learns the slot map before any command
            commands += CLUSTER_COMMANDS
        return ["reset", "on", f"#{digest}", f"~{self._keys.tenant_prefix(tenant_id)}*", slots,
                "resetchannels", "-@all", *(f"+{c}" for c in commands)]

    async def set_user(self, tenant_id: str, password: str) -> None:
        await self._send("ACL", "SETUSER", self.user(tenant_id), *self.rules(tenant_id, password))

    async def delete_user(self, tenant_id: str) -> None:
        await self._send("ACL", "DELUSER", self.user(tenant_id))

    async def save(self) -> None:
        await self._send("ACL", "SAVE")
