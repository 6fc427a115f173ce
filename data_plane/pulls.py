"""A node's pulls: bringing blocks another node holds into this node's CPU tier.

One pull (:meth:`Pulls.run`, started by :meth:`data_plane.core.DataPlaneCore.pull`, which bounds it and lets it
finish if its caller goes away): the blocks already here are counted, those another pull on this node is bringing
are joined (:attr:`Pulls.arriving`: one future per pull, shared by its blocks), and the rest are fetched from the
source: the tenant's limit, the route token and the grant are checked, the source's Lookup pins its HITs under a
lease, slots of the source's own landing arena here (:mod:`data_plane.landing`) and tier slots are taken for the
leading HITs (the tier's in one call, :meth:`MemoryTier.reserve_run`), the bytes land in the arena (the source
WRITEs them there, the lease's send names the slots; or, from a ``serve_peer_reads`` source, this node READs them
there one-sided), and each run is copied into its tier slots and the copy checked against the source's CRC-32Cs
in one native call (:class:`~data_plane.checksum.RunChecker`; during a WRITE, each piece as the source reports
it landed: :class:`~data_plane.checksum.LandingChecks`), then the leading intact blocks are committed in one
tier call. The NIXL transfer itself takes one descriptor per run of slots contiguous on both nodes, split over
``transfer_lanes`` requests (:mod:`data_plane.transfer`).

Failure policy: a source that is unreachable, refuses, times out or sends a bad block is a MISS for what did not
arrive. No transfer reaches the tier, so the tier slots of a failed one are freed at once; its arena slots, when
the transfer may still be writing into them, are held by the node (:mod:`data_plane.quarantine`) until the
source proves it over: a failing source costs only its own arena.

The pull path shares the node's tier, its writers ledger (who reserved an uncommitted block), its quarantine and
its background tasks, so it is given the node itself (:class:`~data_plane.core.DataPlaneCore`) and reaches its
quarantine through it. Threading model: the node's event loop only (the CRC checks and NIXL polling run in worker
threads).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from itertools import compress, count, repeat
from operator import add, attrgetter, is_
from typing import TYPE_CHECKING, Awaitable

import numpy as np

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvmesh import tracing
from kvmesh.errors import FailedPrecondition, InvalidArgument, PermissionDenied, Unavailable
from kvmesh.namespace import Namespace
from kvmesh.tracing import ATTR

from data_plane.checksum import LandingChecks
from data_plane.events import EventSink
from data_plane.eviction import block_info
from data_plane.peers import Peer
from data_plane.epochs import GONE
from data_plane.landing import LandingArena
from data_plane.tier import Block, BlockState
from data_plane.transfer import LandingArenasFull, NotPosted, TransferFailed, Transport
from data_plane.types import BlockKey, LookupAnswer, LookupStatus, Medium, PullResult, block_keys
from tenancy.grants import read_grant

if TYPE_CHECKING:
    from data_plane.core import DataPlaneCore

log = logging.getLogger(__name__)

PULL_WRITER = "pull"  # the writers-ledger tag of a block a pull reserved
# one field of each block, read in native loops (map) rather than a Python step per block
KEY, SLOT, STATE, EPOCH = attrgetter("key"), attrgetter("slot"), attrgetter("state"), attrgetter("epoch")
BLOCK_HASH = attrgetter("key.block_hash")
_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
# A send refused with these never started its WRITE: the landing slots are free again.
_REFUSED_BEFORE_WRITE = {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
                         grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                         grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}


class Pulls:
    def __init__(self, node: "DataPlaneCore") -> None:
        self._node = node
        self.node_id = node.node_id
        self.config = node.config
        self.region = node.region
        self.block_bytes = node.block_bytes
        self.tier = node.tier
        self.epochs = node.epochs
        self.metrics = node.metrics
        self._peers = node._peers
        self._checker = node._checker
        self._writers = node._writers
        self._namespaces = node._namespaces
        self._tenant_limits = node._tenant_limits
        self._grants, self._limits, self._routes = node._grants, node._limits, node._routes
        # blocks an in-flight pull is bringing (claimed before its first await, so a concurrent pull or a
        # peer's Lookup waits for them instead of fetching them again); resolved when the pull settles them
        self.arriving: dict[BlockKey, asyncio.Future] = {}
        self.in_flight: set[asyncio.Task] = set()  # pulls running

    @property
    def events(self) -> EventSink:
        return self._node.events  # the node's sink is set once the server has a publisher

    @property
    def transport(self) -> Transport:
        return self._node.transport

    async def run(self, ns: Namespace, hashes: list[bytes], source_node_id: str, source_address: str,
                    deadline: float, source_media: frozenset[Medium], first_block_index: int,
                    grant: bytes, route_token: bytes) -> PullResult:
        """One pull, within ``deadline`` (time.monotonic()): the blocks of ``hashes`` this node has committed,
        joined or fetched now (HIT), MISS for the rest."""
        self._namespaces.setdefault(ns.fingerprint, ns)
        fp = ns.fingerprint
        keys = block_keys(fp, hashes)
        held = self.tier.get_all(keys)
        epoch = self.epochs.current(ns.tenant)
        if held.count(None) == len(keys) and self.arriving.keys().isdisjoint(keys):  # the usual pull: all new
            already_local, own, joined = 0, list(range(len(keys))), []
        else:
            already_local, own, joined = self._classify(keys, held, epoch)
        claim = asyncio.get_running_loop().create_future()  # one for all the blocks this pull brings
        claims = keys if len(own) == len(keys) else [keys[i] for i in own]
        self.arriving.update(dict.fromkeys(claims, claim))
        fetched, lookup_ms, transfer_ms, refused = (), 0.0, 0.0, ""
        try:
            if own:
                fetched, lookup_ms, transfer_ms, refused = await self._fetch(
                    ns, hashes, own, source_node_id, source_address, deadline, source_media, first_block_index,
                    grant, route_token)
        finally:
            # a claimed key is this pull's until dropped here (another pull joins it, never claims it again)
            deque(map(self.arriving.pop, claims, repeat(None)), maxlen=0)
            claim.set_result(None)
        for i in joined:
            await self.arrival(keys[i], deadline)
        statuses = self._statuses(keys, self.epochs.current(ns.tenant))
        leading = next(compress(count(), map(is_, statuses, repeat(LookupStatus.MISS))), len(statuses))
        joined_in_lead = sum(1 for i in joined if i < leading)
        self.metrics.joined(joined_in_lead)
        return PullResult(statuses, leading - already_local, already_local, len(fetched) * self.block_bytes,
                          lookup_ms, transfer_ms, joined=joined_in_lead, refused=refused, checked=fetched)

    def _classify(self, keys: list[BlockKey], held: list[Block | None], epoch: str
                  ) -> tuple[int, list[int], list[int]]:
        """(leading blocks committed here already, indexes this pull fetches, indexes another writer on this
        node is bringing), in chain order."""
        already_local = 0
        own: list[int] = []
        joined: list[int] = []
        for i, (key, block) in enumerate(zip(keys, held)):
            if block is not None and block.committed:
                # one of an ended epoch is not fetched again while a reader still pins it: a MISS
                already_local += i == already_local and self.epochs.serves(block.epoch, epoch)
            elif block is not None or key in self.arriving:
                joined.append(i)
            else:
                own.append(i)
        return already_local, own, joined

    def _statuses(self, keys: list[BlockKey], epoch: str) -> list[LookupStatus]:
        """HIT for each key committed here under ``epoch``, MISS for the others."""
        held = self.tier.get_all(keys)
        if None not in held and all(map(is_, map(STATE, held), repeat(BlockState.COMMITTED))) and \
                set(map(EPOCH, held)) == {epoch} and epoch is not GONE:
            return [LookupStatus.HIT] * len(keys)
        return [LookupStatus.HIT if b is not None and b.committed and self.epochs.serves(b.epoch, epoch)
                else LookupStatus.MISS for b in held]

    async def arrival(self, key: BlockKey, deadline: float) -> Block | None:
        """The committed block once whoever is bringing it here settles it; None if not by ``deadline``."""
        claim = self.arriving.get(key)
        if claim is not None:
            try:
                await asyncio.wait_for(asyncio.shield(claim), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return None
        block = self.tier.get(key)
        if block is not None and not block.committed:
            await self.tier.wait_settled(block, max(0.0, deadline - time.monotonic()))
            block = self.tier.get(key)
        return block if block is not None and block.committed else None

    async def _within(self, awaitable: Awaitable, deadline: float, what: str):
        """``awaitable`` bounded by the pull's deadline; Unavailable when it runs out."""
        try:
            return await asyncio.wait_for(awaitable, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise Unavailable(f"{what} did not finish within the pull's deadline") from None

    async def _fetch(self, ns: Namespace, hashes: list[bytes], wanted: list[int], source_node_id: str,
                     source_address: str, deadline: float, source_media: frozenset[Medium],
                     first_block_index: int, grant: bytes, route_token: bytes
                     ) -> tuple[tuple[Block, ...], float, float, str]:
        """Brings ``wanted`` (indexes, chain order) from the source; (the blocks it checked and committed, lookup
        ms, transfer ms, why it was refused before any transfer, or "")."""
        refusal = self._node.quarantine.refusal()
        if refusal:
            log.warning("pull from %s: %s; answering MISS", source_address, refusal)
            return (), 0.0, 0.0, refusal
        try:
            limit = None
            if self._limits is not None:
                try:
                    limit = await self._within(self._limits(ns.tenant, deadline - time.monotonic()), deadline,
                                               "the tenant's limits")
                    self._tenant_limits[ns.tenant] = limit
                except PermissionDenied as exc:
                    log.info("pull: %s; answering MISS", exc)
                    return (), 0.0, 0.0, str(exc)
            if self._routes is not None:
                await self._within(self._routes(route_token, ns.tenant, source_node_id, source_address), deadline,
                                   "checking the route token")
            if not grant:
                if self._grants is None:
                    raise PermissionDenied("no pull grant and no control plane to ask for one")
                grant, registered = await self._within(
                    self._grants(ns, source_node_id, deadline - time.monotonic()), deadline, "the grant")
                if registered != source_address:  # e.g. a remote_kv_source naming an address of its own
                    raise PermissionDenied(
                        f"{source_address} is not the registered address of node {source_node_id} "
                        f"({registered or 'not registered'}): refusing to dial it")
            grant_epoch = read_grant(grant).tenant_epoch  # the source serves only blocks of this epoch
            if not self.epochs.serves(grant_epoch, self.epochs.current(ns.tenant)):
                raise Unavailable(f"the grant is for epoch {grant_epoch!r} of tenant {ns.tenant!r}, this node "
                                  f"knows {self.epochs.current(ns.tenant)!r} (the tenant was re-created)")
            await self.transport.ready(deadline - time.monotonic())
            peer = self._peers.cached(source_address) or await self._within(
                self._peers.get(source_address, source_node_id, deadline - time.monotonic(), grant),
                deadline, "the handshake")
            if self._node.quarantine.renew_arena(peer.node_id):  # its failures held half its arena or more
                await self._peers.forget(peer)  # the source is handed the fresh arena at a new handshake
                peer = await self._within(
                    self._peers.get(source_address, source_node_id, deadline - time.monotonic(), grant),
                    deadline, "the handshake")
        except (Unavailable, PermissionDenied) as exc:  # no grant or no source: the engine recomputes
            log.warning("pull from %s: %s; answering MISS", source_address, exc)
            if isinstance(exc, LandingArenasFull):  # every arena goes with the agent, once no transfer runs
                self._node._spawn(self._node.quarantine.renew_transport())
            return (), 0.0, 0.0, str(exc) if isinstance(exc, PermissionDenied) else ""
        if source_node_id and peer.node_id != source_node_id:
            log.warning("pull: %s is node %s, not %s (stale route); answering MISS",
                        source_address, peer.node_id, source_node_id)
            return (), 0.0, 0.0, ""
        arena = self.transport.landing_arena(peer.node_id)  # made at the handshake, for this source only
        if arena is None or not arena.free_slots:
            refusal = self._arena_refusal(peer.node_id, arena)
            log.warning("pull from %s: %s; answering MISS", source_address, refusal)
            return (), 0.0, 0.0, refusal

        t0 = time.perf_counter()
        if peer.agent_name:  # the source hands out its metadata: READ one-sided
            fetched = await self._fetch_by_read(peer, ns, hashes, wanted, source_media, deadline, grant,
                                                first_block_index, limit, arena)
        else:  # the source WRITEs what the grant covers into the slots reserved here
            fetched = await self._fetch_by_write(peer, ns, hashes, wanted, source_media, deadline, grant,
                                                 first_block_index, limit, arena)
        if fetched is None:
            return (), (time.perf_counter() - t0) * 1000, 0.0, ""
        blocks, checksums, lookup_ms, transfer_ms, good = fetched
        arrived = bool(blocks)
        committed: list[Block] = []
        if arrived:
            # bytes of the grant's epoch are kept only under that epoch, still the tenant's current one
            intact = self.epochs.serves(grant_epoch, self.epochs.current(ns.tenant)) and \
                set(map(EPOCH, blocks)) == {grant_epoch}
            if not intact:
                good = 0
            if intact and good < len(blocks):
                log.error("pull from %s: block %s failed verification; it and its successors are dropped",
                          source_address, blocks[good].key.block_hash.hex())
                self.metrics.verify_failed()
            committed = blocks[:good]
            self.tier.commit_written(committed, checksums[:good])
            for block in blocks[good:]:
                self.tier.abort(block)
        self._forget_writers(blocks)
        if committed:
            self.events.stored(ns, list(map(BLOCK_HASH, committed)), Medium.CPU)
        n = len(committed)
        trace.get_current_span().set_attributes({  # the Pull server span this task inherited
            ATTR.TENANT: ns.tenant, ATTR.NAMESPACE: ns.fingerprint, ATTR.BLOCKS: n, ATTR.BYTES: n * self.block_bytes,
            ATTR.SOURCE_NODE: source_node_id, ATTR.OUTCOME: "pulled" if n else "miss"})
        self.metrics.bytes("pulled", n * self.block_bytes)
        self.metrics.pull((lookup_ms + transfer_ms) / 1000, n, len(wanted) - n)
        return tuple(committed), lookup_ms, transfer_ms, ""

    def _arena_refusal(self, source_node_id: str, arena: LandingArena | None) -> str:
        """Why nothing can land from that source now (its arena has no free slot)."""
        if arena is None:
            return f"no landing arena for node {source_node_id} (this node's NIXL agent was just replaced); retry"
        held = self._node.quarantine.reclaimer.held_in(arena)
        if 2 * held >= arena.slots:
            return (f"node {source_node_id}'s failed transfers hold {held} of the {arena.slots} slots of its "
                    "landing arena here until it proves them over, and its arena was renewed as often as "
                    "landing_renewals_per_source allows; it is not pulled from until some are free")
        if held:
            return (f"node {source_node_id}'s failed transfers hold {held} of the {arena.slots} slots of its "
                    "landing arena here, pulls from it in flight the rest")
        return f"pulls from node {source_node_id} in flight fill its landing arena here ({arena.slots} slots)"

    def _take_landing(self, ns: Namespace, hashes: list[bytes], wanted: list[int], first_block_index: int,
                      tenant_limit_bytes: int | None, answer: LookupAnswer, arena: LandingArena
                      ) -> tuple[list[Block], np.ndarray, list[int], list[int]]:
        """Tier slots for the leading HITs of ``answer``, no more than its source's arena has free slots for (nor
        evictions): (the blocks, their arena slots, their remote addresses, their checksums)."""
        landing = arena.take(len(wanted))
        blocks, remote_addrs, checksums = self._reserve_for_pull(ns, hashes, wanted, first_block_index,
                                                                 tenant_limit_bytes, answer, at_most=len(landing))
        arena.give_back(landing[len(blocks):])
        return blocks, landing[:len(blocks)], remote_addrs, checksums

    def _settle_landing(self, arena: LandingArena, landing: np.ndarray, blocks: list[Block], may_still_write: bool,
                        peer: Peer, ns: Namespace, lease_id: str, grant: bytes) -> None:
        """After a failed transfer: its tier blocks are aborted (no transfer reaches the tier) and its arena slots
        go back, or, when the transfer may still write into them, are held until that is proven over."""
        self._abort(blocks)
        if may_still_write:
            self._node.quarantine.add(arena, landing, peer, ns, lease_id, grant)
        else:
            arena.give_back(landing)

    async def _fetch_by_read(self, peer: Peer, ns: Namespace, hashes: list[bytes], wanted: list[int],
                             source_media: frozenset[Medium], deadline: float, grant: bytes, first_block_index: int,
                             tenant_limit_bytes: int | None, arena: LandingArena
                             ) -> tuple[list[Block], list[int], float, float, int] | None:
        """Lookup on the source, then one-sided READs into its arena here, each run copied into the tier and the
        copy checked: the arrived blocks (uncommitted), their checksums, and how many leading ones are intact."""
        t0 = time.perf_counter()
        answer = await self._remote_lookup(peer, ns, [hashes[i] for i in wanted], source_media, deadline, grant)
        lookup_ms = (time.perf_counter() - t0) * 1000
        if answer is None:
            return None
        transfer_ms = 0.0
        try:
            blocks, landing, remote_addrs, checksums = self._take_landing(ns, hashes, wanted, first_block_index,
                                                                          tenant_limit_bytes, answer, arena)
            if not blocks:
                return None
            t1 = time.perf_counter()
            arrived = await self._transfer(peer, blocks, arena, landing, remote_addrs, deadline, grant)
            transfer_ms = (time.perf_counter() - t1) * 1000
        finally:
            if answer.lease_id:
                self._node._spawn(self._release_remote(peer, answer.lease_id, grant))
        if not arrived:
            return [], [], lookup_ms, transfer_ms, 0
        try:
            good = await self._checker.first_mismatch(self._slots(blocks), checksums if self.config.verify_pulls
                                                      else None, source=(arena.array, landing))
        finally:
            arena.give_back(landing)  # copied by now
        return blocks, checksums, lookup_ms, transfer_ms, good

    async def _fetch_by_write(self, peer: Peer, ns: Namespace, hashes: list[bytes], wanted: list[int],
                              source_media: frozenset[Medium], deadline: float, grant: bytes, first_block_index: int,
                              tenant_limit_bytes: int | None, arena: LandingArena
                              ) -> tuple[list[Block], list[int], float, float, int] | None:
        """Asks the source which wanted blocks it holds (a plain Lookup, which pins its HITs under a lease:
        nothing is reserved or evicted here for a source that is down or holds nothing), reserves tier slots
        for the leading HITs, as many as its landing arena has room for, and has the source WRITE the blocks of
        that lease into the arena and end it (the send), then copies them into the tier (:meth:`_sent`): the
        arrived blocks (uncommitted), their checksums, and how many leading ones are intact; the rest is
        aborted."""
        t0 = time.perf_counter()
        answer = await self._remote_lookup(peer, ns, [hashes[i] for i in wanted], source_media, deadline, grant)
        lookup_ms = (time.perf_counter() - t0) * 1000
        if answer is None:
            return None
        blocks, landing, _, checksums = self._take_landing(ns, hashes, wanted, first_block_index,
                                                           tenant_limit_bytes, answer, arena)
        if not blocks:
            if answer.lease_id:
                self._node._spawn(self._release_remote(peer, answer.lease_id, grant))
            return None
        return await self._sent(peer, ns, blocks, checksums, arena, landing, answer, deadline, grant, lookup_ms)

    async def _sent(self, peer: Peer, ns: Namespace, blocks: list[Block], checksums: list[int],
                    arena: LandingArena, landing_slots: np.ndarray, answer: LookupAnswer, deadline: float,
                    grant: bytes, lookup_ms: float) -> tuple[list[Block], list[int], float, float, int] | None:
        """Has the source WRITE the lease's leading blocks into ``landing_slots`` of its arena, then copies each
        one into its tier slot and checks the copy: (the blocks, checksums, lookup ms, transfer ms, how many
        leading blocks are intact); None when the send failed (its arena slots held if it may still write)."""
        slots = self._slots(blocks)
        source = (arena.array, landing_slots)
        # with pieces (transfer_piece_bytes, set fleet-wide) the blocks are copied and checked piece by piece as
        # the source reports them landed, while the rest moves; without, all are once the send has answered
        checks = LandingChecks(self._checker, slots, checksums, source) \
            if self.config.verify_pulls and self.config.transfer_piece_bytes else None
        t1 = time.perf_counter()
        outcome = "failed"
        try:
            with self.transport.landed(peer.incarnation, answer.lease_id.encode(), checks.landed) \
                    if checks is not None else contextlib.nullcontext():
                sent, block_bytes = await peer.client.send(
                    ns, answer.lease_id, list(map(BLOCK_HASH, blocks)), arena.addrs(landing_slots),
                    timeout=max(0.0, deadline - time.monotonic()), grant=grant)
            outcome = "ok" if block_bytes == self.block_bytes else "failed"
        except grpc.aio.AioRpcError as exc:
            clean = exc.code() in _REFUSED_BEFORE_WRITE
            log.warning("pull: %s refused or failed the send (%s: %s); answering MISS", peer.address,
                        exc.code().name, exc.details())
            if exc.code() not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                await self._peers.forget(peer)
            outcome = "failed" if clean else "may still write"
        except InvalidArgument as exc:
            log.warning("pull: %s sent %s; answering MISS", peer.address, exc)
            await self._peers.forget(peer)
            outcome = "may still write"
        transfer_ms = (time.perf_counter() - t1) * 1000
        if outcome != "ok":
            self._settle_landing(arena, landing_slots, blocks, outcome == "may still write", peer, ns,
                                 answer.lease_id, grant)
            return None
        try:
            if sent < len(blocks):  # the Lookup had pinned them: the WRITE failed (the source closed its endpoint)
                await self._peers.forget(peer)  # or the lease expired first
            self._abort(blocks[sent:])
            if checks is not None:
                good = await checks.first_mismatch(sent)
            else:
                good = await self._checker.first_mismatch(slots[:sent], checksums[:sent] if self.config.verify_pulls
                                                          else None, source=(arena.array, landing_slots[:sent]))
        finally:
            arena.give_back(landing_slots)  # copied by now; a late WRITE only fails a later check
        return blocks[:sent], checksums[:sent], lookup_ms, transfer_ms, good

    @staticmethod
    def _slots(blocks: list[Block]) -> np.ndarray:
        return np.fromiter(map(SLOT, blocks), dtype=np.int64, count=len(blocks))

    def _abort(self, blocks: list[Block]) -> None:
        """Frees the tier slots of blocks a pull reserved and will not commit."""
        self._forget_writers(blocks)
        for block in blocks:
            self.tier.abort(block)

    def _forget_writers(self, blocks: list[Block]) -> None:
        """Drops the blocks from the writers ledger (settled: committed, aborted or quarantined)."""
        deque(map(self._writers.pop, map(KEY, blocks), repeat(None)), maxlen=0)

    async def _remote_lookup(self, peer: Peer, ns: Namespace, hashes: list[bytes], media: frozenset[Medium],
                             deadline: float, grant: bytes) -> LookupAnswer | None:
        remaining = deadline - time.monotonic()
        try:
            answer, block_bytes = await peer.client.lookup(
                ns, hashes, consumer_node_id=self.node_id,
                pending_wait_ms=max(1, min(self.config.pending_wait_ms, int(remaining * 500))),
                lease_ms=max(1, int(remaining * 1000) + 5_000), media=media, timeout=remaining, grant=grant)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
                              grpc.StatusCode.RESOURCE_EXHAUSTED):  # e.g. its bound of live peer proofs
                log.warning("pull: %s refused the lookup (%s); answering MISS", peer.address, exc.details())
                return None
            if exc.code() in _UNREACHABLE:
                log.warning("pull: lookup on %s failed (%s); answering MISS", peer.address, exc.code().name)
                await self._peers.forget(peer)
                return None
            raise FailedPrecondition(f"source {peer.address} rejected the lookup: {exc.details()}") from None
        except InvalidArgument as exc:
            await self._peers.forget(peer)
            raise FailedPrecondition(f"source {peer.address} sent {exc}") from None
        if block_bytes != self.block_bytes:
            raise FailedPrecondition(f"source {peer.address} has {block_bytes}-byte blocks, this node "
                                     f"{self.block_bytes}")
        return answer

    def _reserve_for_pull(self, ns: Namespace, hashes: list[bytes], wanted: list[int], first_block_index: int,
                          tenant_limit_bytes: int | None, answer: LookupAnswer | None = None,
                          at_most: int | None = None) -> tuple[list[Block], list[int], list[int]]:
        """Local slots for the leading wanted blocks (the leading HITs of ``answer`` when given), at most
        ``at_most``, as many as fit within the tenant's limit; with ``answer``, also their remote addresses and
        checksums."""
        n = len(wanted)
        if answer is not None:
            hit = LookupStatus.HIT
            n = next((j for j, status in enumerate(answer.statuses) if status is not hit), n)
        if at_most is not None:
            n = min(n, at_most)
        fp, epoch = ns.fingerprint, self.epochs.current(ns.tenant)
        keys = block_keys(fp, map(hashes.__getitem__, wanted[:n]))
        infos = list(map(block_info, map(add, repeat(first_block_index), wanted[:n])))
        blocks: list[Block] = []
        while len(blocks) < n:  # again while evictions of the tenant's own blocks make room under its limit
            room = n - len(blocks)
            if tenant_limit_bytes is not None:
                room = min(room, tenant_limit_bytes // self.block_bytes - self.tier.tenant_slots(ns.tenant))
            if room <= 0:
                break
            got = self.tier.reserve_run(ns, keys[len(blocks):len(blocks) + room],
                                        infos[len(blocks):len(blocks) + room], epoch)
            blocks += got
            if len(got) < room:
                break
        self._writers.update(dict.fromkeys(map(KEY, blocks), PULL_WRITER))
        if answer is None:
            return blocks, [], []
        return blocks, answer.addrs[:len(blocks)], answer.checksums[:len(blocks)]

    async def _transfer(self, peer: Peer, blocks: list[Block], arena: LandingArena, landing: np.ndarray,
                        remote_addrs: list[int], deadline: float, grant: bytes) -> bool:
        """READs the blocks into ``landing`` slots of the source's arena; False (every block settled, MISS) when
        that failed."""
        ns = blocks[0].namespace
        attributes = {ATTR.TENANT: ns.tenant, ATTR.NAMESPACE: ns.fingerprint, ATTR.BLOCKS: len(blocks),
                      ATTR.BYTES: len(blocks) * self.block_bytes, ATTR.TIER: "cpu", ATTR.SOURCE_NODE: peer.node_id,
                      "kvmesh.transport": "nixl-ucx"}
        with tracing.tracer("kvmesh.data_plane").start_as_current_span(
                "kvmesh.nixl.read", kind=SpanKind.CLIENT, attributes=attributes) as span:
            try:
                await self.transport.read(peer.agent_name, arena.addrs(landing), remote_addrs, self.block_bytes,
                                          max(0.0, deadline - time.monotonic()))
                span.set_attribute(ATTR.OUTCOME, "ok")
                return True
            except TransferFailed as exc:
                span.set_attribute(ATTR.OUTCOME, "quarantined" if exc.may_still_write else "failed")
                span.set_status(Status(StatusCode.ERROR, str(exc)))
                log.warning("pull from %s failed: %s; answering MISS for %d blocks", peer.address, exc, len(blocks))
                # this node's own READ: only the source's exit proves it over
                self._settle_landing(arena, landing, blocks, exc.may_still_write, peer, ns, "", grant)
                if not isinstance(exc, NotPosted):  # a READ never posted (no thread in time) says nothing of the peer
                    await self._peers.forget(peer)
                return False

    async def _release_remote(self, peer: Peer, lease_id: str, grant: bytes) -> None:
        try:
            await peer.client.release(lease_id, timeout=5.0, grant=grant)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:  # UsageError: the failed pull closed the peer
            log.info("releasing lease %s on %s failed (%s); it will expire", lease_id, peer.address,
                     exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else exc)

