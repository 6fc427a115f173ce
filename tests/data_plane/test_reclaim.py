"""Held landing slots come back once no write can land in them, and not before; meanwhile they cost only the
source's own landing arena on the consumer, never its tier. Nodes are real (gRPC, NIXL over UCX; sources are
processes where they freeze or die); the consumer runs in this process so the test can freeze the source at the
exact moment between its Lookup and its send."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import numpy as np
import pytest

from kvmesh.grpc_server import server_options

from data_plane.client import DataPlaneClient
from data_plane.server import serve
from data_plane.reclaim import Quarantine, Reclaimer, Verdict
from data_plane.transfer import TransferFailed, Transport
from data_plane.types import LookupStatus

from tests.data_plane.helpers import WrappedTransport, commit_blocks
from tenancy.peer_proof import NodeIdentity

pytestmark = pytest.mark.nixl

N = 4
BLOCK_BYTES = 64 * 1024  # the conftest nodes' slot size
FAST_RECLAIM = dict(reclaim_retry_ms=100, reclaim_max_retry_ms=400, reclaim_timeout_ms=500)


async def pull_fresh_blocks(owner: DataPlaneClient, local: DataPlaneClient, consumer, source_address: str, ns,
                            grant, timeout_ms: int):
    """Commits N blocks on the source "src" (through ``owner``) and has ``consumer`` pull them under a grant for
    its own peer key, once its NIXL agent is up: the pull's result."""
    hashes = await commit_blocks(owner, ns, N)
    await consumer.core.transport.ready(60.0)
    key = (await local.describe_tier()).peer_public_key
    return await local.pull(ns, hashes, "src", source_address, grant=grant(key, "consumer", "src", ns),
                            timeout_ms=timeout_ms)


def freeze_between_the_calls(monkeypatch, consumer, pid: int) -> None:
    """SIGSTOPs ``pid`` right after the consumer reserved its landing slots (the source answered the Lookup
    and pinned its HITs; the send has not left yet)."""
    real = consumer.core.pulls._reserve_for_pull

    def reserve_then_freeze(*args, **kwargs):
        out = real(*args, **kwargs)
        os.kill(pid, signal.SIGSTOP)
        return out

    monkeypatch.setattr(consumer.core.pulls, "_reserve_for_pull", reserve_then_freeze)


async def until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return predicate()


def metric(node, name: str) -> float:
    return node.core.metrics.registry.get_sample_value(name) or 0.0


async def quarantine_behind_a_frozen_source(monkeypatch, consumer, source, ns, grant) -> int:
    """Pulls N blocks from ``source`` (a process), frozen between the calls: the consumer holds N slots of the
    source's landing arena and none of its tier. Returns the consumer's free tier slots before the pull."""
    async with DataPlaneClient(source.address, key=source.api_key) as owner, \
            DataPlaneClient(consumer.address, key=consumer.core.config.node_key()) as local:
        control, hashes = await commit_blocks(owner, ns, 1), await commit_blocks(owner, ns, N)
        token = grant((await local.describe_tier()).peer_public_key, "consumer", source.node_id, ns)
        # handshaken (both agents up) before the pull whose short bound is for the frozen source alone
        assert (await local.pull(ns, control, source.node_id, source.address, grant=token)).pulled == 1
        free = consumer.core.tier.free_slots
        freeze_between_the_calls(monkeypatch, consumer, source.proc.pid)
        result = await local.pull(ns, hashes, source.node_id, source.address, grant=token, timeout_ms=1_500)
        monkeypatch.undo()
    assert result.pulled == 0 and result.statuses == [LookupStatus.MISS] * N
    assert consumer.core.quarantine.held == N and consumer.core.tier.free_slots == free
    arena = consumer.core.transport.landing_arena(source.node_id)
    assert arena.free_slots == arena.slots - N
    assert metric(consumer, "kvmesh_dp_quarantined_slots") == N
    return free


async def test_slots_quarantined_behind_a_frozen_source_come_back_once_it_resumes(
        local_node, dp_process, ns, grant, monkeypatch):
    """The source freezes (SIGSTOP) between the Lookup and the send: the send times out and the consumer
    holds its landing slots. Negative control: while the source stays frozen, round after round of asking
    proves nothing and the slots stay held. After SIGCONT the source's WRITE completes or is abandoned, it
    answers "settled" for the lease, and every slot of its arena is free again (and handed out again)."""
    source = dp_process("src")
    consumer = await local_node(node_id="consumer", **FAST_RECLAIM)
    try:
        free = await quarantine_behind_a_frozen_source(monkeypatch, consumer, source, ns, grant)
        await asyncio.sleep(2.5)  # about a dozen asks at 100-400 ms, each unanswered
        assert consumer.core.quarantine.held == N, "a frozen source proves nothing"
        assert metric(consumer, "kvmesh_dp_reclaimed_slots_total") == 0
    finally:
        os.kill(source.proc.pid, signal.SIGCONT)
    assert await until(lambda: consumer.core.quarantine.held == 0, 30.0), "the resumed source settled the lease"
    assert consumer.core.tier.free_slots == free
    assert metric(consumer, "kvmesh_dp_reclaimed_slots_total") == N
    assert metric(consumer, "kvmesh_dp_quarantined_slots") == 0
    assert metric(consumer, "kvmesh_dp_quarantine_slots_total") == N
    arena = consumer.core.transport.landing_arena(source.node_id)
    assert len(arena.take(arena.slots)) == arena.slots, "every slot of its arena is handed out again"


async def test_slots_come_back_when_a_restarted_source_answers_at_the_same_address(
        local_node, dp_process, ns, grant, monkeypatch):
    """The frozen source is killed and another process of the same node starts at the same address: its NIXL
    agent (its incarnation) differs from the one that took the lease, so the process that could write is gone
    (a live one would still hold the port) and the slots come back. Negative control: while the old process is
    frozen (not yet killed), they stay held."""
    source = dp_process("src")
    consumer = await local_node(node_id="consumer", **FAST_RECLAIM)
    free = await quarantine_behind_a_frozen_source(monkeypatch, consumer, source, ns, grant)
    await asyncio.sleep(1.5)
    assert consumer.core.quarantine.held == N, "a frozen source proves nothing"
    # the premise of that proof: no other process can bind the address while the frozen one lives
    with pytest.raises(RuntimeError, match="Address already in use"):
        dp_process("src-twin", listen=source.address)
    source.kill()
    restarted = dp_process("src", listen=source.address)
    assert restarted.address == source.address
    assert await until(lambda: consumer.core.quarantine.held == 0, 30.0), "a new incarnation answered"
    assert consumer.core.tier.free_slots == free
    assert metric(consumer, "kvmesh_dp_reclaimed_slots_total") == N


class HeldWrites(WrappedTransport):
    """The real transport, whose WRITEs wait until ``go`` is set, then run (real NIXL) with their own bound."""

    def __init__(self, real: Transport) -> None:
        super().__init__(real)
        self.go = asyncio.Event()

    async def write(self, peer, local_offsets, remote_addrs, length, timeout_s, tag=b""):
        await self.go.wait()
        await self._real.write(peer, local_offsets, remote_addrs, length, 10.0, tag)


async def test_another_consumer_cannot_settle_the_victims_lease(local_node, ns, grant, monkeypatch):
    """The attacker (a consumer with a valid grant of its own for the same namespace and source, holding the
    victim's lease id) asks the source to settle it while the victim's WRITE is still held: the victim's slots
    stay held and the source still answers the victim "not settled". Positive control: once the held WRITE
    runs (landing in the held slots, as it may), the victim's own ask proves it and the slots come back."""
    source = await local_node(node_id="src")
    consumer = await local_node(node_id="consumer", **FAST_RECLAIM)
    held = HeldWrites(source.core.transport)
    source.core.transport = held
    leases: list[str] = []
    real_send = source.core.sends.send

    async def send_recording_lease(ns_, lease_id, *args, **kwargs):
        leases.append(lease_id)
        return await real_send(ns_, lease_id, *args, **kwargs)

    monkeypatch.setattr(source.core.sends, "send", send_recording_lease)
    attacker = NodeIdentity()
    async with DataPlaneClient(source.address, key=source.core.config.node_key()) as owner, \
            DataPlaneClient(consumer.address, key=consumer.core.config.node_key()) as local, \
            DataPlaneClient(source.address,
                            peer_proof=lambda g, method: attacker.proof(g, method, "src")) as mallory:
        free = consumer.core.tier.free_slots
        result = await pull_fresh_blocks(owner, local, consumer, source.address, ns, grant, timeout_ms=8_000)  # the first handshake vets metadata (seconds when loaded)
        assert result.pulled == 0 and consumer.core.quarantine.held == N and len(leases) == 1
        attacker_grant = grant(attacker.public_key, "mallory", "src", ns)
        for _ in range(3):
            await mallory.release(leases[0], grant=attacker_grant)
        await asyncio.sleep(1.5)  # the victim asks several times meanwhile
        assert consumer.core.quarantine.held == N, "the attacker's release settled nothing"
        assert consumer.core.tier.free_slots == free, "no tier slot is held"
        held.go.set()  # the WRITE runs now
        assert await until(lambda: consumer.core.quarantine.held == 0, 20.0), "the victim's own ask proved it"


async def test_the_reclaimer_backs_off_and_stops_when_nothing_is_held(ns):
    """The reclaimer's own loop, with a scripted source (the real ones above drive it through gRPC): it asks
    again only after a delay that doubles up to its cap, an ask that hangs or breaks proves nothing, the slots
    are freed on the first proof, and once nothing is held no task runs (an idle node costs nothing)."""
    answers = [Verdict.PENDING, "hang", "break", Verdict.PENDING, Verdict.SETTLED]
    asked_at: list[float] = []
    freed: list[list[int]] = []

    async def ask(record: Quarantine, timeout_s: float) -> Verdict:
        asked_at.append(time.monotonic())
        answer = answers[len(asked_at) - 1]
        if answer == "hang":
            await asyncio.sleep(60)
        if answer == "break":
            raise RuntimeError("the ask broke")
        return answer

    reclaimer = Reclaimer(ask, lambda record: freed.append(record.slots.tolist()), retry_s=0.05, max_retry_s=0.2,
                          timeout_s=0.1)
    assert not reclaimer.active
    added = time.monotonic()
    reclaimer.add(Quarantine(None, np.array([3, 5]), ns, "src", "127.0.0.1:1", "src-agent", "lease", b"grant"))
    assert reclaimer.active and reclaimer.records == 1
    assert await until(lambda: freed, 10.0)
    assert freed == [[3, 5]] and len(asked_at) == len(answers)
    waits = [b - a for a, b in zip([added, *asked_at], asked_at)]
    expected = [0.05, 0.1, 0.2 + 0.1, 0.2, 0.2]  # doubling, capped at 0.2; the hung ask costs its 0.1 s bound
    assert all(w >= e - 0.01 for w, e in zip(waits, expected)), waits
    await asyncio.sleep(0)
    assert not reclaimer.active and reclaimer.records == 0
    await reclaimer.close()


async def test_each_record_is_freed_on_its_own_proof(ns):
    """Two sources' records at once (each record is itself, whatever its slots): the one whose source settles is
    freed, the other stays held and asked; :meth:`Reclaimer.drop_all` (the agent replaced) forgets it."""
    freed: list[list[int]] = []
    answers = {"honest": Verdict.SETTLED, "frozen": Verdict.PENDING}

    async def ask(record: Quarantine, timeout_s: float) -> Verdict:
        return answers[record.source_node_id]

    reclaimer = Reclaimer(ask, lambda record: freed.append(record.slots.tolist()), retry_s=0.02, max_retry_s=0.05,
                          timeout_s=0.1)
    frozen_arena, honest_arena = object(), object()  # the arenas only need to be told apart here
    reclaimer.add(Quarantine(frozen_arena, np.array([1, 2]), ns, "frozen", "127.0.0.1:1", "f-agent", "lease-f", b"g"))
    reclaimer.add(Quarantine(honest_arena, np.array([1, 2]), ns, "honest", "127.0.0.1:2", "h-agent", "lease-h", b"g"))
    assert await until(lambda: freed, 5.0)
    await asyncio.sleep(0.2)
    assert freed == [[1, 2]] and reclaimer.held_in(frozen_arena) == 2 and reclaimer.held_in(honest_arena) == 0
    assert reclaimer.active, "the frozen source is still asked"
    assert reclaimer.drop_all() == 2 and reclaimer.held == 0
    await asyncio.sleep(0.2)
    assert not reclaimer.active and freed == [[1, 2]]
    await reclaimer.close()


async def test_a_port_is_not_shared_with_another_process_as_grpc_would_by_default():
    """The control of the premise above: with gRPC's default options (SO_REUSEPORT on) a second server binds
    a port a live one holds, so "another agent answers at the address" would prove nothing; with the options
    every kvmesh server uses, it cannot."""

    for options, shared in (([], True), (server_options(), False)):
        first = grpc.aio.server(options=options)
        port = first.add_insecure_port("127.0.0.1:0")
        await first.start()
        try:
            assert binds(port, options) is shared
        finally:
            await first.stop(None)


async def test_a_stopping_source_keeps_its_port_until_its_writes_in_flight_end(config, local_node, ns, grant):
    """A source stopped gracefully with a WRITE in flight (held here) keeps its port until that WRITE ends, so a
    replacement that binds the port proves the WRITE is over. Control: the port is free as soon as the stop
    returns."""
    source = await serve(config(node_id="src"))
    consumer = await local_node(node_id="consumer", reclaim_retry_ms=600_000)
    held = HeldWrites(source.core.transport)
    source.core.transport = held
    port = int(source.address.rpartition(":")[2])
    async with DataPlaneClient(source.address, key=source.core.config.node_key()) as owner, \
            DataPlaneClient(consumer.address, key=consumer.core.config.node_key()) as local:
        result = await pull_fresh_blocks(owner, local, consumer, source.address, ns, grant, timeout_ms=8_000)  # the first handshake vets metadata (seconds when loaded)
    assert result.pulled == 0 and consumer.core.quarantine.held == N  # the WRITE is still held
    stopping = asyncio.create_task(source.stop())
    await asyncio.sleep(1.0)
    assert not stopping.done() and not binds(port, server_options()), "the port is kept while the WRITE runs"
    held.go.set()
    await asyncio.wait_for(stopping, 30.0)
    assert binds(port, server_options()), "given up once it ended"


def binds(port: int, options) -> bool:
    server = grpc.aio.server(options=options)
    try:
        return server.add_insecure_port(f"127.0.0.1:{port}") != 0
    except RuntimeError:  # grpcio raises when it cannot bind
        return False


class TimedOutWrites(WrappedTransport):
    """The real transport, whose WRITEs time out the way one over UCX tcp does on a cut path: NIXL released
    the request, but bytes already in the socket buffers may still land when the path drains."""

    async def write(self, peer, local_offsets, remote_addrs, length, timeout_s, tag=b""):
        raise TransferFailed(f"WRITE with {peer} timed out", may_still_write=True, released=True)


async def test_a_timed_out_write_is_never_reported_settled_even_when_nixl_released_it(local_node, ns, grant):
    """Releasing a timed-out request does not call back bytes UCX already handed to a TCP socket: the source
    keeps the send in its ledger, so the consumer's landing slots stay held (reused, they could be
    overwritten when the cut path heals). Control: a source whose WRITE is merely held answers settled once it
    ran (test_another_consumer_cannot_settle_the_victims_lease)."""
    source = await local_node(node_id="src")
    consumer = await local_node(node_id="consumer", **FAST_RECLAIM)
    source.core.transport = TimedOutWrites(source.core.transport)
    async with DataPlaneClient(source.address, key=source.core.config.node_key()) as owner, \
            DataPlaneClient(consumer.address, key=consumer.core.config.node_key()) as local:
        result = await pull_fresh_blocks(owner, local, consumer, source.address, ns, grant, timeout_ms=8_000)  # the first handshake vets metadata (seconds when loaded); the WRITE fails at once
        assert result.pulled == 0 and consumer.core.quarantine.held == N
        await asyncio.sleep(1.5)  # the consumer asks several times meanwhile (FAST_RECLAIM)
        assert metric(consumer, "kvmesh_dp_reclaimed_slots_total") == 0
        assert consumer.core.quarantine.held == N, "a timed-out WRITE was reported settled"


async def test_a_source_that_never_settles_costs_only_its_own_landing_arena(local_node, ns, grant):
    """A source whose WRITEs time out (never reported settled: only its restart would prove them over) and whose
    arena on the consumer holds N blocks, renewable once (``landing_renewals_per_source=1``). After one failed pull
    its arena is held; the source recovers (a healed path) and the next pull renews the arena and brings the
    blocks, without the source restarting. Failing again, its new arena is held and the next pull is refused
    before any Lookup, in one line naming the setting. Nothing else pays: the consumer's tier lost no slot, nothing
    counts against the tenant, the consumer keeps its NIXL agent (no peer re-handshakes), and a pull from another
    source (the positive control) brings its blocks. Replacing the agent (what a node at max_landing_sources
    does) drops the held slots with their arena, and the source, fixed, is pulled from again."""
    source, other = await local_node(node_id="src"), await local_node(node_id="other")
    consumer = await local_node(node_id="consumer", landing_bytes_per_source=N * BLOCK_BYTES,
                                landing_renewals_per_source=1, **FAST_RECLAIM)
    real = source.core.transport
    failing = TimedOutWrites(real)
    async with DataPlaneClient(source.address, key=source.core.config.node_key()) as owner, \
            DataPlaneClient(other.address, key=other.core.config.node_key()) as other_owner, \
            DataPlaneClient(consumer.address, key=consumer.core.config.node_key()) as local:
        key = (await local.describe_tier()).peer_public_key
        await consumer.core.transport.ready(60.0)
        agent = consumer.core.transport.agent_name
        free = consumer.core.tier.free_slots
        lookups = []
        real_lookup = source.core.lookup

        def counting_lookup(*args, **kwargs):
            lookups.append(1)
            return real_lookup(*args, **kwargs)

        source.core.lookup = counting_lookup
        token = grant(key, "consumer", "src", ns)

        async def pull(hashes):
            return await local.pull(ns, hashes, "src", source.address, grant=token, timeout_ms=8_000)

        source.core.transport = failing
        hashes = await commit_blocks(owner, ns, N)
        assert (await pull(hashes)).pulled == 0
        first = consumer.core.transport.landing_arena("src")
        assert consumer.core.quarantine.held == N and first.free_slots == 0
        source.core.transport = real  # the path healed; the timed-out WRITE is still never reported settled
        assert (await pull(hashes)).pulled == N, "renewed, the source is pulled from again without a restart"
        assert consumer.core.transport.landing_arena("src") is not first and consumer.core.quarantine.held == 0
        assert metric(consumer, "kvmesh_dp_reclaimed_slots_total") == N  # the retired arena's records dropped

        source.core.transport = failing
        again = await commit_blocks(owner, ns, N)
        assert (await pull(again)).pulled == 0 and consumer.core.quarantine.held == N
        asked = len(lookups)
        result = await pull(again)
        assert result.pulled == 0 and "landing_renewals_per_source" in result.refused and \
            f"hold {N} of the {N} slots" in result.refused, result.refused
        assert len(lookups) == asked, "refused before any Lookup"
        assert consumer.core.tier.free_slots == free - N and consumer.core.tier.tenant_slots(ns.tenant) == N, \
            "only the N blocks pulled are in the tier"
        theirs = await commit_blocks(other_owner, ns, N)  # the positive control
        pulled = await local.pull(ns, theirs, "other", other.address, grant=grant(key, "consumer", "other", ns))
        assert pulled.pulled == N
        await asyncio.sleep(1.5)  # the consumer asks the source again and again meanwhile (FAST_RECLAIM)
        assert consumer.core.quarantine.held == N and consumer.core.transport.agent_name == agent, \
            "the consumer replaced its agent for a source's failures"
        # the agent replaced for another reason: the held slots go with their arena
        assert await consumer.core.quarantine.renew_transport()
        assert consumer.core.quarantine.held == 0 and metric(consumer, "kvmesh_dp_quarantined_slots") == 0
        source.core.transport = real
        assert (await pull(again)).pulled == N
