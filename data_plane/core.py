"""The data plane of one node, as plain Python: what every RPC does.

It owns the CPU tier (:mod:`.tier`), the optional disk tier (:mod:`.disk`),
the leases that pin blocks for readers (:mod:`.leases`) and the tenants'
epochs, answers local engines and peers' Lookups, and reports every tier
change to an :class:`~data_plane.events.EventSink`. Its parts by
responsibility: pulls from other nodes (:mod:`.pulls`, over :mod:`.peers` and
:mod:`.transfer`), sends to consumers' agents (:mod:`.sends`), landing-arena slots a failed
transfer may still write into (:mod:`.quarantine`). The gRPC servicer only
converts.

Failure policy (docs/data_plane.md has the full table):
  * malformed input (bad namespace, wrong hash size, too many hashes,
    block_size other than the node's) -> InvalidArgument, nothing changed;
  * misconfiguration between peers (block_bytes) -> FailedPrecondition;
  * a peer that is unreachable, times out, disconnects or sends a bad block
    -> MISS for what did not arrive (the engine recomputes), never a hang and
    never a visible half-written block.

Threading model: every method runs on the event loop of the server; the only
other threads are NIXL's (inside :class:`~data_plane.transfer.Transport`) and
the CRC checks' (:class:`~data_plane.checksum.RunChecker`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from operator import attrgetter, itemgetter
from typing import Awaitable, Callable, Collection, Iterable, Iterator

import numpy as np

from kvmesh.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from kvmesh.channels import ClientTLS
from kvmesh.namespace import Namespace

from data_plane.checksum import RunChecker, check_threads, checksum
from data_plane.client import TierDescription
from data_plane.config import DataPlaneConfig
from data_plane.disk import DiskTier
from data_plane.epochs import GONE, Epoch, TenantEpochs
from data_plane.events import EventSink, NoEvents
from data_plane.eviction import EvictionPolicy, block_info
from data_plane.leases import Clock, LeaseTable, SystemClock
from data_plane.metrics import DataPlaneMetrics
from data_plane.peers import PeerPool, PeerProof
from data_plane.pulls import Pulls
from data_plane.quarantine import Quarantine
from data_plane.sends import Sends, lease_scope
from data_plane.shm import SharedRegion
from data_plane.tier import Block, BlockState, MemoryTier
from data_plane.transfer import Transport
from data_plane.types import BlockKey, LookupAnswer, LookupStatus, Medium, PullResult, block_keys, validate_hashes

log = logging.getLogger(__name__)

LOCAL_HOLDER = "local"
KEY, SLOT, CHECKSUM = attrgetter("key"), attrgetter("slot"), attrgetter("checksum")  # per block, in native loops
_ENGINE = "engine"


# (namespace, source node id, timeout in s) -> a pull grant signed by the control plane, and the source's
# registered data-plane address
GrantSource = Callable[[Namespace, str, float], Awaitable[tuple[bytes, str]]]
# (tenant, timeout in s) -> CPU-tier bytes this node may hold for the tenant (None: no limit);
# PermissionDenied when the tenant's policy excludes this node
LimitSource = Callable[[str, float], Awaitable[int | None]]
# (route token, tenant, source node id, source address) -> None; PermissionDenied unless Route signed that
# source for that tenant
RouteCheck = Callable[[bytes, str, str, str], Awaitable[None]]
# (tenant, timeout in s) -> None: asks the control plane for the tenant's epoch now (the answer reaches
# DataPlaneCore.learn_epoch); never raises
EpochRefresh = Callable[[str, float], Awaitable[None]]


class DataPlaneCore:
    def __init__(
        self,
        config: DataPlaneConfig,
        region: SharedRegion,
        policy: EvictionPolicy,
        transport: Transport,
        disk: DiskTier | None = None,
        events: EventSink | None = None,
        clock: Clock | None = None,
        grants: GrantSource | None = None,
        peer_proof: PeerProof | None = None,
        metrics: DataPlaneMetrics | None = None,
        limits: LimitSource | None = None,
        routes: RouteCheck | None = None,
        peer_tls: Callable[[str], ClientTLS | None] | None = None,
        epochs: EpochRefresh | None = None,
    ) -> None:
        """``grants`` gets a pull grant (namespace, source node id) when a Pull brings none;
        ``limits`` a tenant's CPU-tier limit on this node (None: no limits); ``routes`` checks a pull's
        route token (None: sources need none); ``epochs`` refreshes a tenant's epoch (None: no control plane,
        every epoch is "");
        ``peer_proof`` proves this node's peer key to a source (its API key never goes to peers; calls go
        over the TLS ``peer_tls`` gives for the peer's node id, when given)."""
        self.config = config
        self.node_id = config.node_id
        self.address = ""  # set by the server once bound
        self.region = region
        self.block_bytes = region.block_bytes
        self.tier = MemoryTier(region, policy, self._demote)
        self._checker = RunChecker(region, self.block_bytes, check_threads(config.verify_threads))
        self.disk = disk
        self.transport = transport
        self.events: EventSink = events or NoEvents()
        self._clock = clock or SystemClock()
        self.leases: LeaseTable[Block] = LeaseTable(self._clock)
        self._grants = grants
        self._limits = limits
        self._routes = routes
        self._refresh_epoch = epochs
        self.epochs = TenantEpochs()
        self.metrics = metrics or DataPlaneMetrics()
        self._peers = PeerPool(self.node_id, transport, self.block_bytes, peer_proof, peer_tls)
        self._writers: dict[BlockKey, str] = {}  # uncommitted block -> who reserved it
        self._namespaces: dict[str, Namespace] = {}
        # the tenant's CPU-tier limit on this node as last learned (a Reserve's or a pull's); a promotion from
        # disk, which happens inside Acquire and Lookup, obeys it (absent: never learned, no limit applied)
        self._tenant_limits: dict[str, int | None] = {}
        self._sweeper: asyncio.Task | None = None
        self._epoch_sweeper: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self.quarantine = Quarantine(self)
        self.sends = Sends(self)
        self.pulls = Pulls(self)

    # ---- lifecycle ----

    def start_background(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_leases())
        if self._refresh_epoch is not None:
            self._epoch_sweeper = asyncio.get_running_loop().create_task(self._sweep_epochs())

    async def close(self) -> None:
        sweepers = [t for t in (self._sweeper, self._epoch_sweeper) if t is not None]
        for task in [*sweepers, *self._background]:
            task.cancel()
        await asyncio.gather(*self._background, *sweepers, return_exceptions=True)
        await self.sends.close()
        await self.quarantine.close()
        await self._peers.close()
        self.transport.close()
        if self.disk is not None:
            self.disk.close()
        self.region.close()

    async def _sweep_leases(self) -> None:
        while True:
            await asyncio.sleep(self.config.lease_sweep_ms / 1000)
            self.expire_leases()

    async def _sweep_epochs(self) -> None:
        """Once per refresh period, the epoch of every tenant with blocks here: a deleted or re-created
        tenant's blocks stop being served locally within one period plus one control-plane call."""
        period = self.config.control_plane_refresh_ms / 1000
        timeout = self.config.control_plane_timeout_ms / 1000
        while True:
            await asyncio.sleep(period)
            held = self.tier.tenants() | (self.disk.tenants() if self.disk is not None else set())
            for tenant, outcome in zip(held, await asyncio.gather(
                    *(self._refresh_epoch(tenant, timeout) for tenant in held), return_exceptions=True)):
                if isinstance(outcome, Exception):
                    log.error("refreshing the epoch of tenant %s failed: %r", tenant, outcome)

    def learn_epoch(self, tenant: str, epoch: Epoch) -> None:
        """The control plane's answer for ``tenant`` (GONE: deleted, or it no longer allows this node). When
        it changed, the tenant's blocks of other epochs are dropped from every tier (pinned ones when
        released) and reported removed."""
        if not self.epochs.learn(tenant, epoch):
            return
        dropped: dict[tuple[str, Medium], tuple[Namespace, list[bytes]]] = {}
        purged = [(b.namespace, b.key, Medium.CPU, b.epoch) for b in self.tier.purge(tenant, epoch)]
        if self.disk is not None:
            purged += [(b.namespace, b.key, Medium.DISK, b.epoch) for b in self.disk.purge(tenant, epoch)]
        for ns, key, medium, _ in purged:
            dropped.setdefault((key.namespace, medium), (ns, []))[1].append(key.block_hash)
        for (_, medium), (ns, hashes) in dropped.items():
            self.events.removed(ns, hashes, medium)
        unknown = sum(1 for *_, tag in purged if tag == "")
        if purged:
            self.metrics.purged(len(purged), unknown)
            state = "deleted or no longer allows this node" if epoch is GONE else f"at epoch {epoch or '(unknown)'}"
            if len(purged) > unknown:
                log.info("tenant %s is %s: dropped %d of its blocks stored under %s", tenant, state,
                         len(purged) - unknown, "its epoch" if epoch is GONE else "an earlier epoch")
        if unknown:
            # Stored while no control plane had answered for the tenant: they may be a deleted predecessor's
            # (same tenant id), so they are not served under the epoch learnt now (docs/data_plane.md, "Tenant
            # epochs"). A cache loss, bounded by what was committed for the tenant before its first answer.
            log.warning("tenant %s is %s: dropped %d of its blocks committed before this node knew the tenant's "
                        "epoch (the control plane had not answered for it); they may belong to a deleted "
                        "predecessor of the tenant, so they are not kept", tenant, state, unknown)

    def expire_leases(self) -> int:
        """Unpins what expired leases held; returns how many leases expired."""
        expired = self.leases.expire()
        for lease in expired:
            log.info("lease %s of %s expired; unpinning %d blocks", lease.lease_id, lease.holder, len(lease.items))
            for block in lease.items:
                self.tier.unpin(block)
        return len(expired)

    # ---- validation ----

    def check(self, ns: Namespace, hashes: list[bytes]) -> list[bytes]:
        ns.validate()
        want = self.config.block_tokens
        if want and ns.cache_config.block_size != want:
            raise InvalidArgument(
                f"namespace block_size is {ns.cache_config.block_size} tokens; this node stores "
                f"{want}-token blocks of {self.block_bytes} bytes")
        return validate_hashes(ns, list(hashes), self.config.max_hashes_per_request)

    def _known(self, ns: Namespace) -> bool:
        return ns.fingerprint in self._namespaces

    def _bounded(self, requested: int, default: int, maximum: int) -> float:
        return min(requested or default, maximum) / 1000

    # ---- local engine API ----

    def describe(self) -> TierDescription:
        return TierDescription(self.node_id, str(self.region.path), self.block_bytes, self.region.num_slots,
                               self.region.locked, self.config.block_tokens)

    def usage(self) -> dict[str, tuple[int, int]]:
        """``{tier: (used bytes, capacity bytes)}`` of the CPU tier and, when there is one, the disk tier; a slot
        is used while anything holds it (reserved, written or stored). Lengths only: safe to read
        from the metrics endpoint's thread."""
        cpu_slots = self.region.num_slots
        out = {"cpu": ((cpu_slots - self.tier.free_slots) * self.block_bytes, cpu_slots * self.block_bytes)}
        if self.disk is not None:
            out["disk"] = (len(self.disk) * self.block_bytes, self.disk.num_slots * self.block_bytes)
        return out

    def reserve(self, ns: Namespace, hashes: list[bytes], *, max_offload_tokens: int = 0,
                first_block_index: int = 0, protected_blocks: int = 0,
                tenant_limit_bytes: int | None = None) -> list[int]:
        """A slot per hash to write, or -1: already stored, beyond the offload cap, or no evictable slot.

        ResourceExhausted, with nothing reserved, when the new blocks would take the tenant past
        ``tenant_limit_bytes`` on this node (its policy's max_cpu_tier_bytes_per_node)."""
        hashes = self.check(ns, hashes)
        block_size, fp = ns.cache_config.block_size, ns.fingerprint
        self._tenant_limits[ns.tenant] = tenant_limit_bytes
        if tenant_limit_bytes is not None:
            new = sum(1 for i, h in enumerate(hashes) if self.tier.get(BlockKey(fp, h)) is None and not (
                max_offload_tokens and (first_block_index + i + 1) * block_size > max_offload_tokens))
            held = self.tier.tenant_slots(ns.tenant)
            if (held + new) * self.block_bytes > tenant_limit_bytes:
                raise ResourceExhausted(
                    f"tenant {ns.tenant!r} may hold {tenant_limit_bytes} bytes of CPU tier on this node: {held} "
                    f"blocks of {self.block_bytes} bytes are held and {new} more were asked for; nothing was reserved")
        epoch = self.epochs.current(ns.tenant)
        if epoch is GONE:
            raise PermissionDenied(f"tenant {ns.tenant!r} was deleted; nothing was reserved")
        self._namespaces.setdefault(ns.fingerprint, ns)
        slots = []
        for i, h in enumerate(hashes):
            position = first_block_index + i
            if max_offload_tokens and (position + 1) * block_size > max_offload_tokens:
                slots.append(-1)
                continue
            key = BlockKey(fp, h)
            block = self.tier.reserve(ns, key, block_info(position, position < protected_blocks), epoch)
            if block is not None:
                self._writers[key] = _ENGINE
            slots.append(-1 if block is None else block.slot)
        return slots

    def commit(self, ns: Namespace, hashes: list[bytes]) -> int:
        """Checksums and publishes blocks the engine wrote; all or nothing. Committed ones are skipped, and
        those reserved under a tenant epoch that has ended since are dropped instead (not counted)."""
        hashes = self.check(ns, hashes)
        if not self._known(ns):
            raise NotFound(f"unknown namespace {ns.fingerprint} ({ns.model}): nothing was reserved in it")
        todo, fp = [], ns.fingerprint
        for h in hashes:
            block = self.tier.get(BlockKey(fp, h))
            if block is None or (not block.committed and self._writers.get(block.key) != _ENGINE):
                raise FailedPrecondition(f"block {h.hex()} was not reserved by the engine; reserve it first")
            if not block.committed:
                todo.append(block)
        epoch = self.epochs.current(ns.tenant)
        stale = [b for b in todo if not self.epochs.serves(b.epoch, epoch)]
        todo = [b for b in todo if self.epochs.serves(b.epoch, epoch)]
        for block in stale:
            del self._writers[block.key]
            self.tier.abort(block)
        for block in todo:
            self.tier.mark_written(block, checksum(self.region.slot(block.slot)))
            self.tier.commit(block)
            del self._writers[block.key]
        if todo:
            self.events.stored(ns, [b.key.block_hash for b in todo], Medium.CPU)
            self.metrics.bytes("written", len(todo) * self.block_bytes)
        return len(todo)

    def abort(self, ns: Namespace, hashes: list[bytes]) -> None:
        """Frees the engine's uncommitted reservations among ``hashes`` (others are left alone)."""
        hashes = self.check(ns, hashes)
        fp = ns.fingerprint
        for h in hashes:
            key = BlockKey(fp, h)
            block = self.tier.get(key)
            if block is not None and not block.committed and self._writers.get(key) == _ENGINE:
                del self._writers[key]
                self.tier.abort(block)

    async def acquire(self, ns: Namespace, hashes: list[bytes], media: frozenset[Medium], lease_ms: int = 0,
                      holder: str = LOCAL_HOLDER, checked: Collection[Block] = ()) -> tuple[list[int], str]:
        """Pins the leading committed blocks of the tenant's current epoch (promoting from disk when allowed)
        whose bytes are still the ones stored under their key; their slots and the lease.

        The tier is memory peers can WRITE into (an honest source misled, a malicious one, anyone who can
        reach this node's UCX worker), so each block's CRC-32C is checked against the one recorded when it
        was stored before the engine gets its slot: a block that changed is dropped from the tier and ends
        the run (MISS from there). ``checked``: records a pull has just checked and committed (a Pull with a
        lease ends with this call, the moment its check has passed, as this call's own check would): those
        are not checked a second time, as long as the tier still holds that very record, not one stored since."""
        hashes = self.check(ns, hashes)
        pinned: list[Block] = []
        epoch = self.epochs.current(ns.tenant)
        try:  # a call cancelled in its check (its deadline, its client) or a failed promotion keeps no pin
            if self._known(ns) and epoch is not GONE:
                fp = ns.fingerprint
                for h in hashes:
                    block = self._resident(ns, BlockKey(fp, h), media, "local", epoch)
                    if block is None:
                        break
                    self.tier.pin(block)
                    pinned.append(block)
            fresh = set(map(id, checked))
            unchecked = [i for i, b in enumerate(pinned) if id(b) not in fresh] if fresh else range(len(pinned))
            bad = await self._checker.first_mismatch([pinned[i].slot for i in unchecked],
                                                     [pinned[i].checksum for i in unchecked])
        except BaseException:
            self.tier.unpin_all(pinned)
            raise
        intact = unchecked[bad] if bad < len(unchecked) else len(pinned)
        for block in pinned[intact:]:
            self.tier.unpin(block)
        if intact < len(pinned):
            self._discard_changed(pinned[intact])
        pinned = pinned[:intact]
        self.metrics.found("local", "miss", len(hashes) - len(pinned))
        return [b.slot for b in pinned], self._lease(holder, pinned, lease_ms)

    def _discard_changed(self, block: Block) -> None:
        """Drops a committed block whose bytes no longer match its checksum (written from outside)."""
        log.error("block %s of tenant %s changed in memory after it was stored (a write from outside this "
                  "node); dropped, MISS from there", block.key.block_hash.hex(), block.namespace.tenant)
        self.metrics.found("local", "corrupt")
        if self.tier.discard(block):
            self.events.removed(block.namespace, [block.key.block_hash], Medium.CPU)

    def release(self, lease_id: str, holder: str | None = None) -> None:
        """Ends a lease; with ``holder``, only a lease that holder took (a peer releases its own leases only)."""
        for block in self.leases.release(lease_id, holder):
            self.tier.unpin(block)

    def settle(self, lease_id: str, holder: str | None = None) -> bool:
        """:meth:`release`, then whether no send under ``lease_id`` (``holder``'s, when given) may still WRITE:
        the consumer's proof that the landing slots it held can be reused. Once released, a send
        naming the lease writes nothing, and the answer and the release happen in one step of the loop, as a
        send's taking the lease and recording its WRITE do: whichever comes first, no WRITE lands after a
        True. Another holder's lease is neither released nor reported (True: no write of *its* is out)."""
        self.release(lease_id, holder)
        writer = self.sends.writing.get(lease_id)
        return writer is None or (holder is not None and writer != holder)

    def _lease(self, holder: str, blocks: list[Block], lease_ms: int, scope: str = "", group: str = "") -> str:
        if not blocks:
            return ""
        ttl = self._bounded(lease_ms, self.config.lease_ms, self.config.max_lease_ms)
        return self.leases.grant(holder, blocks, ttl, scope, group)

    def _resident(self, ns: Namespace, key: BlockKey, media: frozenset[Medium], caller: str,
                  epoch: Epoch) -> Block | None:
        """The committed CPU block stored under ``epoch``, promoted from disk if needed and allowed; None
        otherwise."""
        block = self.tier.get(key)
        on_disk = self.disk.get(key) if block is None and Medium.DISK in media and self.disk is not None else None
        if block is not None and block.committed and self.epochs.serves(block.epoch, epoch):
            self.metrics.found(caller, "cpu")
        elif on_disk is not None and self.epochs.serves(on_disk.epoch, epoch):
            block = self._promote(ns, key)
            if block is not None:
                self.metrics.found(caller, "disk")
        else:
            block = None
        if block is not None:
            self.metrics.read(key)
        return block

    def _promote(self, ns: Namespace, key: BlockKey) -> Block | None:
        """The disk block copied into a CPU slot; None when that fails or would take the tenant past its
        limit on this node (the block stays on disk)."""
        start = time.perf_counter()
        limit = self._tenant_limits.get(ns.tenant)
        if limit is not None and (self.tier.tenant_slots(ns.tenant) + 1) * self.block_bytes > limit:
            log.info("block %s of tenant %s stays on disk: promoting it would take the tenant past its %d bytes of "
                     "CPU tier on this node", key.block_hash.hex(), ns.tenant, limit)
            return None
        disk_block = self.disk.get(key)
        with self.disk.held(key):  # the reservation may evict a CPU block to a full disk: not onto this one
            block = self.tier.reserve(ns, key, disk_block.info, disk_block.epoch)
        if block is None:
            return None
        try:
            read = self.disk.read_into(key, self.region.slot(block.slot))
        except OSError as exc:
            log.error("reading block %s from the disk tier failed: %s", key.block_hash.hex(), exc)
            read = None
        if read is None:
            self.tier.abort(block)
            self.events.removed(ns, [key.block_hash], Medium.DISK)
            return None
        self.tier.mark_written(block, disk_block.checksum)
        self.tier.commit(block)
        self.events.stored(ns, [key.block_hash], Medium.CPU)
        self.metrics.promotion(time.perf_counter() - start)
        return block

    def _demote(self, blocks: list[Block]) -> None:
        """Eviction hook: the blocks leave the CPU tier; keep a copy on disk when there is one."""
        keys = list(map(KEY, blocks))
        if len(set(map(itemgetter(0), keys))) == 1:  # the usual eviction: one namespace's blocks
            self.events.removed(blocks[0].namespace, list(map(itemgetter(1), keys)), Medium.CPU)
        else:
            gone: dict[str, tuple[Namespace, list[bytes]]] = {}
            for block in blocks:
                gone.setdefault(block.key.namespace, (block.namespace, []))[1].append(block.key.block_hash)
            for ns, hashes in gone.values():
                self.events.removed(ns, hashes, Medium.CPU)
        self.metrics.evicted_from_cpu(keys)
        if self.disk is not None:
            for block in blocks:
                self._to_disk(block)

    def _to_disk(self, block: Block) -> None:
        ns, h = block.namespace, block.key.block_hash
        if self.disk.get(block.key) is not None:
            return
        try:
            evicted = self.disk.write(ns, block.key, self.region.slot(block.slot), block.checksum, block.info,
                                      block.epoch)
        except OSError as exc:
            log.error("writing block %s to the disk tier failed: %s", h.hex(), exc)
            return
        if evicted is None:  # no room for its tenant: every other tenant within its share
            return
        for gone in evicted:
            self.events.removed(gone.namespace, [gone.key.block_hash], Medium.DISK)
            self.metrics.evicted("disk", gone.key)
        self.events.stored(ns, [h], Medium.DISK)

    # ---- peer API ----

    async def lookup(self, ns: Namespace, hashes: list[bytes], *, consumer: str = "", pending_wait_ms: int = 0,
                     lease_ms: int = 0, media: frozenset[Medium] = frozenset(Medium),
                     holder: str = "", grant_epoch: str | None = None, peer_node: str = "") -> LookupAnswer:
        """Per hash HIT (pinned under the returned lease) or MISS; pending writes are awaited, bounded.
        Only blocks stored under ``grant_epoch`` (a peer's grant's) or, for a local caller (None), under the
        tenant's current epoch are HITs. ``peer_node``: a peer's node (its grant's consumer), whose pins of the
        tenant's blocks are bounded, whatever peer keys it proves with."""
        hashes = self.check(ns, hashes)
        n = len(hashes)
        blocks: list[Block | None] = [None] * n
        pending: list[int] = []
        epoch = self.epochs.current(ns.tenant) if grant_epoch is None else grant_epoch
        in_cpu: list[Block] = []  # HITs already in the CPU tier: pinned and counted at once, below
        held = 0  # of in_cpu, pinned already
        others: list[Block] = []  # pinned too: promoted from disk, arrived while waiting
        try:  # a call cancelled while it waits (its deadline, its client) or a failed promotion keeps no pin
            if self._known(ns) and epoch is not GONE:
                fp, arriving, committed = ns.fingerprint, self.pulls.arriving, BlockState.COMMITTED
                keys = block_keys(fp, hashes)
                promoted = False  # a promotion may have evicted what the snapshot below still shows
                for i, (key, current) in enumerate(zip(keys, self.tier.get_all(keys))):
                    if promoted:
                        current = self.tier.get(key)
                    if current is not None and current.state is committed and current.epoch == epoch \
                            and key not in arriving:  # the usual case, in as few steps as it takes
                        in_cpu.append(current)
                        blocks[i] = current
                    elif (current is not None and not current.committed) or key in arriving:
                        pending.append(i)
                    else:  # not in the CPU tier under this epoch: on disk, perhaps
                        self.tier.pin_all(in_cpu[held:])  # before a promotion evicts to make room
                        held = len(in_cpu)
                        block = self._resident(ns, key, media, "peer", epoch)
                        promoted = True
                        if block is not None:
                            self.tier.pin(block)
                            others.append(block)
                            blocks[i] = block
                self.tier.pin_all(in_cpu[held:])
                held = len(in_cpu)
                self.metrics.found("peer", "cpu", len(in_cpu))
                self.metrics.read_all(map(KEY, in_cpu))
            if pending:
                wait = self._bounded(pending_wait_ms, self.config.pending_wait_ms, self.config.max_pending_wait_ms)
                started = time.monotonic()
                deadline = started + wait
                for i in pending:
                    key = BlockKey(fp, hashes[i])
                    current = await self.pulls.arrival(key, deadline)
                    if current is not None and self.epochs.serves(current.epoch, epoch):
                        self.tier.pin(current)
                        others.append(current)
                        self.metrics.found("peer", "cpu")
                        self.metrics.read(key)
                        blocks[i] = current
                self.metrics.pending_wait(time.monotonic() - started)
        except BaseException:
            self.tier.unpin_all(in_cpu[:held] + others)
            raise
        holder = holder or consumer or "peer"
        pinned = blocks if len(in_cpu) == n else [b for b in blocks if b is not None]
        pins_of = f"{peer_node or holder}\x1f{ns.tenant}" if grant_epoch is not None else ""
        if pins_of and pinned:  # a peer: its node's pins of the tenant's blocks, at most its share
            room = max(0, self.tier.peer_pin_share() - self.leases.held(pins_of))
            if len(pinned) > room:
                self.tier.unpin_all(pinned[room:])
                cut = {id(b) for b in pinned[room:]}
                blocks = [None if b is not None and id(b) in cut else b for b in blocks]
                pinned = pinned[:room]
        self.metrics.found("peer", "miss", n - len(pinned))
        self.metrics.bytes("served", len(pinned) * self.block_bytes)
        lease_id = self._lease(holder, pinned, lease_ms, lease_scope(ns, epoch), group=pins_of)
        # where each block lies in this process: only a source that hands out its NIXL metadata (serve_peer_reads)
        # is READ at addresses; otherwise no message names its tier's address (docs/security.md)
        base, bb, reads = self.region.base_addr, self.block_bytes, self.config.serve_peer_reads
        if len(pinned) == n:  # every block a HIT: the answer's columns in native loops
            addrs = (np.array(list(map(SLOT, blocks)), dtype=np.int64) * bb + base).tolist() if reads else [0] * n
            return LookupAnswer([LookupStatus.HIT] * n, addrs, list(map(CHECKSUM, blocks)), lease_id)
        return LookupAnswer(
            statuses=[LookupStatus.HIT if b else LookupStatus.MISS for b in blocks],
            addrs=[base + b.slot * bb if b and reads else 0 if b else -1 for b in blocks],
            checksums=[b.checksum if b else 0 for b in blocks],
            lease_id=lease_id,
        )

    # ---- pulls (data_plane.pulls) ----

    async def pull(self, ns: Namespace, hashes: list[bytes], source_node_id: str, source_address: str, *,
                   timeout_ms: int = 0, source_media: frozenset[Medium] = frozenset(Medium),
                   first_block_index: int = 0, grant: bytes = b"", route_token: bytes = b"") -> PullResult:
        """Copies the blocks the source holds into this node's CPU tier; MISS for the rest.

        One deadline (``timeout_ms``, capped) covers everything: the tenant's limit, the grant,
        the handshake, the source's Lookup, the READ and waiting for blocks another pull on this
        node is already bringing (those are joined, not fetched twice). Runs to completion (within
        that bound) even if the caller goes away, so no transfer is left writing into slots that
        were handed back.
        """
        hashes = self.check(ns, hashes)
        if not source_address or not source_node_id:
            raise InvalidArgument("source_node_id and source_address must be set")
        if source_node_id == self.node_id or source_address == self.address:
            raise InvalidArgument("a node cannot pull from itself")
        timeout = self._bounded(timeout_ms, self.config.pull_timeout_ms, self.config.max_pull_timeout_ms)
        task = asyncio.ensure_future(
            self.pulls.run(ns, hashes, source_node_id, source_address, time.monotonic() + timeout,
                           source_media, first_block_index, grant, route_token))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        self.pulls.in_flight.add(task)
        task.add_done_callback(self.pulls.in_flight.discard)
        return await asyncio.shield(task)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- resync ----

    def snapshot(self) -> Iterator[tuple[Namespace, int, list[bytes]]]:
        """Everything committed, per namespace and tier: what a control-plane resync needs."""
        groups: dict[tuple[str, Medium], list[bytes]] = defaultdict(list)
        namespaces: dict[str, Namespace] = {}
        sources: Iterable = [(b.namespace, Medium.CPU, b.key) for b in self.tier.committed()]
        if self.disk is not None:
            sources = [*sources, *((b.namespace, Medium.DISK, b.key) for b in self.disk.blocks())]
        for ns, medium, key in sources:
            namespaces[key.namespace] = ns
            groups[(key.namespace, medium)].append(key.block_hash)
        for (fp, medium), hashes in groups.items():
            yield namespaces[fp], int(medium), hashes
