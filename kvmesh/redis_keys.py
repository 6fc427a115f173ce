"""The Redis key schema of the global block map (documented in docs/redis-schema.md).

Every key carries a Redis Cluster hash tag, so each script touches one slot:
the node registry lives under ``{<prefix>-reg}``; each namespace's block map
under ``{t:<tenant>:<namespace fingerprint>}``. A tenant's keys therefore all
start with ``<prefix>:{t:<tenant>:``, which is what its Redis ACL user may touch.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.namespace import Namespace


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "kvm"

    @property
    def _reg(self) -> str:
        return f"{self.prefix}:{{{self.prefix}-reg}}"

    def node(self, node_id: str) -> str:
        return f"{self._reg}:node:{node_id}"

    @property
    def node_prefix(self) -> str:
        return f"{self._reg}:node:"

    @property
    def nodes(self) -> str:
        return f"{self._reg}:nodes"

    @property
    def slots(self) -> str:
        return f"{self._reg}:slots"

    @property
    def dead_slots(self) -> str:
        return f"{self._reg}:dead"

    @property
    def slot_cursor(self) -> str:
        return f"{self._reg}:slot-cursor"

    @property
    def namespaces(self) -> str:
        """Set of every namespace block-map key ever written (the sweep's work list)."""
        return f"{self._reg}:namespaces"

    def node_namespaces(self, node_id: str) -> str:
        """Set of the namespace block-map keys a node has written (for per-tier clears)."""
        return f"{self._reg}:node-ns:{node_id}"

    @property
    def gc_lock(self) -> str:
        return f"{self._reg}:gc-lock"

    def tenant_prefix(self, tenant: str) -> str:
        """Every key of the tenant starts with this (its ACL pattern is this + '*')."""
        return f"{self.prefix}:{{t:{tenant}:"

    def blocks(self, ns: Namespace, epoch: str = "") -> str:
        """The namespace's block map; ``epoch`` (the tenant's, see tenancy) keeps a re-created tenant
        from ever reading its deleted predecessor's keys."""
        tag = f"{ns.fingerprint}.{epoch}" if epoch else ns.fingerprint
        return f"{self.tenant_prefix(ns.tenant)}{tag}}}:blocks"
