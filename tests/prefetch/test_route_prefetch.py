"""Route-time prefetch (issue 21) on real parts: a control plane over Valkey in this process, data-plane processes
pulling over NIXL, schedulers with their tenants' keys over gRPC.

Nodes: ``src`` holds the blocks; ``dst`` runs the engine a Route picks (its ask is a local Pull + Acquire, what the
engine connector sends); ``far`` is a node tenant B's policy excludes. Each test stores fresh blocks.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import time
import urllib.request
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.channels import channel
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh.v1 import data_plane_pb2 as dp_pb, data_plane_pb2_grpc as dp_grpc
from kvmesh.v1 import tenant_admin_pb2 as tpb, tenant_admin_pb2_grpc as tpb_grpc
from tenancy.grants import GrantSigner, PrefetchTicket, prefetch_blocks_digest

from control_plane.config import ControlPlaneConfig
from control_plane.model import ALL_TIERS
from control_plane.scheduler_client import Candidate, Policy, SchedulerClient
from control_plane.server import serve as serve_control_plane
from data_plane.client import DataPlaneClient, SharedTier
from data_plane.server import TRANSFERS_HEALTH
from kvmesh_apps.dp_process import DataPlaneProcess

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

BLOCK = 64 * 1024
SLOTS = 32
NS_A = Namespace("t-alpha", "tiny-llama", "rev1", CacheConfig(block_size=32)).validate()
NS_B = Namespace("t-beta", "tiny-llama", "rev1", CacheConfig(block_size=32)).validate()
USE_WINDOW_MS = 1_500
PREFETCH_TIMEOUT_MS = 3_000
CAP_BLOCKS = 24  # dst's prefetch_max_inflight_bytes, in blocks


class World:
    def __init__(self, cp, admin_key: str, shm_dir: Path) -> None:
        self.cp, self.admin_key, self.shm_dir = cp, admin_key, shm_dir
        self.address = f"127.0.0.1:{cp.port}"
        self.nodes: dict[str, DataPlaneProcess] = {}

    async def admin(self, call: str, request):
        async with channel(self.address, self.admin_key) as ch:
            return await getattr(tpb_grpc.TenantAdminStub(ch), call)(request)

    async def key(self, **fields) -> str:
        return (await self.admin("IssueKey", tpb.IssueKeyRequest(**fields))).secret

    async def start(self, node_id: str, **flags) -> DataPlaneProcess:
        proc = await asyncio.to_thread(DataPlaneProcess, node_id, dict(
            listen="127.0.0.1:0", shm_dir=self.shm_dir, block_bytes=BLOCK, capacity_bytes=SLOTS * BLOCK,
            api_key=await self.key(role=tpb.ROLE_NODE, node_id=node_id), control_plane_address=self.address,
            metrics_listen="127.0.0.1:0", lease_sweep_ms=50) | flags)
        self.nodes[node_id] = proc
        await asyncio.to_thread(wait_transfers_ready, proc)  # a loaded host starts the NIXL agent late
        for _ in range(200):  # registration is asynchronous
            if any(n.node.node_id == node_id and n.live for n in await self.cp.core.block_map.list_nodes()):
                return proc
            await asyncio.sleep(0.05)
        raise AssertionError(f"{node_id} never registered")

    def scheduler(self, ns: Namespace, key: str) -> SchedulerClient:
        return SchedulerClient(self.address, ns, api_key=key)


@pytest.fixture
async def world(redis_server, key_prefix, admin_key):
    cp = await serve_control_plane(ControlPlaneConfig(
        listen="127.0.0.1:0", redis_url=redis_server.url, key_prefix=key_prefix, admin_key=admin_key,
        policy_ttl_s=0, route_speculative_ttl_ms=0, route_min_cached_token_delta=32))
    shm_dir = Path("/dev/shm") / f"kvmesh-pf-{uuid.uuid4().hex[:10]}"
    shm_dir.mkdir()
    w = World(cp, admin_key, shm_dir)
    await w.admin("CreateTenant", tpb.CreateTenantRequest(tenant_id=NS_A.tenant))
    await w.admin("CreateTenant", tpb.CreateTenantRequest(tenant_id=NS_B.tenant, policy=tpb.TenantPolicy(
        allowed_nodes=["src", "dst"])))  # B's blocks may live on src and dst, never on far
    # src serves pulls of up to 3 x 24 blocks: one peer pins at most half a node's slots of a tenant's blocks
    await w.start("src", capacity_bytes=4 * SLOTS * BLOCK)
    await w.start("dst", prefetch_use_window_ms=USE_WINDOW_MS, prefetch_timeout_ms=PREFETCH_TIMEOUT_MS,
                  prefetch_max_inflight_bytes=CAP_BLOCKS * BLOCK)
    yield w
    for proc in w.nodes.values():  # SIGCONT first: a test may leave a node stopped
        if proc.proc.poll() is None:
            os.kill(proc.proc.pid, signal.SIGCONT)
            await asyncio.to_thread(proc.stop)
    await cp.stop()
    shutil.rmtree(shm_dir, ignore_errors=True)


async def store(w: World, node: str, ns: Namespace, n: int) -> list[bytes]:
    """``n`` fresh blocks written and committed on ``node``; returns once the block map names it their holder."""
    proc = w.nodes[node]
    hashes = [os.urandom(32) for _ in range(n)]
    async with DataPlaneClient(proc.address, key=proc.api_key) as owner:
        tier = SharedTier.open(await owner.describe_tier())
        for slot in await owner.reserve(ns, hashes):
            tier.slot(slot)[:] = np.frombuffer(os.urandom(BLOCK), dtype=np.uint8)
        tier.close()
        assert await owner.commit(ns, hashes) == n
    for _ in range(200):
        match = await w.cp.core.block_map.lookup_prefix(ns, hashes, ALL_TIERS)
        if any(h.node_id == node and h.leading_blocks == n for h in match.holders):
            return hashes
        await asyncio.sleep(0.05)
    raise AssertionError(f"the map never named {node} as the holder")


def wait_transfers_ready(proc: DataPlaneProcess, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(proc.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        while health.Check(health_pb2.HealthCheckRequest(service=TRANSFERS_HEALTH), timeout=10).status != \
                health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, f"{proc.node_id}'s NIXL agent did not start in {timeout_s}s"
            time.sleep(0.05)


def metric(proc: DataPlaneProcess, name: str, **labels: str) -> float:
    url = next(m.group(1) for line in list(proc.output) if (m := re.search(r"metrics on (\S+)", line)))
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    series = f"{name}{{{want}}}" if labels else name
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines() if line.rpartition(" ")[0] == series)


async def prefetch_bytes_reach(node: DataPlaneProcess, kind: str, n_bytes: int, within_s: float, what: str) -> None:
    """Waits until ``node``'s prefetch bytes of ``kind`` reach ``n_bytes``; fails (``what``) after ``within_s``."""
    t0 = time.monotonic()
    while metric(node, "kvmesh_dp_prefetch_bytes_total", kind=kind) < n_bytes:
        assert time.monotonic() - t0 < within_s, f"the prefetch {what}"
        await asyncio.sleep(0.05)


async def route(w: World, ns: Namespace, key: str, hashes: list[bytes], engine_node: str = "dst", **kwargs):
    async with w.scheduler(ns, key) as scheduler:
        return await scheduler.route([Candidate(f"{engine_node}:engine", engine_node)], block_hashes=hashes,
                                     policy=Policy.LOAD_AWARE, **kwargs)


async def unused_ticket(w: World, ns: Namespace, key: str, hashes: list[bytes]) -> str:
    """The ticket of a Route's prefetch order to dst that the scheduler did not hand over (nobody used it)."""
    async with w.scheduler(ns, key) as scheduler:
        async def keep(_decision) -> str:
            return "kept by the test"
        scheduler._hand_over = keep
        decision = await scheduler.route([Candidate("dst:engine", "dst")], block_hashes=hashes,
                                         policy=Policy.LOAD_AWARE)
    assert decision.prefetch is not None and decision.prefetch_status == "kept by the test"
    return decision.prefetch.ticket


async def prefetch_call(proc: DataPlaneProcess, ns: Namespace, hashes: list[bytes], ticket: str, key: str | None):
    """``DataPlane.Prefetch`` as any caller holding ``key`` (None: no key) can send it."""
    async with grpc.aio.insecure_channel(proc.address) as ch:
        return await dp_grpc.DataPlaneStub(ch).Prefetch(dp_pb.PrefetchRequest(
            namespace=ns.to_proto(), block_hashes=hashes, ticket=ticket),
            metadata=(("authorization", f"Bearer {key}"),) if key else (), timeout=5)


async def ask(w: World, ns: Namespace, hashes: list[bytes], decision, timeout_ms: int = 8_000):
    """What the engine connector does for a routed request: Pull from the named source, then Acquire."""
    dst = w.nodes["dst"]
    async with DataPlaneClient(dst.address, key=dst.api_key) as engine:
        pulled = await engine.pull(ns, hashes, decision.source.node_id, decision.source.address,
                                   timeout_ms=timeout_ms, route_token=decision.source.route_token)
        slots, lease = await engine.acquire(ns, hashes)
        if lease:
            await engine.release(lease)
    return pulled, slots


async def free_slots(proc: DataPlaneProcess, ns: Namespace) -> int:
    """How many fresh blocks the node's tier takes now (evicting unpinned cache; pinned or reserved slots are
    not free); the reservations are aborted again."""
    hashes = [os.urandom(32) for _ in range(SLOTS)]
    async with DataPlaneClient(proc.address, key=proc.api_key) as owner:
        slots = await owner.reserve(ns, hashes)
        await owner.abort(ns, hashes)
    return sum(1 for s in slots if s >= 0)


async def test_a_request_whose_prefetch_is_in_flight_joins_it_one_transfer_not_two(world):
    src, dst = world.nodes["src"], world.nodes["dst"]
    a_key = await world.key(role=tpb.ROLE_SCHEDULER, tenant_id=NS_A.tenant)
    hashes = await store(world, "src", NS_A, 12)
    served_before = metric(src, "kvmesh_dp_bytes_total", direction="served")

    os.kill(src.proc.pid, signal.SIGSTOP)  # holds the prefetch in flight until the engine's ask has joined it
    try:
        decision = await route(world, NS_A, a_key, hashes)
        assert decision.source is not None and decision.source.node_id == "src"
        assert decision.prefetch is not None and decision.prefetch.node_id == "dst"
        assert decision.prefetch_status == "STARTED"
        asking = asyncio.ensure_future(ask(world, NS_A, hashes, decision))
        await asyncio.sleep(0.5)
        assert not asking.done()
    finally:
        os.kill(src.proc.pid, signal.SIGCONT)
    pulled, slots = await asking

    assert pulled.pulled == 12 and pulled.joined == 12 and pulled.bytes_pulled == 0  # it joined the prefetch
    assert len(slots) == 12
    # one transfer: the source served the blocks once, the destination pulled them once
    assert metric(src, "kvmesh_dp_bytes_total", direction="served") - served_before == 12 * BLOCK
    assert metric(dst, "kvmesh_dp_bytes_total", direction="pulled") == 12 * BLOCK
    assert metric(dst, "kvmesh_dp_prefetch_bytes_total", kind="prefetched") == 12 * BLOCK
    assert metric(dst, "kvmesh_dp_prefetch_bytes_total", kind="used") == 12 * BLOCK

    # opted out: no order, the engine's ask moves the blocks itself (the counters above do count transfers)
    others = await store(world, "src", NS_A, 12)
    decision = await route(world, NS_A, a_key, others, prefetch=False)
    assert decision.source is not None and decision.prefetch is None and decision.prefetch_status == ""
    pulled, _ = await ask(world, NS_A, others, decision)
    assert pulled.pulled == 12 and pulled.joined == 0 and pulled.bytes_pulled == 12 * BLOCK
    assert metric(src, "kvmesh_dp_bytes_total", direction="served") - served_before == 24 * BLOCK

    # a second order for blocks already being prefetched starts nothing new (the source held still, so that the
    # first cannot land, and leave the second nothing to order, in between)
    again = await store(world, "src", NS_A, 4)
    os.kill(src.proc.pid, signal.SIGSTOP)
    try:
        first = await route(world, NS_A, a_key, again)
        second = await route(world, NS_A, a_key, again)
    finally:
        os.kill(src.proc.pid, signal.SIGCONT)
    assert (first.prefetch_status, second.prefetch_status) == ("STARTED", "IN_FLIGHT")


async def test_a_request_whose_prefetch_landed_first_reports_a_pull_joined_not_a_local_hit(world):
    """The prefetch ends before the engine asks (the usual case when the engine queues the request): the ask finds
    the blocks committed, and they count as pulled by it (joined, moved by the prefetch), so the engine reports
    a pull from the source. Control: the same blocks asked for again, once the prefetch settled, are a local hit
    (``already_local``)."""
    dst = world.nodes["dst"]
    a_key = await world.key(role=tpb.ROLE_SCHEDULER, tenant_id=NS_A.tenant)
    hashes = await store(world, "src", NS_A, 8)
    decision = await route(world, NS_A, a_key, hashes)
    assert decision.prefetch_status == "STARTED"
    await prefetch_bytes_reach(dst, "prefetched", 8 * BLOCK, PREFETCH_TIMEOUT_MS / 1000 + 2.0, "never landed")
    pulled, slots = await ask(world, NS_A, hashes, decision)
    assert (pulled.pulled, pulled.already_local, pulled.joined, pulled.bytes_pulled) == (8, 0, 8, 0), pulled
    assert len(slots) == 8

    # control: the same blocks asked for again once the prefetch settled (used) are a local hit, not a pull
    pulled, slots = await ask(world, NS_A, hashes, decision)
    assert (pulled.pulled, pulled.already_local, pulled.joined) == (0, 8, 0), pulled
    assert len(slots) == 8


async def test_a_prefetch_whose_request_never_comes_is_released_within_the_bound(world):
    dst = world.nodes["dst"]
    a_key = await world.key(role=tpb.ROLE_SCHEDULER, tenant_id=NS_A.tenant)
    hashes = await store(world, "src", NS_A, 24)
    decision = await route(world, NS_A, a_key, hashes)
    assert decision.prefetch_status == "STARTED"
    await prefetch_bytes_reach(dst, "wasted", 24 * BLOCK, (PREFETCH_TIMEOUT_MS + USE_WINDOW_MS) / 1000 + 2.0,
                               "not released in time")
    assert metric(dst, "kvmesh_dp_prefetch_bytes_total", kind="prefetched") == 24 * BLOCK
    assert metric(dst, "kvmesh_dp_prefetch_bytes_total", kind="used") == 0
    assert metric(dst, "kvmesh_dp_prefetch_inflight_bytes") == 0
    # released: the prefetched blocks are ordinary cache, evicted for new blocks (the whole tier is free) ...
    async with DataPlaneClient(dst.address, key=dst.api_key) as engine:
        slots, lease = await engine.acquire(NS_A, hashes)
        assert len(slots) == 24, "the prefetched blocks are in dst's tier"
        # ... whereas blocks something still pins are not (negative control: the check sees a held slot)
        assert await free_slots(dst, NS_A) == SLOTS - 24
        await engine.release(lease)
    assert await free_slots(dst, NS_A) == SLOTS


async def test_a_scheduler_of_tenant_b_cannot_prefetch_a_namespace_or_to_a_node_b_excludes(world):
    await world.start("far")
    dst, far = world.nodes["dst"], world.nodes["far"]
    a_key = await world.key(role=tpb.ROLE_SCHEDULER, tenant_id=NS_A.tenant)
    b_key = await world.key(role=tpb.ROLE_SCHEDULER, tenant_id=NS_B.tenant)
    a_hashes = await store(world, "src", NS_A, 8)
    b_hashes = await store(world, "src", NS_B, 8)

    # positive control: A's own scheduler prefetches A's blocks into dst, and to far (A's policy allows every node)
    a_order = await route(world, NS_A, a_key, a_hashes)
    assert a_order.prefetch_status == "STARTED"
    assert (await route(world, NS_A, a_key, a_hashes, engine_node="far")).prefetch_status == "STARTED"

    # B routing A's namespace sees no holder: no source, no order
    stolen = await route(world, NS_A, b_key, a_hashes)
    assert stolen.source is None and stolen.prefetch is None

    # B routing its own prompt to far (excluded by B's policy): refused, naming the nodes B allows (review F3b)
    with pytest.raises(grpc.aio.AioRpcError) as excluded:
        await route(world, NS_B, b_key, b_hashes, engine_node="far")
    assert excluded.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "'src', 'dst'" in excluded.value.details()
    b_dst = await route(world, NS_B, b_key, b_hashes)
    assert b_dst.prefetch_status == "STARTED"

    attacks = {
        "B's ticket, to far (the ticket names dst)": (far, NS_B, b_hashes, b_dst.prefetch.ticket),
        "B's ticket, for A's namespace and blocks": (dst, NS_A, a_hashes, b_dst.prefetch.ticket),
        "B's ticket, for A's blocks in B's namespace": (dst, NS_B, a_hashes, b_dst.prefetch.ticket),
        "no ticket": (dst, NS_A, a_hashes, ""),
        "a ticket B signed itself": (dst, NS_A, a_hashes, GrantSigner.generate().sign(PrefetchTicket(
            NS_A.tenant, NS_A.fingerprint, "dst", "src", world.nodes["src"].address,
            prefetch_blocks_digest(a_hashes), "", int(time.time() * 1000) + 60_000)).decode()),
    }
    for what, (proc, ns, hashes, ticket) in attacks.items():
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await prefetch_call(proc, ns, hashes, ticket, b_key)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, what
    # positive control of the same call: a ticket of A's that Route gave and nobody used yet is taken. Fresh blocks:
    # A's first eight may already have landed on dst, and a Route to the node holding them gives no order at all
    a_fresh = await store(world, "src", NS_A, 8)
    reply = await prefetch_call(dst, NS_A, a_fresh, await unused_ticket(world, NS_A, a_key, a_fresh), a_key)
    assert reply.status == dp_pb.PREFETCH_STATUS_STARTED
    t0 = time.monotonic()
    while metric(far, "kvmesh_dp_prefetches_total", outcome="landed") < 1:  # far's first pull: a new NIXL peer
        assert time.monotonic() - t0 < 10, "\n".join(far.output)
        await asyncio.sleep(0.1)
    async with DataPlaneClient(far.address, key=far.api_key) as engine:
        assert len((await engine.acquire(NS_B, b_hashes))[0]) == 0, "none of B's blocks reached far"
        assert len((await engine.acquire(NS_A, a_hashes))[0]) == 8, "A's own prefetch to far landed"


async def test_a_nodes_key_gets_prefetch_orders_for_its_own_node_only(world):
    """A node's key may route the prompts of a tenant it may read, but an order for another node would let it make
    that node pull at will (its link, its tier): src's key routing A's blocks to dst's engine gets the decision and
    its source, no order. Control: dst's own key routing the same prompt to dst gets the order, and dst takes it."""
    src, dst = world.nodes["src"], world.nodes["dst"]
    hashes = await store(world, "src", NS_A, 8)
    by_src = await route(world, NS_A, src.api_key, hashes)
    assert by_src.source is not None and by_src.source.node_id == "src"
    assert by_src.prefetch is None and by_src.prefetch_status == "", "another node's key got dst's order"
    by_dst = await route(world, NS_A, dst.api_key, hashes)
    assert by_dst.prefetch is not None and by_dst.prefetch.node_id == "dst"
    assert by_dst.prefetch_status == "STARTED"


async def test_a_frozen_source_neither_delays_the_request_past_its_deadline_nor_leaks_slots(world):
    src, dst = world.nodes["src"], world.nodes["dst"]
    a_key = await world.key(role=tpb.ROLE_SCHEDULER, tenant_id=NS_A.tenant)
    hashes = await store(world, "src", NS_A, 16)
    more = await store(world, "src", NS_A, 12)
    os.kill(src.proc.pid, signal.SIGSTOP)
    try:
        decision = await route(world, NS_A, a_key, hashes)
        assert decision.prefetch_status == "STARTED"
        # the per-node cap: 16 blocks in flight, 12 more would pass 24
        assert (await route(world, NS_A, a_key, more)).prefetch_status == "OVER_CAP"
        t0 = time.monotonic()
        pulled, slots = await ask(world, NS_A, hashes, decision, timeout_ms=1_500)
        took = time.monotonic() - t0
        assert pulled.pulled == 0 and slots == []  # MISS: the engine recomputes
        assert took < 1.5 + 0.5, f"the request waited {took:.2f}s, past its 1.5 s deadline"
        t0 = time.monotonic()
        while metric(dst, "kvmesh_dp_prefetch_inflight_bytes") > 0:
            assert time.monotonic() - t0 < PREFETCH_TIMEOUT_MS / 1000 + 2.0, "the prefetch outlived its bound"
            await asyncio.sleep(0.1)
        assert metric(dst, "kvmesh_dp_prefetches_total", outcome="failed") == 1
        assert await free_slots(dst, NS_A) == SLOTS, "slots leaked"
    finally:
        os.kill(src.proc.pid, signal.SIGCONT)


async def test_a_tenant_whose_sources_stall_cannot_keep_another_tenants_prefetches_off_a_node(world):
    """B's scheduler routed B's prompts from a source that stalls to dst whenever dst's prefetch cap had room: each
    prefetch held its bytes for prefetch_timeout_ms, and A's orders to dst answered OVER_CAP for as long as B went
    on. Now one tenant takes at most an equal share of the cap among the tenants asking for it (running, or refused
    within prefetch_timeout_ms). Controls: alone, B has the whole cap; B keeps its half; A's prefetch lands."""
    src, dst = world.nodes["src"], world.nodes["dst"]
    await world.start("a-src", capacity_bytes=4 * SLOTS * BLOCK)
    a_key = await world.key(role=tpb.ROLE_SCHEDULER, tenant_id=NS_A.tenant)
    b_key = await world.key(role=tpb.ROLE_SCHEDULER, tenant_id=NS_B.tenant)
    a_blocks = [await store(world, "a-src", NS_A, 8) for _ in range(2)]
    b_blocks = [await store(world, "src", NS_B, CAP_BLOCKS) for _ in range(2)]
    os.kill(src.proc.pid, signal.SIGSTOP)  # B's source stalls
    try:
        assert (await route(world, NS_B, b_key, b_blocks[0])).prefetch_status == "STARTED"  # the whole cap
        assert (await route(world, NS_A, a_key, a_blocks[0])).prefetch_status == "OVER_CAP"  # A asks: contends
        t0 = time.monotonic()
        while metric(dst, "kvmesh_dp_prefetch_inflight_bytes") > 0:  # B's prefetch gives up
            assert time.monotonic() - t0 < PREFETCH_TIMEOUT_MS / 1000 + 2.0, "the prefetch outlived its bound"
            await asyncio.sleep(0.05)
        # B asks first again, as soon as the cap frees: its whole cap again would leave A refused (red before)
        assert (await route(world, NS_B, b_key, b_blocks[1])).prefetch_status == "OVER_CAP"
        assert (await route(world, NS_A, a_key, a_blocks[1])).prefetch_status == "STARTED"
        half = b_blocks[1][:CAP_BLOCKS // 2]
        assert (await route(world, NS_B, b_key, half)).prefetch_status == "STARTED"  # B keeps its half
    finally:
        os.kill(src.proc.pid, signal.SIGCONT)
    await prefetch_bytes_reach(dst, "prefetched", 8 * BLOCK, PREFETCH_TIMEOUT_MS / 1000 + 2.0, "A's never landed")


async def test_a_prefetch_that_fails_leaves_the_request_to_pull_itself_within_its_deadline(world):
    src, dst = world.nodes["src"], world.nodes["dst"]
    a_key = await world.key(role=tpb.ROLE_SCHEDULER, tenant_id=NS_A.tenant)
    hashes = await store(world, "src", NS_A, 8)
    os.kill(src.proc.pid, signal.SIGSTOP)  # longer than the prefetch's bound (3 s), shorter than the ask's (8 s)
    try:
        decision = await route(world, NS_A, a_key, hashes)
        assert decision.prefetch_status == "STARTED"
        t0 = time.monotonic()
        asking = asyncio.ensure_future(ask(world, NS_A, hashes, decision, timeout_ms=8_000))
        await asyncio.sleep(PREFETCH_TIMEOUT_MS / 1000 + 0.5)
        assert metric(dst, "kvmesh_dp_prefetches_total", outcome="failed") == 1  # the prefetch gave up
        assert not asking.done()
    finally:
        os.kill(src.proc.pid, signal.SIGCONT)
    pulled, slots = await asking
    assert time.monotonic() - t0 < 8.0 + 0.5
    # the ask joined the failed prefetch, then pulled the blocks itself, as it would have without a prefetch
    assert pulled.pulled == 8 and pulled.bytes_pulled == 8 * BLOCK and len(slots) == 8


async def test_a_prefetch_ticket_starts_one_prefetch_and_is_refused_when_presented_again(world):
    """A ticket is used once: presented again (by its own scheduler, or anyone who copied it) within its
    validity, it is refused, so a copied order cannot make the node pull again and again. Control: the first
    presentation starts the prefetch."""
    key = await world.key(role=tpb.ROLE_SCHEDULER, tenant_id=NS_A.tenant)
    hashes = await store(world, "src", NS_A, 4)
    ticket = await unused_ticket(world, NS_A, key, hashes)
    first = await prefetch_call(world.nodes["dst"], NS_A, hashes, ticket, key)
    assert first.status == dp_pb.PREFETCH_STATUS_STARTED
    with pytest.raises(grpc.aio.AioRpcError) as again:
        await prefetch_call(world.nodes["dst"], NS_A, hashes, ticket, key)
    assert again.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "already used" in again.value.details()


class PrefetchRecorder(dp_grpc.DataPlaneServicer):
    """What a node's key holder sees of the orders handed to its node: every Prefetch call's metadata."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, str], str]] = []

    async def Prefetch(self, request, context):
        self.calls.append(({k: v for k, v in context.invocation_metadata()}, request.ticket))
        return dp_pb.PrefetchResponse(status=dp_pb.PREFETCH_STATUS_STARTED)


async def test_a_scheduler_hands_an_order_over_without_its_key_and_the_ticket_alone_starts_it(world):
    """Found in review: SchedulerClient handed each prefetch order over with its own API key, so whoever held the
    chosen node's key (its data plane's address) kept the tenant's scheduler key, and with it every Lookup, Watch
    and Route of the tenant and of the tenants sharing with it, long after the node's own key was revoked. The
    ticket alone now authorises a Prefetch. Controls: the node got the order, ticket included; a real data plane
    starts a prefetch on the ticket without any key; a forged ticket, or another call without a key, is refused."""
    from kvmesh.grpc_server import ServiceBinding, start_server
    from kvmesh.v1 import control_plane_pb2 as cp_pb, control_plane_pb2_grpc as cp_grpc
    recorder = PrefetchRecorder()
    server = await start_server("127.0.0.1:0", [ServiceBinding(recorder, dp_grpc.add_DataPlaneServicer_to_server,
                                                               "kvmesh.v1.DataPlane")])
    try:
        async with channel(world.address, await world.key(role=tpb.ROLE_NODE, node_id="evil")) as ch:
            await cp_grpc.ControlPlaneStub(ch).RegisterNode(cp_pb.RegisterNodeRequest(
                node=cp_pb.NodeInfo(node_id="evil", data_plane_address=f"127.0.0.1:{server.port}")))
        a_key = await world.key(role=tpb.ROLE_SCHEDULER, tenant_id=NS_A.tenant)
        hashes = await store(world, "src", NS_A, 4)
        decision = await route(world, NS_A, a_key, hashes, engine_node="evil")
    finally:
        await server.stop()
    assert decision.prefetch is not None and decision.prefetch_status == "STARTED"  # control: handed over
    assert [ticket for _, ticket in recorder.calls] == [decision.prefetch.ticket]
    metadata = recorder.calls[0][0]
    assert "authorization" not in metadata and a_key not in " ".join(metadata.values()), \
        "the scheduler's key went to the node it gave the order to"
    more = await store(world, "src", NS_A, 4)
    started = await prefetch_call(world.nodes["dst"], NS_A, more, await unused_ticket(world, NS_A, a_key, more), None)
    assert started.status == dp_pb.PREFETCH_STATUS_STARTED  # the ticket alone is enough
    with pytest.raises(grpc.aio.AioRpcError) as forged:
        await prefetch_call(world.nodes["dst"], NS_A, more, "forged." + decision.prefetch.ticket, None)
    assert forged.value.code() == grpc.StatusCode.PERMISSION_DENIED
    async with grpc.aio.insecure_channel(world.nodes["dst"].address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as keyless:
            await dp_grpc.DataPlaneStub(ch).Lookup(dp_pb.LookupRequest(namespace=NS_A.to_proto(), block_hashes=more))
    assert keyless.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_the_prefetches_one_tenant_orders_do_not_crowd_another_out_of_a_node(world):
    """Tenant B's scheduler (or anyone routing B's prompts) orders prefetch after prefetch into dst; A's blocks on dst,
    fewer than its share of dst's slots, stay (data_plane.fair_share). Before, dst's eviction ranked both tenants'
    blocks together and B's prefetches evicted A's oldest first. Control: B's latest prefetch landed in full."""
    dst = world.nodes["dst"]
    b_key = await world.key(role=tpb.ROLE_SCHEDULER, tenant_id=NS_B.tenant)
    a_hashes = await store(world, "dst", NS_A, 8)  # A's engine on dst saved 8 blocks: 8 of 32 slots, share 16
    rounds, landed = 3, metric(dst, "kvmesh_dp_prefetches_total", outcome="landed")
    for i in range(rounds):  # 3 x 24 of B's blocks into a 32-slot tier
        b_hashes = await store(world, "src", NS_B, CAP_BLOCKS)
        assert (await route(world, NS_B, b_key, b_hashes)).prefetch_status == "STARTED"
        t0 = time.monotonic()
        while metric(dst, "kvmesh_dp_prefetches_total", outcome="landed") < landed + i + 1:
            assert time.monotonic() - t0 < 20, "\n".join(dst.output)
            await asyncio.sleep(0.05)
    async with DataPlaneClient(dst.address, key=dst.api_key) as engine:
        a_slots, a_lease = await engine.acquire(NS_A, a_hashes)
        b_slots, b_lease = await engine.acquire(NS_B, b_hashes)
        for lease in (a_lease, b_lease):
            if lease:
                await engine.release(lease)
    assert len(a_slots) == 8, f"B's prefetches evicted {8 - len(a_slots)} of A's 8 blocks on dst"
    assert len(b_slots) == CAP_BLOCKS  # control: B's last prefetch is all there
