"""The control-plane core: authorization, validation and policy over a :class:`BlockMap`.

Plain Python, no gRPC: the servicer converts protos to the types in
``control_plane.model``, passes the authenticated principal, and calls this.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import time

from typing import AsyncIterator, Iterable, Sequence

from kvmesh.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from kvmesh.hashing import CallerTurns, Extras
from kvmesh.namespace import Namespace, validate_tenant
from tenancy.authz import Authorizer
from tenancy.grants import Grant, GrantSigner, RouteToken
from tenancy.peer_proof import encode_public_key
from tenancy.auth import BOOTSTRAP_KEY_ID
from tenancy.model import Principal, Role
from tenancy.store import RedisTenantStore

from control_plane.block_map import BlockMap
from control_plane.config import ControlPlaneConfig
from control_plane.model import (
    Ack, AckStatus, EventBatch, NodeInfo, NodeStatus, PackedHashes, PrefixMatch, Registration, Stored,
    validate_node_id,
)
from control_plane.prefetch import prefetch_order
from control_plane.routing.router import Router
from control_plane.routing.types import RouteDecision, RouteRequest, StatsReport
from control_plane.watch import BlockMapUpdate, BlockMapWatch

log = logging.getLogger(__name__)

# A node's entry count (max_entries_per_node) is read from Redis at most this often per replica, counted up locally
# in between: a node may pass its limit by what it publishes through other replicas within this time.
NODE_ENTRIES_TTL_S = 1.0
GC_STOP_WAIT_S = 5.0  # close() waits this long for a collection in flight (its Redis calls are bounded too)


def owns_engine(node_id: str, engine_id: str, others: Iterable[str] = ()) -> bool:
    """Engines of a node are named after it: ``<node id>`` or ``<node id>:<name>``, unless a longer id among the
    ``others`` (the registered nodes: node ids may hold ':') names it too: ``a:b`` is node ``a:b``'s, not ``a``'s."""
    def names(node: str) -> bool:
        return engine_id == node or engine_id.startswith(node + ":")
    return names(node_id) and not any(len(o) > len(node_id) and names(o) for o in others)


class BatchRefused(Exception):
    """A well-formed batch the control plane will not index (tenant policy or quota)."""

    def __init__(self, error: PermissionDenied | ResourceExhausted) -> None:
        super().__init__(str(error))
        self.error = error


class ControlPlane:
    def __init__(self, block_map: BlockMap, config: ControlPlaneConfig, tenants: RedisTenantStore,
                 authz: Authorizer, signer: GrantSigner, router: Router,
                 grant_public_keys: list[bytes] | None = None, watch: BlockMapWatch | None = None,
                 blocks_key=None) -> None:
        """``grant_public_keys``: every key grants may be verified with (default: the signer's only).
        ``watch`` and ``blocks_key`` (namespace -> its block-map key): serve WatchBlockMap from a replica."""
        self.block_map = block_map
        self.grant_public_keys = grant_public_keys or [signer.public_key]
        self.router = router
        self.config = config
        self.tenants = tenants
        self.authz = authz
        self.signer = signer
        self._gc_task: asyncio.Task | None = None
        self._node_entries: dict[str, tuple[float, int]] = {}  # node id -> (read at, entries): _check_node_entries
        self._pools: tuple[float, dict[str, str]] = (-math.inf, {})  # (listed at, node id -> pool): _node_pools
        self._pools_listing: asyncio.Future | None = None
        self._closing = False
        self._watch = watch
        self._blocks_key = blocks_key
        self._hashing = CallerTurns()  # token ids hashed one lookup at a time per key

    # -- nodes -----------------------------------------------------------------

    async def register_node(self, principal: Principal, node: NodeInfo) -> Registration:
        node.validate()
        await self.authz.require_node(principal, node.node_id, "RegisterNode")
        if principal.role is Role.NODE and principal.pool and node.pool != principal.pool:
            raise await self.authz.deny(principal, "RegisterNode", node.node_id,
                                        f"node {node.node_id!r} belongs to pool {principal.pool!r}, not {node.pool!r}")
        return await self.block_map.register_node(node)

    async def heartbeat(self, principal: Principal, node_id: str, incarnation: int) -> int:
        validate_node_id(node_id)
        await self.authz.require_node(principal, node_id, "Heartbeat")
        return await self.block_map.heartbeat(node_id, incarnation)

    async def deregister_node(self, principal: Principal, node_id: str, incarnation: int) -> None:
        validate_node_id(node_id)
        await self.authz.require_node(principal, node_id, "DeregisterNode")
        await self.block_map.deregister_node(node_id, incarnation)

    async def list_nodes(self, principal: Principal) -> list[NodeStatus]:
        """Every node and its address: for nodes and admins, not tenants' schedulers (who learn holders
        only of prefixes they may read)."""
        if principal.role not in (Role.ADMIN, Role.NODE):
            raise await self.authz.deny(principal, "ListNodes", "", "ListNodes needs a node or admin key")
        return await self.block_map.list_nodes()

    # -- events --------------------------------------------------------------------

    async def apply_batch(self, principal: Principal, batch: EventBatch) -> Ack:
        """Applies a batch; raises BatchRefused when policy or quota forbids indexing it."""
        batch.validate(self.config.max_batch_blocks)
        await self.authz.require_node(principal, batch.node_id, "PublishEvents")
        tenant_id = batch.namespace.tenant
        if await self.authz.tenant(tenant_id) is None or (
                principal.role is Role.NODE and not await self.authz.node_may_hold(principal, tenant_id)):
            raise BatchRefused(await self.authz.deny(
                principal, "PublishEvents", tenant_id,
                f"tenant {tenant_id!r} does not exist or does not allow node {batch.node_id!r} to hold its blocks"))
        await self._check_quota(principal, batch)
        await self._check_node_entries(batch)
        await self._claim_namespace(batch)
        return await self.block_map.apply_batch(batch)

    async def refuse_batch(self, batch: EventBatch, refused: BatchRefused) -> Ack:
        """Consumes a refused batch's seq without applying it (a stream goes on past it)."""
        ack = await self.block_map.skip_batch(batch)
        if ack.status is AckStatus.APPLIED:
            code = "RESOURCE_EXHAUSTED" if isinstance(refused.error, ResourceExhausted) else "PERMISSION_DENIED"
            return Ack(ack.seq, AckStatus.REFUSED, detail=f"{code}: {refused}")
        return ack

    async def _claim_namespace(self, batch: EventBatch) -> None:
        """A tenant's namespaces are bounded (policy max_namespaces, else max_namespaces_per_tenant): made-up
        models would otherwise each add a block map, and take shared tables (the replica's followed namespaces).
        One node opens at most half of them (all of them when ``allowed_nodes`` names it alone, as
        ``_check_quota``'s share): one node's key opening made-up models up to the limit otherwise left the
        tenant's other nodes unable to publish a new model (a new weight version). Both are checked in the claim's
        script (claim_namespace.lua), given ``-limit`` for "with the per-node share"."""
        tenant = await self.authz.tenant(batch.namespace.tenant)
        limit = (tenant.policy.max_namespaces if tenant else 0) or self.config.max_namespaces_per_tenant
        policy = tenant.policy if tenant else None
        alone = policy is not None and policy.allowed_nodes == (batch.node_id,) and not policy.allowed_pools
        if await self.block_map.claim_namespace(batch.node_id, batch.namespace, limit if alone else -limit):
            return
        share = limit if alone else max(1, limit // 2)
        raise BatchRefused(ResourceExhausted(
            f"tenant {batch.namespace.tenant!r} already has its limit of {limit} namespaces (model, weights, "
            f"cache config) holding blocks, or node {batch.node_id!r} already opened its share of them ({share}: "
            "one node opens at most half, so that no node fills them for the others); nothing of this batch was "
            "applied (an admin raises it: `kvmesh admin tenants policy --max-namespaces N`, or allows this node "
            "alone in allowed_nodes; a namespace whose blocks are gone stops counting after "
            "namespace_release_after_s)"))

    async def _check_node_entries(self, batch: EventBatch) -> None:
        """A node holds at most max_entries_per_node blocks in the map: made-up blocks published with one node
        key would otherwise grow Redis without bound, and with it every tenant's refusals once it is full."""
        limit = self.config.max_entries_per_node
        stored = sum(len(e.block_hashes) for e in batch.events if isinstance(e, Stored))
        if not limit or not stored:
            return
        now = time.monotonic()
        read_at, held = self._node_entries.get(batch.node_id, (0.0, 0))
        if now - read_at > NODE_ENTRIES_TTL_S or held + stored > limit:  # re-read before any refusal
            read_at, held = now, await self.block_map.node_entries(batch.node_id)
        if held + stored > limit:
            raise BatchRefused(ResourceExhausted(
                f"node {batch.node_id!r} holds {held} blocks in the block map and this batch stores {stored} more: "
                f"past its limit of {limit} (max_entries_per_node); nothing of this batch was applied (blocks it "
                "removes, or tiers it clears, make room; an operator raises the setting for a node this large)"))
        self._node_entries[batch.node_id] = (read_at, held + stored)  # counted as if every block were new

    async def _check_quota(self, principal: Principal, batch: EventBatch) -> None:
        """The tenant's max_index_entries, of which one node holds at most half (unless the policy allows that
        node alone): one node's key would otherwise fill the quota with made-up blocks and refuse every other
        node's batches of the tenant."""
        tenant = await self.authz.tenant(batch.namespace.tenant)
        limit = tenant.policy.max_index_entries if tenant else 0
        stored = [h for e in batch.events if isinstance(e, Stored) for h in e.block_hashes]
        if not limit or not stored:
            return
        policy = tenant.policy
        share = limit if policy.allowed_nodes == (batch.node_id,) and not policy.allowed_pools else limit // 2
        total = await self.tenants.index_entries(tenant.tenant_id)
        held = await self.block_map.node_entries(batch.node_id, tenant.tenant_id)
        if total + len(stored) <= limit and held + len(stored) <= share:
            return
        _, new = await self.block_map.count_new(batch.namespace, stored)
        if total + new > limit:
            raise BatchRefused(ResourceExhausted(
                f"tenant {tenant.tenant_id!r} would exceed its quota of {limit} index entries "
                f"({total} stored, {new} new); nothing of this batch was applied"))
        if held + new > share:
            raise BatchRefused(ResourceExhausted(
                f"node {batch.node_id!r} holds {held} of tenant {tenant.tenant_id!r}'s index entries and this batch "
                f"adds {new}: one node holds at most half of the tenant's quota of {limit} ({share}), so that no "
                "node fills it for the others; nothing of this batch was applied (blocks it removes make room; an "
                "admin raises max_index_entries, or allows this node alone in allowed_nodes)"))

    # -- lookups and grants ---------------------------------------------------------

    async def lookup_prefix(
        self,
        principal: Principal,
        ns: Namespace,
        block_hashes: Sequence[bytes],
        token_ids: list[int],
        extras: Extras,
        tiers: int,
    ) -> PrefixMatch:
        """Live holders of the longest prefix. What the principal may not see answers like absent blocks.
        ``block_hashes``: a list, or a :class:`PackedHashes` (checked here: whole hashes of the namespace's size)."""
        if block_hashes and token_ids:
            raise InvalidArgument("give block_hashes (or packed_block_hashes) or token_ids, not both")
        cfg = ns.cache_config
        if token_ids:
            if len(token_ids) // cfg.block_size > self.config.max_lookup_blocks:
                raise InvalidArgument(
                    f"{len(token_ids)} tokens make more than {self.config.max_lookup_blocks} blocks"
                )
            block_hashes = await cfg.hasher().block_hashes_in_turns(token_ids, cfg.block_size, extras,
                                                                    self._hashing.turn(principal.key_id))
        queried = len(block_hashes)
        if queried > self.config.max_lookup_blocks:
            raise InvalidArgument(f"{queried} block hashes; the limit is {self.config.max_lookup_blocks}")
        digest = cfg.hash_algo.digest_size
        if isinstance(block_hashes, PackedHashes):
            block_hashes.validate(cfg.hash_algo.value)
        elif block_hashes and set(map(len, block_hashes)) != {digest}:  # map(len): C speed on 64k hashes
            i = next(i for i, h in enumerate(block_hashes) if len(h) != digest)
            raise InvalidArgument(
                f"block_hashes[{i}] has {len(block_hashes[i])} bytes; {cfg.hash_algo.value} hashes are {digest}"
            )
        tenant = await self.authz.tenant(ns.tenant)
        if tenant is None or not await self.authz.may_read(principal, ns.tenant):
            match = PrefixMatch(queried, [])
        else:
            match = await self.block_map.lookup_prefix(ns, block_hashes, tiers)
            if tenant.policy.allowed_nodes or tenant.policy.allowed_pools:
                allowed = [h for h in match.holders if await self._allows(tenant.policy, h.node_id)]
                match = PrefixMatch(match.blocks_queried, allowed)
        if token_ids:
            match = PrefixMatch(match.blocks_queried, match.holders, block_hashes)
        return match

    async def watch_block_map(self, principal: Principal, ns: Namespace) -> AsyncIterator[BlockMapUpdate]:
        """``ns``'s block map for a subscriber's replica, if the principal may read ``ns``'s tenant (checked
        again every policy_ttl_s, with the key's revocation); holders limited by the tenant's node policy."""
        ns.validate()
        if self._watch is None:
            raise FailedPrecondition("this control plane runs without read_replica: WatchBlockMap is off")
        if not await self._may_watch(principal, ns.tenant):
            raise await self.authz.deny(principal, "WatchBlockMap", ns.tenant,
                                        f"this key may not read tenant {ns.tenant!r}")

        async def allows(node_id: str) -> bool:
            tenant = await self.authz.tenant(ns.tenant)
            return tenant is not None and await self._allows(tenant.policy, node_id)

        async def still_allowed() -> bool:
            return await self._may_watch(principal, ns.tenant, recheck_key=True)

        blocks_key = await self._blocks_key(ns)
        # closed with this generator, not when the collector gets to it: it holds one of the key's watches
        async with contextlib.aclosing(self._watch.updates(principal.key_id, blocks_key, allows, still_allowed,
                                                           max(self.config.policy_ttl_s, 0.5))) as updates:
            async for update in updates:
                yield update

    async def _may_watch(self, principal: Principal, tenant_id: str, recheck_key: bool = False) -> bool:
        if recheck_key and principal.key_id != BOOTSTRAP_KEY_ID:
            key = await self.tenants.get_key(principal.key_id)
            if key is None or key.revoked:
                return False
        return await self.authz.tenant(tenant_id) is not None and await self.authz.may_read(principal, tenant_id)

    async def issue_pull_grant(self, principal: Principal, ns: Namespace, source_node_id: str,
                               consumer_public_key: bytes) -> tuple[bytes, int, str]:
        """A grant for the calling node to pull ``ns`` blocks from ``source_node_id``, bound to the node's
        peer public key; with its expiry and the source's registered address ("" when not registered)."""
        validate_node_id(source_node_id)
        if len(consumer_public_key) != 32:
            raise InvalidArgument("consumer_public_key must be the node's raw 32-byte Ed25519 peer key")
        if principal.role is not Role.NODE:
            raise await self.authz.deny(principal, "IssuePullGrant", source_node_id,
                                        "pull grants are issued to nodes (the consumer pulls with its own key)")
        tenant = await self.authz.tenant(ns.tenant)
        source_allowed = tenant is not None and await self._allows(tenant.policy, source_node_id)
        if not await self.authz.may_read(principal, ns.tenant) or not source_allowed:
            raise await self.authz.deny(principal, "IssuePullGrant", f"{ns.tenant}@{source_node_id}",
                                        f"no pull grant for tenant {ns.tenant!r} from node {source_node_id!r}")
        expires = int(time.time() * 1000) + self.config.grant_ttl_ms
        address = next((n.node.data_plane_address for n in await self.block_map.list_nodes()
                        if n.node.node_id == source_node_id and n.live), "")
        grant = Grant(ns.tenant, ns.fingerprint, principal.node_id, encode_public_key(consumer_public_key),
                      source_node_id, expires, source_address=address, tenant_epoch=tenant.epoch)
        return self.signer.sign(grant), expires, address

    async def tenant_limits(self, principal: Principal, tenant_id: str) -> tuple[int, str]:
        """The CPU-tier bytes the calling node may hold for ``tenant_id`` (0: no limit) and the tenant's epoch
        (data planes serve only blocks stored under it). NotFound to a node when the tenant does not exist or
        its policy does not allow the node, in the same words (a node key cannot tell the two apart; the
        node drops the tenant's blocks either way), and to an admin when it does not exist."""
        if principal.role not in (Role.ADMIN, Role.NODE):
            raise await self.authz.deny(principal, "GetTenantLimits", tenant_id,
                                        "GetTenantLimits needs a node or admin key")
        validate_tenant(tenant_id)
        tenant = await self.authz.tenant(tenant_id)
        if principal.role is Role.NODE and (tenant is None or not tenant.policy.allows_node(principal.node_id,
                                                                                           principal.pool)):
            # audited either way, so the time of the answer does not tell the two apart either
            reason = (f"tenant {tenant_id!r} does not exist or does not allow node {principal.node_id!r} "
                      "to hold its blocks")
            raise NotFound(str(await self.authz.deny(principal, "GetTenantLimits", tenant_id, reason)))
        if tenant is None:
            raise NotFound(f"tenant {tenant_id!r} does not exist")
        return tenant.policy.max_cpu_tier_bytes_per_node, tenant.epoch

    async def _allows(self, policy, node_id: str) -> bool:
        """Does the tenant policy allow the node? Pools are looked up only when the policy names any."""
        if policy.allows_node(node_id, ""):
            return True
        if not policy.allowed_pools:
            return False
        return policy.allows_node(node_id, (await self._node_pools()).get(node_id, ""))

    async def _node_pools(self) -> dict[str, str]:
        """Each node's pool, listed again only after ``policy_ttl_s`` (as a tenant's policy is cached; a node
        registered since is in no pool until then), one listing at a time: a lookup of a tenant whose policy names
        pools asks for each holder it answers, a watch for each node it names (before: one listing, a Redis round
        trip per node, per holder)."""
        listed_at, pools = self._pools
        if time.monotonic() - listed_at < self.config.policy_ttl_s:
            return pools
        if self._pools_listing is None or self._pools_listing.done():
            self._pools_listing = asyncio.ensure_future(self._list_pools())
        return await asyncio.shield(self._pools_listing)

    async def _list_pools(self) -> dict[str, str]:
        pools = {s.node.node_id: s.node.pool for s in await self.block_map.list_nodes()}
        self._pools = (time.monotonic(), pools)
        return pools

    # -- routing (control_plane.routing) --------------------------------------------

    async def route(self, principal: Principal, request: RouteRequest) -> RouteDecision:
        """Where to run a prompt; sees the block map through the caller's lookup rights. A named source
        carries a route token (data planes with require_route_token pull only from such sources).

        Only the namespace's own tenant (its schedulers) or an admin acts *as* the tenant: its routes are recorded
        as speculative holdings, its pulls booked in the ledger as the tenant's, and it gets prefetch orders.
        Anyone else who may read the namespace routes as itself: a node key (it may read every tenant that allows
        it) or another tenant's scheduler reading a namespace shared with it (``shared_with``). Their routes are
        answered but not recorded (they would steer the tenant's next requests to engines of their choosing, and
        fill the tenant's share of the speculative entries), their pulls are booked under their own node or
        tenant (one booker at most doubles another's estimated wait: routing.ledger), and a sharee gets no
        prefetch order (it would run against the tenant's share of the destination's prefetch cap; its engine
        pulls when it runs); a node key's order is for its own node only."""
        tenant = await self.authz.tenant(request.namespace.tenant)
        may_read = tenant is not None and await self.authz.may_read(principal, request.namespace.tenant)
        node_key = principal.role is Role.NODE
        as_tenant = principal.role is Role.ADMIN or (principal.role is Role.SCHEDULER
                                                     and principal.tenant_id == request.namespace.tenant)
        booker = ("node", principal.node_id) if node_key else None if as_tenant else principal.tenant_id
        node_allowed = None  # a caller who may not read the tenant learns nothing of it (nor that it exists)
        if may_read and (tenant.policy.allowed_nodes or tenant.policy.allowed_pools):
            request, node_allowed = await self._policy_candidates(request, tenant.policy)
        decision = await self.router.route(request, functools.partial(self.lookup_prefix, principal), may_read,
                                           records=as_tenant, booker=booker, node_allowed=node_allowed)
        if decision.source is None:
            return decision
        source = decision.source
        token = self.signer.sign(RouteToken(request.namespace.tenant, source.node_id, source.address,
                                            int(time.time() * 1000) + self.config.grant_ttl_ms))
        source = dataclasses.replace(source, route_token=token.decode())
        order = None
        if self.config.route_prefetch and (as_tenant or node_key):  # route-time prefetch (control_plane.prefetch)
            order = await prefetch_order(
                request, decision.engine_id, source, nodes=self.block_map.list_nodes, signer=self.signer,
                node_allowed=lambda node_id: self._allows(tenant.policy, node_id),
                ttl_ms=self.config.route_prefetch_ttl_ms, hashing_turn=self._hashing.turn(principal.key_id),
                caller_node=principal.node_id if principal.role is Role.NODE else None)
        return dataclasses.replace(decision, source=source, prefetch=order)

    async def _policy_candidates(self, request: RouteRequest, policy):
        """The request without the candidates on nodes the namespace's tenant policy excludes (``allowed_nodes`` /
        ``allowed_pools``: where its blocks may be held, its prompts run), and the check the router applies to
        sources. A scheduler naming such a node (or anyone routing the tenant's namespace) would otherwise have the
        tenant's prompt, and a pull of its KV, sent to a node the tenant does not trust, whenever the cost model
        (fed by that node's own reports) favoured it. FailedPrecondition when no candidate is left, naming the nodes
        and pools the policy allows (the caller may read the tenant: its scheduler, an admin, a sharee, an allowed
        node; one who may not is answered as for a tenant that does not exist, without the check: it sees no
        holder and routes no prompt of the tenant's)."""
        request.validate()  # the candidates' ids, before they are looked up
        node_allowed = functools.partial(self._allows, policy)
        kept = tuple([c for c in request.candidates if await node_allowed(c.node_id)])
        if kept:
            return dataclasses.replace(request, candidates=kept), node_allowed

        def some(names: tuple[str, ...]) -> str:
            shown = ", ".join(map(repr, names[:16]))
            return shown + (f" and {len(names) - 16} more" if len(names) > 16 else "") if names else "none"
        raise FailedPrecondition(
            f"none of the {len(request.candidates)} candidates runs on a node tenant {request.namespace.tenant!r}'s "
            f"policy allows (allowed_nodes: {some(policy.allowed_nodes)}; allowed_pools: "
            f"{some(policy.allowed_pools)}); name candidates on those nodes, or an admin changes the policy")

    async def report_stats(self, principal: Principal, report: StatsReport) -> None:
        if principal.role is Role.SCHEDULER:
            raise await self.authz.deny(principal, "ReportStats", principal.tenant_id,
                                        "measured figures come from nodes (or an admin), not schedulers")
        if principal.role is Role.NODE and any(s.dest_node_id != principal.node_id for s in report.links):
            raise await self.authz.deny(principal, "ReportStats", principal.node_id,
                                        "a node reports the bandwidth of pulls into itself only")
        if principal.role is Role.NODE and report.engines:
            others = [s.node.node_id for s in await self.block_map.list_nodes()
                      if s.node.node_id.startswith(principal.node_id + ":")]
            if not all(owns_engine(principal.node_id, e.engine_id, others) for e in report.engines):
                raise await self.authz.deny(principal, "ReportStats", principal.node_id,
                                            "a node reports its own engines only (engine id = node id, or "
                                            "'<node id>:<name>' that names no other registered node)")
        await self.router.report(report, principal.node_id if principal.role is Role.NODE else "")

    # -- background --------------------------------------------------------------

    def start_background(self) -> None:
        if self._gc_task is None:
            self._gc_task = asyncio.create_task(self._gc_loop(), name="kvmesh-cp-gc")

    async def _gc_loop(self) -> None:
        """Collects every ``gc_interval_s`` until :meth:`close`. It ends on ``_closing`` as well as on its
        cancellation: a cancellation that lands inside a Redis call can come back as that call's error (or
        nothing), and the loop would then sleep on, "cancelling" for ever, with close() waiting for it."""
        while not self._closing:
            await asyncio.sleep(self.config.gc_interval_s)
            try:
                freed = await self.block_map.collect_garbage()
                if freed:
                    log.info("swept %d fenced node slots", freed)
            except Exception:  # noqa: BLE001 - the loop must survive a Redis outage
                if self._closing:
                    return
                log.warning("garbage collection failed; will retry", exc_info=True)

    async def close(self) -> None:
        self._closing = True
        if self._gc_task is not None:
            self._gc_task.cancel()
            await asyncio.wait({self._gc_task}, timeout=GC_STOP_WAIT_S)  # bounded whatever Redis does
        await self.block_map.close()
        await self.router.close()
        await self.tenants.close()
