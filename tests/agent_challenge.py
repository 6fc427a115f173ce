"""A test's own NIXL agent (:func:`nixl_agent_with_buffer`) answering a source's handshake challenge, the way a data plane does it
(data_plane/peers.py, ``_handshake``).

A handshake takes two ExchangeAgentMetadata calls: the first hands over the agent's metadata, and the source
sends that agent a NIXL notification holding a nonce; the second returns the nonce (``agent_challenge_answer``),
and only then does the source WRITE to that agent. Stale notifications (earlier handshakes') are dropped before
the first call, and the nonce taken is the one whose SHA-256 the source returned (a late one of an earlier
handshake is not it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
import uuid

import numpy as np

from data_plane.client import DataPlaneClient, PeerHandshake

CHALLENGE_WAIT_S = 10.0
UCX_TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}  # NIXL over UCX tcp on loopback
_POLL_S = 0.005


def drop_notifications(agent) -> None:
    """Takes whatever ``agent`` received so far: a challenge of an earlier handshake is not the next one's."""
    agent.get_new_notifs()


def _taken(agent, sender: str, digest: bytes) -> bytes | None:
    notes = agent.get_new_notifs().get(sender) or []
    return next((n for n in notes if not digest or hashlib.sha256(n).digest() == digest), None)


async def challenge_nonce(agent, sender: str, digest: bytes = b"", timeout_s: float = CHALLENGE_WAIT_S) -> bytes:
    """The nonce agent ``sender`` (the source's) sent ``agent`` (the one hashing to ``digest``, the handshake
    reply's ``agent_challenge_digest``), awaited without blocking the event loop (the source may be served on it)."""
    deadline = time.monotonic() + timeout_s
    while (nonce := _taken(agent, sender, digest)) is None:
        assert time.monotonic() < deadline, f"the challenge of agent {sender!r} never reached the agent"
        await asyncio.sleep(_POLL_S)
    return nonce


def challenge_nonce_blocking(agent, sender: str, digest: bytes = b"",
                             timeout_s: float = CHALLENGE_WAIT_S) -> bytes:
    """:func:`challenge_nonce` for a caller with no event loop (the source served on another thread)."""
    deadline = time.monotonic() + timeout_s
    while (nonce := _taken(agent, sender, digest)) is None:
        assert time.monotonic() < deadline, f"the challenge of agent {sender!r} never reached the agent"
        time.sleep(_POLL_S)
    return nonce


async def handshake(peer: DataPlaneClient, node_id: str, agent, grant: bytes, block_bytes: int) -> PeerHandshake:
    """A consumer's whole handshake with ``peer``'s source: hand over ``agent``'s metadata as node ``node_id``,
    answer the challenge the source sent it. The first call's answer."""
    drop_notifications(agent)
    hs = await peer.exchange_agent_metadata(node_id, agent.get_agent_metadata(), block_bytes, grant=grant)
    if hs.challenge_sent:
        nonce = await challenge_nonce(agent, hs.agent_name, hs.challenge_digest)
        await peer.exchange_agent_metadata(node_id, b"", block_bytes, grant=grant, challenge_answer=nonce)
    return hs


@contextlib.contextmanager
def nixl_agent_with_buffer(role: str, nbytes: int):
    """A NIXL agent in this process, on UCX over tcp, with a registered buffer of ``nbytes`` (zeroed)."""
    saved = {k: os.environ.get(k) for k in UCX_TCP}
    os.environ.update(UCX_TCP)
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"{role}-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=["UCX"]))  # <node id>-<incarnation>
    buf = np.zeros(nbytes, dtype=np.uint8)
    reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    try:
        yield agent, buf
    finally:
        agent.deregister_memory(reg)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
