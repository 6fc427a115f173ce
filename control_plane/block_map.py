"""The global block map contract: which live node holds which block, on which tier.

Implementor contracts
- Fencing: once a node re-registers, deregisters, resets (``EventBatch.reset``)
  or its lease expires, no lookup returns entries written under its previous
  slot, immediately and on every replica.
- Ordering: a node's batches apply in ``seq`` order, once. A batch whose seq was
  already applied is a DUPLICATE and changes nothing (even a reset); a batch
  past the next expected seq changes nothing and asks for a resync.
- Lookup returns, per live holder, the count of leading query blocks it holds on
  any counted tier and on each tier, and reads no further than the longest run.
- Persistence: all state is in the backing store; a new instance over the same
  store answers exactly as the old one did (restarts, several replicas).

Threading model: methods are coroutines, safe to call concurrently on one event
loop; any number of processes may share one backing store.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvmesh.namespace import Namespace

from control_plane.model import Ack, EventBatch, NodeInfo, NodeStatus, PrefixMatch, Registration


class BlockMap(ABC):
    @abstractmethod
    async def register_node(self, node: NodeInfo) -> Registration:
        """New incarnation and lease for ``node``; fences its earlier entries. AlreadyExists when a registered
        node's id differs from ``node.node_id`` only by case (TLS names are case-insensitive)."""

    @abstractmethod
    async def heartbeat(self, node_id: str, incarnation: int) -> int:
        """Renews the lease; returns it in ms. NotFound / FailedPrecondition when stale."""

    @abstractmethod
    async def deregister_node(self, node_id: str, incarnation: int) -> None:
        """Removes the node and fences its entries."""

    @abstractmethod
    async def list_nodes(self) -> list[NodeStatus]:
        """Every registered node, live or not."""

    @abstractmethod
    async def apply_batch(self, batch: EventBatch) -> Ack:
        """Applies a validated batch under the ordering contract above."""

    @abstractmethod
    async def claim_namespace(self, node_id: str, ns: Namespace, limit: int) -> bool:
        """Records that ``node_id`` writes blocks of ``ns``; False, recording nothing, when ``ns`` is new to its
        tenant and the tenant already has ``limit`` namespaces (0: no limit). Atomic: concurrent claims, from any
        replica, never take a tenant past ``limit``. ``apply_batch`` claims its namespace without a limit."""

    @abstractmethod
    async def skip_batch(self, batch: EventBatch) -> Ack:
        """Consumes the batch's seq under the ordering contract without applying its events
        (APPLIED here means "consumed"); for batches refused by policy."""

    @abstractmethod
    async def count_new(self, ns: Namespace, block_hashes: list[bytes]) -> tuple[int, int]:
        """(entries ``ns`` has, how many of ``block_hashes`` it lacks); for quotas."""

    @abstractmethod
    async def node_entries(self, node_id: str, tenant: str | None = None) -> int:
        """How many blocks the node's current incarnation holds in the map (on any tier; 0 when it holds none
        or is not registered), of every tenant or of ``tenant``'s namespaces: what its batches stored and have
        not removed or cleared; for its bound, and its part of the tenant's quota."""

    @abstractmethod
    async def lookup_prefix(self, ns: Namespace, block_hashes: list[bytes], tiers: int) -> PrefixMatch:
        """Live holders of the longest prefix of ``block_hashes`` on the tiers in mask ``tiers``."""

    @abstractmethod
    async def collect_garbage(self) -> int:
        """Retires expired leases and frees the memory of fenced entries; returns slots freed."""

    @abstractmethod
    async def close(self) -> None:
        """Releases connections."""
