"""Connections to source nodes: a gRPC client and a loaded NIXL agent per address.

The first pull from an address exchanges NIXL agent metadata over gRPC (and
checks both sides use the same block size; a source that WRITEs challenges the
agent handed over, and the answer is a second call); the result is cached until a
transfer or lookup against that peer fails, after which the next pull
handshakes again (the peer may have restarted with a new agent).

Threading model: event-loop thread only; concurrent first pulls to one
address share one handshake.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

import grpc

from kvmesh.channels import ClientTLS
from kvmesh.errors import FailedPrecondition, InvalidArgument, PermissionDenied, Unavailable

from tenancy.peer_proof import PeerCall

from data_plane.client import DataPlaneClient
from data_plane.nixl_metadata import node_of_agent
from data_plane.transfer import Transport

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Peer:
    address: str
    node_id: str
    agent_name: str  # "" when the source WRITEs instead of handing out its metadata
    client: DataPlaneClient
    incarnation: str = ""  # the agent name the source answered with (changes on every start)


# (grant, call, target node id) -> this node's proof of possession of the grant's key (tenancy.peer_proof)
PeerProof = Callable[[bytes, PeerCall, str], str]


class PeerPool:
    def __init__(self, node_id: str, transport: Transport, block_bytes: int, proof: PeerProof | None = None,
                 tls: Callable[[str], ClientTLS | None] | None = None) -> None:
        """``proof``: how this node proves its peer key; peers are never sent this node's API key. ``tls``: the
        TLS of calls to a node id (its certificate must name that node: whoever answers at a stale address
        with another node's certificate is refused at the handshake)."""
        self._node_id = node_id
        self._proof = proof
        self._tls = tls
        self._transport = transport
        self._block_bytes = block_bytes
        self._peers: dict[str, Peer] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def cached(self, address: str) -> Peer | None:
        """The peer at ``address`` if its handshake is done (no waiting, no task)."""
        return self._peers.get(address)

    async def get(self, address: str, node_id: str, timeout_s: float, grant: bytes) -> Peer:
        """The peer at ``address`` (node ``node_id``, which peer proofs name); Unavailable when it cannot be reached, FailedPrecondition when incompatible,
        PermissionDenied when it refuses this node's grant."""
        async with self._locks.setdefault(address, asyncio.Lock()):
            peer = self._peers.get(address)
            if peer is not None:
                return peer
            client = self.client(address, node_id)
            deadline = time.monotonic() + timeout_s
            try:
                hs = await self._handshake(client, address, node_id, deadline, grant)
            except BaseException:
                await client.close()
                raise
            if hs.block_bytes != self._block_bytes:
                await client.close()
                raise FailedPrecondition(
                    f"peer {address} uses {hs.block_bytes}-byte blocks, this node {self._block_bytes}")
            # No metadata: the source hands out no rkey and WRITEs what a grant covers (agent_name "").
            # A source that hands out metadata (serve_peer_reads) may hand out only its own agent's, checked
            # before NIXL loads it: another node's would replace that node's endpoint here. A node other than
            # node_id at this address (a stale route) is not loaded at all; the pull answers MISS.
            agent = ""
            if hs.agent_metadata and hs.node_id == node_id:
                try:
                    described = self._transport.describe_peer(hs.agent_metadata)
                    if described.node_id != node_id:
                        raise InvalidArgument(f"it describes agent {described.name!r}, not one of node {node_id!r}")
                    await self._transport.vet_peer(hs.agent_metadata, max(0.0, deadline - time.monotonic()))
                    agent = self._transport.add_peer(hs.agent_metadata)
                except (InvalidArgument, Unavailable) as exc:
                    await client.close()
                    raise Unavailable(f"peer {address} handed out agent metadata this node does not load: {exc}") \
                        from None
            peer = Peer(address, hs.node_id, agent, client, hs.agent_name)
            self._peers[address] = peer
            return peer

    async def _handshake(self, client: DataPlaneClient, address: str, node_id: str, deadline: float,
                         grant: bytes):
        """Hands this node's agent metadata over and, when the source challenges the agent (a NIXL notification
        it sent to the agent just loaded), answers with what the agent received from that source's agent: only
        an agent of ``node_id``, the node dialled (a source naming another node's agent would have this node
        relay a challenge that node sent it for someone else's handshake)."""
        try:
            hs = await client.exchange_agent_metadata(self._node_id, self._transport.landing_metadata(node_id),
                                                      self._block_bytes,
                                                      timeout=max(0.0, deadline - time.monotonic()), grant=grant)
            if hs.challenge_sent and node_of_agent(hs.agent_name) != node_id:
                raise PermissionDenied(f"peer {address} (node {node_id}) names agent {hs.agent_name!r} as its own: "
                                       "its challenge is not answered")
            if hs.challenge_sent:
                nonce = await self._transport.notification(hs.agent_name, max(0.0, deadline - time.monotonic()),
                                                           hs.challenge_digest)
                if nonce is None:
                    raise Unavailable(f"peer {address} loaded this node's agent but no challenge reached it in time")
                await client.exchange_agent_metadata(self._node_id, b"", self._block_bytes,
                                                     timeout=max(0.0, deadline - time.monotonic()), grant=grant,
                                                     challenge_answer=nonce)
            return hs
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                raise PermissionDenied(f"peer {address} refused this node: {exc.details()}") from None
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise FailedPrecondition(f"peer {address} refused the handshake: {exc.details()}") from None
            if "Hostname Verification" in (exc.details() or ""):
                raise Unavailable(f"peer {address}'s TLS certificate does not name node {node_id} (peer_tls_name: "
                                  "a node's certificate must name its node id as a DNS name); not pulled from")
            raise Unavailable(f"peer {address} unreachable: {exc.code().name} {exc.details()}") from None

    def client(self, address: str, node_id: str) -> DataPlaneClient:
        """A new client of node ``node_id`` at ``address`` that proves this node's peer key (the caller
        closes it)."""
        proof = self._proof
        return DataPlaneClient(address, tls=self._tls(node_id) if self._tls else None,
                               peer_proof=(lambda g, call: proof(g, call, node_id)) if proof else None)

    async def forget(self, peer: Peer) -> None:
        """Drops a peer after a failure; the next :meth:`get` handshakes again."""
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]
            if peer.agent_name:
                self._transport.remove_peer(peer.agent_name)
            await peer.client.close()

    async def close(self) -> None:
        for peer in list(self._peers.values()):
            await self.forget(peer)
