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

    def tenant_namespaces(self, tenant: str) -> str:
        """Set of the namespace block-map keys holding a tenant's blocks (counted against its namespace limit)."""
        return f"{self._reg}:tenant-ns:{tenant}"

    @property
    def node_names(self) -> str:
        """Hash: a node id in lower case -> the node id registered under it (two ids apart only by case refused)."""
        return f"{self._reg}:node-names"

    @property
    def namespace_claims(self) -> str:
        """Hash: namespace block-map key -> "<ms>\\t<tenant>", the last time a node claimed it (its release's clock)."""
        return f"{self._reg}:ns-claims"

    @property
    def slot_entries(self) -> str:
        """Hash: node slot -> how many blocks that slot holds in the block map (a node's entry count, bounded)."""
        return f"{self._reg}:slot-entries"

    def slot_tenant_entries(self, slot: int | str) -> str:
        """Hash: tenant -> how many of its blocks node slot ``slot`` holds in the block map (one node's part of
        its tenant's max_index_entries, bounded to half)."""
        return f"{self._reg}:slot-tenant-entries:{slot}"

    def node_namespaces(self, node_id: str) -> str:
        """Set of the namespace block-map keys a node has written (for per-tier clears)."""
        return f"{self._reg}:node-ns:{node_id}"

    @property
    def slot_changes(self) -> str:
        """Stream of live-slot table changes (id ``<seq>-0``; fields ``s`` slot, ``r`` record, "" removed)."""
        return f"{self._reg}:slot-changes"

    @property
    def slot_changes_seq(self) -> str:
        return f"{self._reg}:slot-changes-seq"

    @property
    def slot_log(self) -> list[str]:
        """The two keys every live-slot-table script takes last (prelude.lua's ``log_slot``)."""
        return [self.slot_changes, self.slot_changes_seq]

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

    @staticmethod
    def block_changes(blocks_key: str) -> str:
        """The change stream of the block map at ``blocks_key`` (same hash tag: one cluster slot)."""
        return blocks_key.removesuffix(":blocks") + ":changes"

    @staticmethod
    def block_changes_seq(blocks_key: str) -> str:
        return blocks_key.removesuffix(":blocks") + ":changes-seq"

    def change_log(self, blocks_key: str) -> list[str]:
        """The keys apply.lua and sweep.lua take: the block map, its change stream, its sequence counter."""
        return [blocks_key, self.block_changes(blocks_key), self.block_changes_seq(blocks_key)]

    @staticmethod
    def tenant_of(blocks_key: str) -> str:
        """The tenant of a namespace's block-map key (``<prefix>:{t:<tenant>:<fingerprint>...}:blocks``)."""
        inner = blocks_key[blocks_key.index("{t:") + 3:blocks_key.index("}")]
        return inner.rsplit(":", 1)[0]


def decode_value(value: bytes) -> tuple[tuple[int, int], ...]:
    """((slot, tier bits), ...) of a block-map value (2 bytes per holding node slot: ``slot * 8 + tiers``)."""
    return tuple(((value[j] << 8 | value[j + 1]) >> 3, value[j + 1] & 7) for j in range(0, len(value), 2))


def encode_value(entries) -> bytes:
    """The block-map value of ``(slot, tier bits)`` entries."""
    return bytes(b for s, m in entries for b in divmod(s * 8 + m, 256))
