"""A node's quarantine: landing slots a failed transfer may still write into, and replacing the NIXL agent.

A pull whose transfer failed in a way that may still land (timed out, could not be cancelled) hands its landing
slots here (:meth:`Quarantine.add`) instead of back to the source's arena. They are slots of that source's landing
arena (:mod:`data_plane.landing`), never of the CPU tier: the pull's tier slots are freed at once, since no
transfer can reach the tier. The :class:`~data_plane.reclaim.Reclaimer` gives them back to the arena once the
source proves no WRITE of that lease can land (its Release answers settled, or a new process answers at its
address); a source that never proves it keeps fewer slots of its own arena, and nothing else.

:meth:`Quarantine.renew_transport` replaces the node's NIXL agent once no pull or send is in flight (when the node
keeps as many landing arenas as it may: every arena, and every record here, goes with the old agent).

Given the node itself (:class:`~data_plane.core.DataPlaneCore`): renewing the agent waits for its pulls and sends.
Threading model: the node's event loop only.
"""

from __future__ import annotations

import logging
import time
import asyncio
from typing import TYPE_CHECKING

import grpc
import numpy as np

from kvmesh.errors import PermissionDenied, Unavailable
from kvmesh.namespace import Namespace

from data_plane.landing import LandingArena
from data_plane.peers import Peer
from data_plane.reclaim import Quarantine as Record, Reclaimer, Verdict

if TYPE_CHECKING:
    from data_plane.core import DataPlaneCore

log = logging.getLogger(__name__)


class Quarantine:
    def __init__(self, node: "DataPlaneCore") -> None:
        self._node = node
        self.config = node.config
        self.metrics = node.metrics
        self._peers, self._grants = node._peers, node._grants
        self.renewing = False  # the NIXL agent is being replaced: no pull or send starts
        config = node.config
        self.reclaimer = Reclaimer(self._ask_settled, self._reclaim, config.reclaim_retry_ms / 1000,
                                   config.reclaim_max_retry_ms / 1000, config.reclaim_timeout_ms / 1000)

    @property
    def held(self) -> int:
        """Landing-arena slots held now after failed transfers (of every source)."""
        return self.reclaimer.held

    def refusal(self) -> str:
        """Why this node pulls from no source now ("": it may)."""
        return "this node is replacing its NIXL agent (every landing arena goes with it); retry" if self.renewing \
            else ""

    async def renew_transport(self) -> bool:
        """The reclaimer's path that does not depend on any source: once no pull or send of this node is in
        flight (new ones are refused meanwhile, at most one pull bound), the NIXL agent is replaced, so no
        WRITE into this node's memory still in flight can land; peers handshake again. False (tried again
        later) when that cannot be done now: a pull or send outlived the bound, or a send's WRITE failed in a
        way that may still land (only this process's exit ends it)."""
        if self.renewing:
            return False
        self.renewing = True
        try:
            pulls, sends = self._node.pulls, self._node.sends
            busy = pulls.in_flight | sends.in_flight
            if busy:
                await asyncio.wait(busy, timeout=self.config.max_pull_timeout_ms / 1000)
            if pulls.in_flight or sends.in_flight or sends.writing or not await self._node.transport.rotate():
                return False
            sends.agents.forget_all()  # their agents (and the challenged ones) were loaded into the old one
            await self._peers.close()  # this node's metadata changed: every source gets the new one
            if dropped := self.reclaimer.drop_all():  # their arenas went with the old agent
                self.metrics.reclaimed(dropped, 0)
            return True
        finally:
            self.renewing = False

    def add(self, arena: LandingArena, slots: np.ndarray, peer: Peer, ns: Namespace, lease_id: str,
            grant: bytes) -> None:
        """Holds the landing slots (of the source's ``arena``) of a transfer that may still write; the reclaimer
        gives them back to the arena once that is proven over (data_plane.reclaim). Nothing is held in an arena
        already retired (:meth:`renew_arena`): it is never used again."""
        if self._node.transport.landing_arena(peer.node_id) is not arena:
            return
        log.warning("%d landing slots of %s's arena held: its transfer failed and may still write into them",
                    len(slots), peer.node_id)
        self.reclaimer.add(Record(arena, slots, ns, peer.node_id, peer.address, peer.incarnation, lease_id, grant))
        self.metrics.quarantined(len(slots), self.reclaimer.held)

    def renew_arena(self, node_id: str) -> bool:
        """When the failed transfers of source ``node_id`` hold half its landing arena or more, retires that arena
        (the source gets a fresh one at its next handshake) and forgets what was held in it; False when they hold
        less, or the arena was renewed as often as ``landing_renewals_per_source`` allows."""
        arena = self._node.transport.landing_arena(node_id)
        if arena is None or 2 * self.reclaimer.held_in(arena) < arena.slots or \
                not self._node.transport.renew_landing_arena(node_id):
            return False
        self.metrics.reclaimed(self.reclaimer.drop_arena(arena), self.reclaimer.held)
        return True

    def _reclaim(self, record: Record) -> None:
        record.arena.give_back(record.slots)
        self.metrics.reclaimed(len(record.slots), self.reclaimer.held)

    async def _ask_settled(self, record: Record, timeout_s: float) -> Verdict:
        """Asks the source's address whether a write into ``record``'s slots can still land (its Release
        of the lease, under the pull's grant, renewed once from the control plane when refused)."""
        client = self._peers.client(record.source_address, record.source_node_id)
        deadline = time.monotonic() + timeout_s
        try:
            for renewed in (False, True):
                try:
                    settled, agent = await client.release(record.lease_id, timeout=deadline - time.monotonic(),
                                                          grant=record.grant)
                    break
                except grpc.aio.AioRpcError as exc:
                    refused = exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
                    if not refused or renewed or self._grants is None:
                        log.info("quarantined slots: %s did not answer (%s)", record.source_address,
                                 exc.code().name)
                        return Verdict.PENDING
                    record.grant, _ = await self._grants(record.ns, record.source_node_id,
                                                         deadline - time.monotonic())
            if agent and agent != record.source_agent:
                return Verdict.GONE
            return Verdict.SETTLED if settled and record.lease_id else Verdict.PENDING
        except (Unavailable, PermissionDenied) as exc:  # no new grant
            log.info("quarantined slots: no grant to ask %s (%s)", record.source_address, exc)
            return Verdict.PENDING
        finally:
            await client.close()

    async def close(self) -> None:
        await self.reclaimer.close()
