"""NixlTransport with real NIXL agents (UCX) in this process: a transfer that times out may still write, and
closes its peer's endpoint so the next use needs a new handshake; a transfer that completes keeps it."""

from __future__ import annotations

import asyncio
import hashlib
import threading

import numpy as np
import pytest

from data_plane.shm import SharedRegion
from data_plane.transfer import NixlTransport, NotPosted, TransferFailed

from tests.data_plane.helpers import nixl_pair

pytestmark = pytest.mark.nixl

BLOCK = 1 << 20
SLOTS = 64


@pytest.fixture
async def pair(shm_dir, monkeypatch):
    async with nixl_pair(shm_dir, monkeypatch, "t", BLOCK, SLOTS) as transports:
        yield transports


async def test_a_timed_out_write_may_still_write_and_closes_the_endpoint(pair):
    src, dst, (src_region, dst_region) = pair
    peer = src.add_peer(dst.metadata())
    src_region.slot(0)[:] = 7
    offsets = [src_region.offset(s) for s in range(SLOTS)]
    remote = [dst_region.base_addr + dst_region.offset(s) for s in range(SLOTS)]

    await src.write(peer, offsets[:1], remote[:1], BLOCK, timeout_s=30.0)  # control: a write that completes
    assert np.all(dst_region.slot(0) == 7)
    await src.write(peer, offsets[:1], remote[:1], BLOCK, timeout_s=30.0)  # ... keeps its endpoint

    for _ in range(50):  # 64 MiB with 2 ms to move it: posted, and still in flight at its bound
        with pytest.raises(TransferFailed) as failed:
            await src.write(peer, offsets, remote, BLOCK, timeout_s=0.002)
        if not isinstance(failed.value, NotPosted):  # (a thread a busy host started past the bound posts nothing)
            break
    assert "timed out" in str(failed.value) and failed.value.may_still_write
    with pytest.raises(TransferFailed, match="unknown peer"):  # the endpoint is gone
        await src.write(peer, offsets[:1], remote[:1], BLOCK, timeout_s=30.0)

    assert src.add_peer(dst.metadata()) == peer  # a new handshake: a fresh endpoint that works
    src_region.slot(1)[:] = 9
    await src.write(peer, offsets[1:2], remote[1:2], BLOCK, timeout_s=30.0)
    assert np.all(dst_region.slot(1) == 9)


async def test_a_peer_removed_during_a_transfer_is_closed_after_it(pair):
    src, dst, (src_region, dst_region) = pair
    peer = src.add_peer(dst.metadata())
    src_region.slot(2)[:] = 5
    src._busy[peer] = 1  # a transfer in flight to it
    src.remove_peer(peer)
    assert peer in src._retired  # not invalidated under the transfer
    src._busy.clear()
    src._retired.discard(peer)
    src.add_peer(dst.metadata())  # re-added before the deferred close: usable
    await src.write(peer, [src_region.offset(2)], [dst_region.base_addr + dst_region.offset(2)], BLOCK, 30.0)
    assert np.all(dst_region.slot(2) == 5)


async def test_a_late_notification_of_an_earlier_handshake_is_not_taken_for_this_one(pair):
    """A handshake retried after its first challenge was late: the first nonce may arrive after the second call
    began to wait; only the nonce whose SHA-256 the source returned answers it."""
    src, dst, _ = pair
    dst_peer = src.add_peer(dst.metadata())
    src.notify(dst_peer, b"nonce-of-the-earlier-handshake")
    fresh = b"nonce-of-this-handshake"
    assert await dst.notification(src.agent_name, 5.0, hashlib.sha256(fresh).digest()) is None  # the old one waits
    assert await dst.notification(src.agent_name, 30.0) == b"nonce-of-the-earlier-handshake"  # control: no digest
    src.notify(dst_peer, b"nonce-of-the-earlier-handshake")
    src.notify(dst_peer, fresh)
    assert await dst.notification(src.agent_name, 30.0, hashlib.sha256(fresh).digest()) == fresh



async def test_no_thread_moves_bytes_for_two_agents(shm_dir, monkeypatch):
    """NIXL binds a thread to one of an agent's UCX workers, keyed by the agent's address: a thread that outlived an
    agent of three workers and served the next agent built at that address, with one worker, failed its transfer
    ("Worker ID out of range": a flake of long pytest runs, whose event loop, and so its default executor, lives for
    the session). A transport's transfers run in threads of its own, which end with it: no thread serves two agents.
    Control: every write lands, on each lane."""
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    served: dict[int, set[threading.Thread]] = {}
    blocking = NixlTransport._xfer_blocking

    def recorded(self, *args):
        served.setdefault(id(self), set()).add(threading.current_thread())
        return blocking(self, *args)

    monkeypatch.setattr(NixlTransport, "_xfer_blocking", recorded)
    closed: list[NixlTransport] = []
    for cycle, lanes in enumerate([3, 1]):
        regions = [SharedRegion(shm_dir / f"w{cycle}-{i}.tier", 4096, 8, owner=True) for i in range(2)]
        src, dst = (NixlTransport(f"w{cycle}{i}", region, progress_wait_ms=10, lanes=lanes)
                    for i, region in enumerate(regions))
        closed.append(src)  # kept: its id() stays its own
        try:
            for t in (src, dst):
                await t.ready(60.0)
            peer = src.add_peer(dst.metadata())
            regions[0].array[:] = cycle + 1
            offsets = [regions[0].offset(s) for s in range(8)]
            remote = [regions[1].base_addr + regions[1].offset(s) for s in range(8)]
            await asyncio.gather(*(src.write(peer, offsets, remote, 4096, timeout_s=30.0) for _ in range(4)))
            assert np.all(regions[1].array == cycle + 1), f"{lanes} lanes: the writes did not land"
        finally:
            for t in (src, dst):
                t.close()
            for region in regions:
                region.close()
    first, second = served.values()
    assert first and second and not first & second, "a thread moved bytes for two agents"


@pytest.fixture
async def pieced(shm_dir, monkeypatch):
    async with nixl_pair(shm_dir, monkeypatch, "p", BLOCK, SLOTS, piece_bytes=4 * BLOCK) as transports:
        yield transports


def count_in_flight(transport: NixlTransport, monkeypatch) -> tuple[list[int], list[int]]:
    """Instruments ``transport``: after each request posted, how many of its requests are posted and not yet
    released (the lane's requests in flight at once); and that count now (``live[0]``)."""
    agent, seen, live = transport._agent, [], [0]
    post, release = agent.transfer, transport._release

    def posted(handle):
        live[0] += 1
        seen.append(live[0])
        return post(handle)

    def released(handle) -> bool:
        live[0] -= 1
        return release(handle)

    monkeypatch.setattr(agent, "transfer", posted)
    monkeypatch.setattr(transport, "_release", released)
    return seen, live


async def test_a_write_in_pieces_keeps_several_requests_in_flight_and_lands_every_block(pieced, monkeypatch):
    """A tagged WRITE of 64 blocks in pieces of 4 (16 requests on one lane): up to four are posted at once, so the
    path does not idle between pieces (one at a time before); every block lands in its slot, and every request is
    released."""
    src, dst, (src_region, dst_region) = pieced
    peer = src.add_peer(dst.metadata())
    src_region.array[:] = np.random.default_rng(3).integers(0, 256, src_region.array.size, dtype=np.uint8)
    in_flight, live = count_in_flight(src, monkeypatch)
    offsets = [src_region.offset(s) for s in range(SLOTS)]
    remote = [dst_region.base_addr + dst_region.offset(s) for s in range(SLOTS)]
    await src.write(peer, offsets, remote, BLOCK, timeout_s=30.0, tag=b"lease")
    assert len(in_flight) == SLOTS // 4 and max(in_flight) == 4, in_flight
    assert np.array_equal(dst_region.array, src_region.array)
    assert src._unreleased == 0 and live[0] == 0
    in_flight.clear()
    await src.write(peer, offsets, remote, BLOCK, timeout_s=30.0)  # control: untagged, one request
    assert in_flight == [1] and live[0] == 0


async def test_a_write_in_pieces_that_times_out_releases_every_request_and_may_still_write(pieced, monkeypatch):
    """Timed out with pieces still in flight: each one posted is released, the failure says the destination may
    still change, and the endpoint is closed (the next use needs a new handshake)."""
    src, dst, (src_region, dst_region) = pieced
    peer = src.add_peer(dst.metadata())
    offsets = [src_region.offset(s) for s in range(SLOTS)]
    remote = [dst_region.base_addr + dst_region.offset(s) for s in range(SLOTS)]
    in_flight, live = count_in_flight(src, monkeypatch)
    bound = 0.0005
    for _ in range(16):  # a bound that falls while pieces are in flight (not before the first is posted)
        with pytest.raises(TransferFailed) as failed:
            await src.write(peer, offsets, remote, BLOCK, timeout_s=bound, tag=b"lease")
        if not isinstance(failed.value, NotPosted) and max(in_flight) > 1:
            break
        if not isinstance(failed.value, NotPosted):
            assert src.add_peer(dst.metadata()) == peer
        in_flight.clear()
        bound *= 2
    assert max(in_flight) > 1, "no bound fell while several pieces were in flight"
    assert "timed out" in str(failed.value) and failed.value.may_still_write
    assert failed.value.released and src._unreleased == 0
    assert live[0] == 0, "a request still in flight was not released"
    with pytest.raises(TransferFailed, match="unknown peer"):
        await src.write(peer, offsets[:1], remote[:1], BLOCK, timeout_s=30.0)


class _Handle:
    def __init__(self) -> None:
        self.releases = 0

    def release(self) -> None:
        self.releases += 1


class _ScriptedAgent:
    """Stands in for a NIXL agent (beside the real-agent tests above) to place the deadline exactly: every request
    is posted in flight ("PROC"), polling answers ``polled``, and the clock reaches the deadline once
    ``deadline_after`` requests are posted, or while a request still in flight is polled."""

    def __init__(self, clock: list[float], deadline_after: int, polled: str) -> None:
        self.clock, self.deadline_after, self.polled = clock, deadline_after, polled
        self.handles: list[_Handle] = []

    def get_xfer_descs(self, addrs, memory):
        return addrs

    def initialize_xfer(self, op, local, remote, peer, message):
        self.handles.append(_Handle())
        return self.handles[-1]

    def transfer(self, handle) -> str:
        if len(self.handles) == self.deadline_after:
            self.clock[0] = 100.0
        return "PROC"

    def check_xfer_state(self, handle) -> str:
        if self.polled == "PROC":
            self.clock[0] = 100.0
        return self.polled


@pytest.mark.parametrize("polled, may_still_write", [("DONE", False), ("PROC", True)])
def test_a_deadline_between_posts_polls_the_pieces_in_flight_before_calling_them_timed_out(
        monkeypatch, polled: str, may_still_write: bool):
    """Six pieces, four in flight at most. Pieces that in fact landed: the deadline passes once five are posted
    (four unpolled), and the failure is clean (nothing may still write). Pieces still moving: the deadline passes
    while the first is polled, and the failure may still write. Either way nothing is posted past the deadline
    and every posted request is released once."""
    clock = [0.0]
    monkeypatch.setattr("data_plane.transfer.time.monotonic", lambda: clock[0])
    transport = NixlTransport.__new__(NixlTransport)
    transport._agent, transport._unreleased = _ScriptedAgent(clock, 5, polled), 0
    pieces = [(np.zeros((1, 3), dtype=np.uint64), np.zeros((1, 3), dtype=np.uint64), b"") for _ in range(6)]
    with pytest.raises(TransferFailed) as failed:
        transport._xfer_blocking("WRITE", "peer", pieces, deadline=50.0)
    assert not isinstance(failed.value, NotPosted)
    assert failed.value.may_still_write is may_still_write, str(failed.value)
    posted = 5 if polled == "DONE" else 4
    assert len(transport._agent.handles) == posted  # none posted past the deadline
    assert [h.releases for h in transport._agent.handles] == [1] * posted
