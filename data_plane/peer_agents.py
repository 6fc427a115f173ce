"""The consumers' NIXL agents this node WRITEs to: a source's half of the handshake.

A consumer hands over its agent's metadata (already checked by :mod:`.nixl_metadata` to be an agent of that node);
the agent is loaded and sent a NIXL notification holding a random nonce; only when the consumer answers with that
nonce does the agent become the endpoint sends to that node use. Metadata naming a node's agent around another
process's worker address cannot be answered: the nonce reaches that other process. Until the answer, and after
any refusal, the endpoint the node had stays in place; a node's handshake replaces only its own endpoint.

Threading model: the data plane's event loop only (no locks).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

from kvmesh.errors import PermissionDenied, Unavailable

from data_plane.nixl_metadata import AgentMetadata
from data_plane.transfer import Transport

CHALLENGE_TTL_S = 30.0  # how long a handed-over agent waits for its challenge's answer


@dataclass(frozen=True, slots=True)
class _PendingAgent:
    agent: AgentMetadata
    nonce: bytes
    expires: float  # time.monotonic()


class PeerAgents:
    """node id -> the agent of its answered handshake, and the agents handed over but not answered yet."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._active: dict[str, AgentMetadata] = {}
        self._pending: dict[str, _PendingAgent] = {}

    def get(self, node_id: str) -> AgentMetadata | None:
        """The agent sends to ``node_id`` WRITE to (None: no answered handshake)."""
        return self._active.get(node_id)

    def challenge(self, node_id: str, metadata: bytes, agent: AgentMetadata) -> bytes:
        """Loads ``agent`` (pending) and sends it a nonce; returns the nonce's SHA-256 (the consumer tells this
        challenge's notification from a late one of an earlier handshake by it). A node handshakes again after a failure: the same
        agent's old endpoint goes now, so the next WRITE builds a fresh connection instead of reusing one that
        may be stalled; another (a new incarnation's) replaces the old one only once answered."""
        self._drop_pending(node_id)
        active = self._active.get(node_id)
        if active is not None and active.name == agent.name:
            del self._active[node_id]
            self._transport.remove_peer(active.name)
        self._transport.add_peer(metadata)
        nonce = secrets.token_hex(16).encode()
        self._pending[node_id] = _PendingAgent(agent, nonce, time.monotonic() + CHALLENGE_TTL_S)
        try:
            self._transport.notify(agent.name, nonce)
        except Unavailable:
            self._drop_pending(node_id)
            raise
        return hashlib.sha256(nonce).digest()

    def answer(self, node_id: str, answer: bytes) -> None:
        """The consumer's answer: its pending agent becomes its endpoint (PermissionDenied unless ``answer`` is the
        nonce sent, within :data:`CHALLENGE_TTL_S`)."""
        pending = self._pending.get(node_id)
        if pending is None or time.monotonic() > pending.expires or not hmac.compare_digest(answer, pending.nonce):
            self._drop_pending(node_id)
            raise PermissionDenied(f"the agent challenge answer of node {node_id!r} is not what this node sent "
                                   "its agent: hand over the agent's metadata again")
        del self._pending[node_id]
        old = self._active.get(node_id)
        self._active[node_id] = pending.agent
        if old is not None and old.name != pending.agent.name:
            self._transport.remove_peer(old.name)

    def forget_all(self) -> None:
        """After the transport's agent was replaced: every agent was loaded into the old one."""
        self._active.clear()
        self._pending.clear()

    def _drop_pending(self, node_id: str) -> None:
        pending = self._pending.pop(node_id, None)
        active = self._active.get(node_id)
        if pending is not None and (active is None or active.name != pending.agent.name):
            self._transport.remove_peer(pending.agent.name)
