"""A small client of a node's data plane, for the engine connector and for peers.

:class:`DataPlaneClient` wraps the gRPC stub with typed methods (domain types
in, domain types out; failures stay ``grpc.aio.AioRpcError`` with the status
code the servicer chose). :class:`SharedTier` maps the node's shared-memory
region in the engine process, so the engine reads and writes slots directly:

    client = DataPlaneClient("127.0.0.1:7000", key=node_api_key)
    tier = SharedTier.open(await client.describe_tier())
    slots = await client.reserve(ns, hashes)        # -1: already stored or refused
    tier.slot(slots[0])[:] = kv_bytes                # write in place
    await client.commit(ns, hashes)                  # now visible to peers
    slots, lease = await client.acquire(ns, hashes)  # later: pin for reading
    data = bytes(tier.slot(slots[0]))
    await client.release(lease)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from kvmesh.channels import ClientTLS, channel
from kvmesh.namespace import Namespace
from kvmesh.v1 import common_pb2, data_plane_pb2 as pb, data_plane_pb2_grpc

from tenancy.auth import grant_metadata
from tenancy.peer_proof import PROOF_METADATA, PeerCall

from data_plane import wire
from data_plane.shm import SharedRegion
from data_plane.types import LookupAnswer, Medium, PullResult


@dataclass(frozen=True, slots=True)
class TierDescription:
    node_id: str
    shm_path: str
    block_bytes: int
    num_slots: int
    locked: bool
    block_tokens: int
    peer_public_key: bytes = b""  # the node's peer key (grants for its pulls bind it)


@dataclass(frozen=True, slots=True)
class PeerHandshake:
    node_id: str
    agent_name: str
    agent_metadata: bytes
    block_bytes: int
    challenge_sent: bool = False  # answer with what this node's agent received from agent_name
    challenge_digest: bytes = b""  # SHA-256 of that notification (an earlier handshake's late one does not match)




class DataPlaneClient:
    """One channel to one data plane. Every call takes an optional deadline in seconds."""

    def __init__(self, address: str, key: str | None = None, tls: ClientTLS | None = None,
                 peer_proof: Callable[[bytes, PeerCall], str] | None = None) -> None:
        """``key``: the node's API key (the local API needs it); a peer presents none, but a grant and
        ``peer_proof(grant, call)``, its proof of possession of the grant's key for that call (its method and
        request digest: tenancy.peer_proof)."""
        self.address = address
        self._proof = peer_proof
        self._channel = channel(address, key, tls)
        self._stub = data_plane_pb2_grpc.DataPlaneStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    def _peer(self, grant: bytes, method: str, request) -> tuple[tuple[str, str], ...]:
        """Metadata of a peer call: the grant and, when this client proves a peer key, the proof (which covers
        ``request``'s fields)."""
        if not grant:
            return ()
        proof = ((PROOF_METADATA, self._proof(grant, PeerCall.of(method, request))),) if self._proof is not None \
            else ()
        return grant_metadata(grant) + proof

    async def __aenter__(self) -> "DataPlaneClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- local API ----

    async def describe_tier(self, timeout: float | None = 10.0) -> TierDescription:
        r = await self._stub.DescribeTier(pb.DescribeTierRequest(), timeout=timeout)
        return TierDescription(r.node_id, r.shm_path, r.block_bytes, r.num_slots, r.locked, r.block_tokens,
                               r.peer_public_key)

    async def reserve(self, ns: Namespace, hashes: list[bytes], *, max_offload_tokens: int = 0,
                      first_block_index: int = 0, protected_blocks: int = 0,
                      timeout: float | None = 10.0) -> list[int]:
        r = await self._stub.Reserve(pb.ReserveRequest(
            namespace=ns.to_proto(), block_hashes=hashes, max_offload_tokens=max_offload_tokens,
            first_block_index=first_block_index, protected_blocks=protected_blocks), timeout=timeout)
        return list(r.slots)

    async def commit(self, ns: Namespace, hashes: list[bytes], timeout: float | None = 10.0) -> int:
        r = await self._stub.Commit(pb.CommitRequest(namespace=ns.to_proto(), block_hashes=hashes), timeout=timeout)
        return r.committed

    async def abort(self, ns: Namespace, hashes: list[bytes], timeout: float | None = 10.0) -> None:
        await self._stub.Abort(pb.AbortRequest(namespace=ns.to_proto(), block_hashes=hashes), timeout=timeout)

    async def acquire(self, ns: Namespace, hashes: list[bytes], *, media: Iterable[Medium] | None = None,
                      lease_ms: int = 0, timeout: float | None = 10.0) -> tuple[list[int], str]:
        r = await self._stub.Acquire(pb.AcquireRequest(
            namespace=ns.to_proto(), block_hashes=hashes, media=wire.media_to_pb(media), lease_ms=lease_ms),
            timeout=timeout)
        return list(r.slots), r.lease_id

    async def release(self, lease_id: str, timeout: float | None = 10.0, grant: bytes = b"") -> tuple[bool, str]:
        """Ends the lease; whether no WRITE under it may still land (settled), and the node's agent name."""
        request = pb.ReleaseRequest(lease_id=lease_id)
        r = await self._stub.Release(request, timeout=timeout, metadata=self._peer(grant, "Release", request))
        return r.settled, r.agent_name

    async def pull(self, ns: Namespace, hashes: list[bytes], source_node_id: str, source_address: str, *,
                   timeout_ms: int = 0, source_media: Iterable[Medium] | None = None,
                   first_block_index: int = 0, grant: bytes = b"", route_token: str = "",
                   lease_ms: int = 0, media: Iterable[Medium] | None = None,
                   timeout: float | None = None) -> PullResult:
        """``timeout`` (the RPC deadline) defaults to the pull's own bound plus a margin. ``lease_ms`` > 0: the
        answer's ``slots`` and ``lease_id`` are :meth:`acquire`'s of ``hashes`` in ``media``, in the same call."""
        if timeout is None:
            timeout = (timeout_ms or 60_000) / 1000 + 5
        r = await self._stub.Pull(pb.PullRequest(
            namespace=ns.to_proto(), block_hashes=hashes, source_node_id=source_node_id,
            source_address=source_address, timeout_ms=timeout_ms, source_media=wire.media_to_pb(source_media),
            first_block_index=first_block_index, grant=grant, route_token=route_token, lease_ms=lease_ms,
            media=wire.media_to_pb(media)), timeout=timeout)
        return wire.pull_result(r)

    async def ping(self, timeout: float | None = 10.0) -> None:
        await self._stub.Ping(common_pb2.PingRequest(), timeout=timeout)

    # ---- peer API ----

    # A peer call carries a pull grant (tenancy.grants) for this source; a local caller needs none.

    async def exchange_agent_metadata(self, node_id: str, metadata: bytes, block_bytes: int,
                                      timeout: float | None = 10.0, grant: bytes = b"",
                                      challenge_answer: bytes = b"") -> PeerHandshake:
        """The handshake's first call (``metadata``) or, when the source answered ``challenge_sent``, its second
        (``challenge_answer``: what this node's agent received from the source's agent)."""
        request = pb.ExchangeAgentMetadataRequest(node_id=node_id, agent_metadata=metadata, block_bytes=block_bytes,
                                                  agent_challenge_answer=challenge_answer)
        r = await self._stub.ExchangeAgentMetadata(request, timeout=timeout,
                                                   metadata=self._peer(grant, "ExchangeAgentMetadata", request))
        return PeerHandshake(r.node_id, r.agent_name, r.agent_metadata, r.block_bytes, r.agent_challenge_sent,
                             r.agent_challenge_digest)

    async def lookup(self, ns: Namespace, hashes: list[bytes], *, consumer_node_id: str = "",
                     pending_wait_ms: int = 0, lease_ms: int = 0, media: Iterable[Medium] | None = None,
                     timeout: float | None = 10.0, grant: bytes = b"") -> tuple[LookupAnswer, int]:
        """The settled answer (HITs pinned under its lease) and the source's block_bytes."""
        request = pb.LookupRequest(
            namespace=ns.to_proto(), block_hashes=hashes, consumer_node_id=consumer_node_id,
            pending_wait_ms=pending_wait_ms, lease_ms=lease_ms, media=wire.media_to_pb(media))
        r = await self._stub.Lookup(request, timeout=timeout, metadata=self._peer(grant, "Lookup", request))
        return wire.lookup_answer(r, len(hashes)), r.block_bytes

    async def send(self, ns: Namespace, lease_id: str, hashes: list[bytes], landing_addrs: list[int], *,
                   timeout: float | None = 10.0, grant: bytes = b"") -> tuple[int, int]:
        """Has the source WRITE the blocks pinned under ``lease_id`` (this caller's :meth:`lookup` in ``ns``;
        ``hashes``: its leading HITs, in order) to ``landing_addrs`` (in this node's registered region) and end
        the lease: how many leading blocks it wrote, and its block_bytes."""
        request = pb.LookupRequest(namespace=ns.to_proto(), block_hashes=hashes, landing_addrs=landing_addrs,
                                   lease_id=lease_id)
        r = await self._stub.Lookup(request, timeout=timeout, metadata=self._peer(grant, "Lookup", request))
        return wire.sent_blocks(r, len(hashes)), r.block_bytes


class SharedTier:
    """The node's CPU tier mapped into this (engine) process. Close it when done."""

    def __init__(self, region: SharedRegion) -> None:
        self._region = region
        self.block_bytes = region.block_bytes
        self.num_slots = region.num_slots
        self._file = region.file_identity()

    def replaced(self) -> bool:
        """Whether the data plane's tier file is no longer the one mapped here: it restarted (a new file at the
        path) or stopped (none). Slots it hands out are then slots of another file."""
        try:
            st = os.stat(self._region.path)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self._file

    @classmethod
    def open(cls, description: TierDescription) -> "SharedTier":
        return cls(SharedRegion(Path(description.shm_path), description.block_bytes, description.num_slots,
                                owner=False))

    def slot(self, slot: int) -> np.ndarray:
        """A writable uint8 view of one slot (no copy). Drop views before :meth:`close`."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} is outside 0..{self.num_slots - 1}")
        return self._region.slot(slot)

    def slots(self) -> np.ndarray:
        """Every slot as one writable ``[num_slots, block_bytes]`` uint8 matrix (no copy), for copies of many
        slots at once (fancy indexing by slot number). Drop it before :meth:`close`."""
        return self._region.array.reshape(self.num_slots, self.block_bytes)

    def close(self) -> None:
        self._region.close()
