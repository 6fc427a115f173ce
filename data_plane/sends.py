"""A node's sends: the source's half of a peer's pull.

A consumer hands this node its NIXL agent over (:meth:`Sends.exchange_metadata`, two calls: metadata, then the
answer to a nonce sent to that agent), its Lookup pins the blocks under a lease (:meth:`DataPlaneCore.lookup`), and
:meth:`Sends.send` WRITEs exactly those blocks to landing slots of that agent's registered memory, then ends the
lease. Only these blocks leave: the consumer holds no rkey of this node. Before the server gives up its port,
:meth:`Sends.drain` refuses new sends and waits for the WRITEs in flight (the proof consumers' held landing slots
rest on: data_plane.reclaim).

The send path shares the node's tier, leases and transport and its quarantine's "replacing the NIXL agent" state,
so it is given the node itself (:class:`~data_plane.core.DataPlaneCore`). Threading model: the node's event loop
only (NIXL's threads inside :class:`~data_plane.transfer.Transport`).
"""

from __future__ import annotations

import asyncio
import logging
from itertools import compress, count
from operator import attrgetter, is_not
from typing import TYPE_CHECKING

import numpy as np

from kvmesh.errors import FailedPrecondition, InvalidArgument, PermissionDenied, Unavailable
from kvmesh.namespace import Namespace

from data_plane.epochs import Epoch
from data_plane.metadata_vetting import ONLY_WITH_A_SPARE, HandshakeGate, StuckCheck
from data_plane.peer_agents import PeerAgents
from data_plane.tier import Block
from data_plane.transfer import TransferFailed, Transport

if TYPE_CHECKING:
    from data_plane.core import DataPlaneCore

log = logging.getLogger(__name__)
KEY, SLOT, BLOCK_HASH = attrgetter("key"), attrgetter("slot"), attrgetter("key.block_hash")  # native loops


def lease_scope(ns: Namespace, epoch: Epoch) -> str:
    """What a peer's lease pins: blocks of one namespace, served under one tenant epoch (a send naming the lease
    under another namespace or epoch writes nothing)."""
    return f"{ns.fingerprint}@{epoch}"


class Sends:
    def __init__(self, node: "DataPlaneCore") -> None:
        self._node = node
        self.config = node.config
        self.block_bytes = node.block_bytes
        self.tier, self.region = node.tier, node.region
        self.agents = PeerAgents(node.transport)  # the consumers' NIXL agents sends WRITE to (handshakes)
        self.handshakes = HandshakeGate()  # per consumer node: one metadata check at a time, cooldown after failures
        # lease id -> holder, of sends whose WRITE may still land: from the moment the send takes the lease
        # until the WRITE ends or NIXL releases it (never, for one NIXL could not release)
        self.writing: dict[str, str] = {}
        self.in_flight: set[asyncio.Task] = set()  # the WRITEs of sends in flight
        self._draining = False

    @property
    def transport(self) -> Transport:
        return self._node.transport

    async def exchange_metadata(self, node_id: str, metadata: bytes, block_bytes: int, timeout_s: float = 10.0,
                                challenge_answer: bytes = b"") -> tuple[str, bytes, bytes]:
        """One call of a consumer's handshake: this node's agent name, its metadata (serve_peer_reads only) and
        the SHA-256 of the challenge the caller's agent was sent (empty: none). Waits at most ``timeout_s`` for
        this node's own agent (Unavailable: still starting).

        The agent handed over is the one this node WRITEs ``node_id``'s blocks to, so it must be ``node_id``'s
        own, which takes two calls. The first hands over its metadata: an agent of ``node_id`` (named
        ``<node_id>-<incarnation>``; PermissionDenied otherwise) and exactly what an agent hands out
        (InvalidArgument otherwise), both checked before NIXL is given anything; the agent is loaded and sent a
        NIXL notification holding a random nonce. The second answers with that nonce (``challenge_answer``):
        only then does the agent become the endpoint sends to ``node_id`` use. Metadata that names the node's
        agent around another process's worker address cannot be answered: the nonce reaches that process.
        Until the answer, and after any refusal, the endpoint the node had stays in place.

        The metadata is checked first by a throwaway agent (:meth:`Transport.vet_peer`), which costs this node a
        new checking process whenever the metadata fails the check: one check at a time per ``node_id`` (the node
        the caller's grant names), and after a failure that node's handshakes are refused for a cooldown that
        doubles with each failure (ResourceExhausted; :class:`~data_plane.metadata_vetting.HandshakeGate`)."""
        if not node_id:
            raise InvalidArgument("node_id must be set")
        if block_bytes != self.block_bytes:
            raise FailedPrecondition(
                f"block_bytes mismatch: this node stores {self.block_bytes}-byte blocks, the caller {block_bytes}")
        if metadata and challenge_answer:
            raise InvalidArgument("a handshake call carries agent_metadata or agent_challenge_answer, not both")
        await self.transport.ready(timeout_s)
        digest = b""
        if metadata:
            agent = self.transport.describe_peer(metadata)
            if agent.node_id != node_id or agent.name == self.transport.agent_name:
                raise PermissionDenied(f"the agent metadata describes agent {agent.name!r}, not one of node "
                                       f"{node_id!r}: a node hands over its own agent's metadata only")
            await self._vet(node_id, metadata, timeout_s)
            digest = self.agents.challenge(node_id, metadata, agent)
        elif challenge_answer:
            self.agents.answer(node_id, challenge_answer)
        # Without serve_peer_reads the caller gets no rkey of this node: bytes leave only by send().
        return (self.transport.agent_name, self.transport.metadata() if self.config.serve_peer_reads else b"",
                digest)

    async def _vet(self, node_id: str, metadata: bytes, timeout_s: float) -> None:
        """:meth:`Transport.vet_peer` under :attr:`handshakes`. The check runs in a task of its own: a caller that
        goes away leaves it running (its thread cannot be stopped), and the node's check counts as in flight, and
        its outcome as the node's, until it ends. A node whose metadata failed before is checked only with a spare
        checking process up (ResourceExhausted otherwise)."""
        failed_before = self.handshakes.enter(node_id)

        async def check() -> None:
            ONLY_WITH_A_SPARE.set(failed_before)  # this task's own context, carried into the check's thread
            failed = False
            try:
                await self.transport.vet_peer(metadata, timeout_s)
            except (InvalidArgument, StuckCheck):
                failed = True
                raise
            finally:
                self.handshakes.leave(node_id, failed)

        try:
            task = asyncio.get_running_loop().create_task(check())
        except BaseException:
            self.handshakes.leave(node_id, False)
            raise
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its caller may be gone
        await asyncio.shield(task)

    async def send(self, ns: Namespace, lease_id: str, hashes: list[bytes], landing_addrs: list[int],
                   consumer_node_id: str, holder: str, *, timeout_s: float, grant_epoch: str = "") -> int:
        """The gated byte path: WRITEs the blocks pinned under ``lease_id`` (an earlier :meth:`lookup` by
        ``holder`` in ``ns`` under ``grant_epoch``: the namespace and tenant epoch of the caller's grant)
        to the consumer's landing addresses and ends the lease (nothing stays pinned): how many leading
        blocks of ``hashes`` were written. ``hashes`` must be the leading blocks of the lease, in order:
        they are not looked up again (a block purged since, e.g. by a new tenant epoch, ends the run).
        Only these blocks leave: the consumer holds no rkey of this node. A lease that is not ``holder``'s
        in ``ns`` under ``grant_epoch`` (or expired) writes nothing (0). Unavailable when the write failed
        and could not be cancelled (the landing slots may still change); a write that failed cleanly
        answers 0."""
        hashes = self._node.check(ns, hashes)
        n = len(hashes)
        if len(landing_addrs) != n:
            raise InvalidArgument(f"{len(landing_addrs)} landing addresses for {n} hashes")
        if not lease_id:
            raise InvalidArgument("landing_addrs needs the lease_id of this caller's Lookup of the blocks")
        lease = self._node.leases.take(lease_id, holder, lease_scope(ns, grant_epoch))
        if lease is None:
            log.info("send to %s: lease %s is not its own in %s, or expired; answering MISS",
                     consumer_node_id, lease_id, ns.fingerprint)
            return 0
        if self._draining or self._node.quarantine.renewing:
            for block in lease.items:
                self.tier.unpin(block)
            log.info("send to %s: this node is %s; answering MISS", consumer_node_id,
                     "stopping" if self._draining else "replacing its NIXL agent")
            return 0
        self.writing[lease_id] = holder
        # The WRITE runs in a task of its own: a caller that goes away (its deadline passed) cancels this
        # handler, not the WRITE, which ends within its own bound and only then leaves the ledger.
        task = asyncio.get_running_loop().create_task(
            self._send_lease(lease.lease_id, lease.items, hashes, landing_addrs, consumer_node_id, timeout_s))
        self.in_flight.add(task)
        task.add_done_callback(self.in_flight.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its caller may be gone
        return await asyncio.shield(task)

    async def _send_lease(self, lease_id: str, blocks: list[Block], hashes: list[bytes], landing_addrs: list[int],
                          consumer_node_id: str, timeout_s: float) -> int:
        n = len(hashes)
        sent = indexed = 0
        stuck = False  # the WRITE may land until this process exits: never reported settled
        try:
            if n > len(blocks) or list(map(BLOCK_HASH, blocks[:n])) != hashes:
                raise InvalidArgument(f"block_hashes are not the leading blocks of lease {lease_id}")
            agent = self.agents.get(consumer_node_id)
            if agent is None:
                raise FailedPrecondition(f"node {consumer_node_id!r} has not handshaken with this node: call "
                                         "ExchangeAgentMetadata first")
            if not agent.holds_slots(landing_addrs, self.block_bytes):
                raise InvalidArgument(f"landing_addrs must be whole {self.block_bytes}-byte slots of the memory "
                                      f"node {consumer_node_id!r}'s agent registered")
            # the leading blocks still indexed (one purged since, e.g. by a new tenant epoch, ends the run)
            moved = map(is_not, self.tier.get_all(map(KEY, blocks[:n])), blocks)
            indexed = next(compress(count(), moved), n)
            if indexed:
                slots = np.fromiter(map(SLOT, blocks[:indexed]), dtype=np.int64, count=indexed)
                # tagged with the lease: the consumer learns of each piece that landed and checks it meanwhile
                await self.transport.write(agent.name, slots * self.block_bytes, landing_addrs[:indexed],
                                           self.block_bytes, timeout_s, tag=lease_id.encode())
            sent = indexed
        except TransferFailed as exc:
            log.warning("sending %d blocks to %s failed: %s", indexed, consumer_node_id, exc)
            if exc.may_still_write:
                # Released or not: over UCX tcp, bytes already in this host's socket buffers still land when
                # the path drains (after a cut heals), so only the "gone" proof (a new process at this
                # address) may hand the consumer's landing slots back.
                stuck = True
                raise Unavailable(f"the WRITE to {consumer_node_id} failed and may still land (timed out, or could "
                                  "not be cancelled)") from None
        finally:
            self.tier.unpin_all(blocks)
            if not stuck:
                del self.writing[lease_id]
        return sent

    async def drain(self, timeout_s: float) -> None:
        """Refuses new sends and waits, at most ``timeout_s``, for the WRITEs in flight to end. Called before
        the server gives up its port: a replacement that binds the port afterwards proves to consumers that
        this process moves no more bytes (data_plane.reclaim). A WRITE NIXL could not release is not waited
        for (it has ended as far as this process can tell; it stops with the process)."""
        self._draining = True
        if self.in_flight:
            log.info("stopping: waiting up to %.1fs for %d sends in flight", timeout_s, len(self.in_flight))
            await asyncio.wait(set(self.in_flight), timeout=timeout_s)


    async def close(self) -> None:
        for task in self.in_flight:
            task.cancel()
        await asyncio.gather(*self.in_flight, return_exceptions=True)
