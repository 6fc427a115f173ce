"""A node's quarantine: landing slots a failed transfer may still write into.

A pull whose transfer failed in a way that may still land (timed out, could not be cancelled) hands its landing
slots here (:meth:`Quarantine.add`) instead of back to the tier; the :class:`~data_plane.reclaim.Reclaimer` frees
them once the source proves no WRITE of that lease can land (its Release answers settled, or a new process answers
at its address), or, past ``reclaim_force_after_ms``, by replacing this node's NIXL agent once no pull or send is in
flight (:meth:`Quarantine.renew_transport`). A source whose failed transfers hold its whole budget here, or that
never proved one over, is not pulled from (:meth:`Quarantine.refusal`).

Given the node itself (:class:`~data_plane.core.DataPlaneCore`): renewing the agent waits for its pulls and sends.
Threading model: the node's event loop only.
"""

from __future__ import annotations

import logging
import time
import asyncio
from typing import TYPE_CHECKING

import grpc

from kvmesh.errors import PermissionDenied, Unavailable
from kvmesh.namespace import Namespace

from data_plane.peers import Peer
from data_plane.reclaim import Quarantine as Record, Reclaimer, Verdict
from data_plane.tier import Block

if TYPE_CHECKING:
    from data_plane.core import DataPlaneCore

log = logging.getLogger(__name__)


class Quarantine:
    def __init__(self, node: "DataPlaneCore") -> None:
        self._node = node
        self.config = node.config
        self.tier, self.metrics = node.tier, node.metrics
        self._peers, self._grants = node._peers, node._grants
        self.renewing = False  # the NIXL agent is being replaced: no pull or send starts
        config = node.config
        self.reclaimer = Reclaimer(self._ask_settled, self._reclaim, config.reclaim_retry_ms / 1000,
                                   config.reclaim_max_retry_ms / 1000, config.reclaim_timeout_ms / 1000,
                                   force=self.renew_transport, force_after_s=config.reclaim_force_after_ms / 1000)

    def refusal(self, source_node_id: str) -> str:
        """Why this node does not pull from that source now ("": it may): its failed transfers hold its whole
        quarantine budget here, or it never proved over a transfer whose slots were reclaimed by force."""
        if self.renewing:
            return "this node is replacing its NIXL agent (quarantined slots reclaimed by force, or landing arenas "\
                "renewed); retry"
        if self.reclaimer.owes(source_node_id):
            return (f"node {source_node_id} never proved a failed transfer into this node over (its slots were "
                    "reclaimed by force); it is not pulled from until it does")
        held, budget = self.reclaimer.quarantined_from(source_node_id), self.config.quarantine_budget
        if held >= budget:
            return (f"node {source_node_id}'s failed transfers hold {held} quarantined slots here (its budget: "
                    f"{budget}); it is not pulled from until it proves them over")
        return ""

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
            return True
        finally:
            self.renewing = False

    def add(self, blocks: list[Block], peer: Peer, ns: Namespace, lease_id: str, grant: bytes) -> None:
        """Quarantines the landing slots of a transfer that may still write; the reclaimer frees them once
        that is proven over (data_plane.reclaim)."""
        slots = [self.tier.quarantine(block) for block in blocks]
        self.metrics.quarantined(len(slots), self.tier.quarantined)
        self.reclaimer.add(Record(slots, ns, peer.node_id, peer.address, peer.incarnation, lease_id, grant))

    def _reclaim(self, slots: list[int]) -> None:
        self.tier.reclaim(slots)
        self.metrics.reclaimed(len(slots), self.tier.quarantined)

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
