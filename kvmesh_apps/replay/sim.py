"""Engines simulated in virtual time; every routing decision and tier change goes to the real control plane.

One :class:`Simulation` replays the trace for one variant (policy, P2P on or
off, or no sharing at all). Each engine has a GPU prefix cache and a CPU tier
on its co-located node (both LRU, in 512-token blocks) and prefills one request
at a time: pull (when routed to a source) -> promote to GPU -> prefill the
rest. The source's CPU tier is checked when the pull starts, not when the route
was chosen: a source that evicted the blocks meanwhile serves fewer (a stale
route). Tier changes are published as real ``PublishEvents`` batches before
each ``Route``, ``event_delay_ms`` of virtual time late. Decode is not
simulated: TTFT = queueing + pull + promotion + prefill.
"""

from __future__ import annotations

import collections
import heapq
import time
from dataclasses import dataclass, field

from kvmesh.namespace import CacheConfig, Namespace
from kvmesh_apps.replay.profile import Profile
from kvmesh_apps.replay.trace import BlockHashes, TraceRequest
from control_plane.scheduler_client import Candidate, EngineSample, LinkSample, PullOutcome, SchedulerClient
from kvmesh.v1 import control_plane_pb2 as pb, control_plane_pb2_grpc as pb_grpc

from control_plane.model import Medium
from control_plane.routing.types import KvSource, Policy, RouteDecision

_STORED, _REMOVED = 1, 2


@dataclass(frozen=True)
class Variant:
    name: str             # e.g. "cost-aware+p2p"
    policy: Policy
    p2p: bool
    sharing: bool = True  # False: no prefix reuse at all (every prompt fully prefilled)

    @property
    def slug(self) -> str:
        return self.name.replace("+", "-")


def variants() -> list[Variant]:
    out = [Variant(f"{p.label}+p2p", p, True) for p in
           (Policy.COST_AWARE, Policy.TOKEN_AWARE, Policy.LOAD_AWARE, Policy.AFFINITY)]
    out += [Variant(f"{p.label}-nop2p", p, False) for p in
            (Policy.COST_AWARE, Policy.TOKEN_AWARE, Policy.LOAD_AWARE, Policy.AFFINITY)]
    return out + [Variant("no-sharing", Policy.LOAD_AWARE, False, sharing=False)]


class Lru:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._d: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def __contains__(self, h: bytes) -> bool:
        return h in self._d

    def touch(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self._d.move_to_end(h)

    def insert(self, hashes: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Inserts or refreshes ``hashes``; returns (newly stored, evicted)."""
        new, evicted = [], []
        for h in hashes:
            if h in self._d:
                self._d.move_to_end(h)
                continue
            self._d[h] = None
            new.append(h)
            if len(self._d) > self.capacity:
                evicted.append(self._d.popitem(last=False)[0])
        return new, evicted


def _leading(hashes: list[bytes], *tiers: Lru) -> int:
    n = 0
    for h in hashes:
        if not any(h in t for t in tiers):
            break
        n += 1
    return n


@dataclass
class _Job:
    arrival_ms: float
    tokens: int
    hashes: list[bytes]
    planned_tokens: int            # tokens to prefill as routed (the engine's backlog counts these)
    source: KvSource | None


@dataclass
class Engine:
    index: int
    node_id: str
    gpu: Lru
    cpu: Lru
    queue: collections.deque = field(default_factory=collections.deque)
    busy_until: float = 0.0
    busy: bool = False
    pending: list = field(default_factory=list)   # (time_ms, kind, medium, hash)
    seq: int = 0
    incarnation: int = 0


@dataclass
class Totals:
    ttft_ms: list[float] = field(default_factory=list)
    first_arrival_ms: float = 0.0
    last_finish_ms: float = 0.0
    prompt_tokens: int = 0
    gpu_tokens: int = 0
    local_cpu_tokens: int = 0
    peer_tokens: int = 0
    computed_tokens: int = 0
    bytes_moved: int = 0
    routes_with_source: int = 0
    stale_routes: int = 0
    route_rpc_ms: list[float] = field(default_factory=list)


class Simulation:
    def __init__(self, variant: Variant, requests: list[TraceRequest], hashes: BlockHashes, profile: Profile,
                 engines: int, client: SchedulerClient, stub: pb_grpc.ControlPlaneStub, metadata: tuple,
                 event_delay_ms: float) -> None:
        self.v = variant
        self.p = profile
        self.requests = requests
        self.hashes = hashes
        self.client = client
        self.stub = stub
        self.metadata = metadata
        self.delay = event_delay_ms
        self.ns: Namespace = client.namespace
        self.engines = [Engine(i, f"{variant.slug}-e{i}", Lru(profile.gpu_kv_blocks), Lru(profile.cpu_tier_blocks))
                        for i in range(engines)]
        self.by_node = {e.node_id: e for e in self.engines}
        self.nic_free = [0.0] * engines
        self.link_samples: list[LinkSample] = []
        self.pull_outcomes: list[PullOutcome] = []
        self.totals = Totals()
        self._done: list = []  # heap of (finish_ms, order, engine index, job)
        self._order = 0

    @staticmethod
    def namespace(variant: Variant, run_id: str) -> Namespace:
        return Namespace("replay", f"trace-{variant.slug}", run_id, CacheConfig(block_size=512)).validate()

    # -- control plane ------------------------------------------------------------------

    async def register(self) -> None:
        for e in self.engines:
            rack = self.p.rack_of(e.index, len(self.engines))
            reply = await self.stub.RegisterNode(pb.RegisterNodeRequest(node=pb.NodeInfo(
                node_id=e.node_id, data_plane_address=f"10.0.{rack}.{e.index + 10}:7100")), metadata=self.metadata)
            e.incarnation, e.seq = reply.incarnation, reply.next_seq - 1
        # What a fleet measures at start (engines: a calibration prefill; data planes: a probe pull per peer,
        # e.g. `kvmesh bench pull`); observed pulls refine the link figures from then on.
        n = len(self.engines)
        await self.client.report_stats(
            engines=[EngineSample(e.node_id, self.p.prefill_tokens_per_s) for e in self.engines],
            links=[LinkSample(a.node_id, b.node_id, self.p.link_bytes_per_s(a.index, b.index, n))
                   for a in self.engines for b in self.engines if a is not b])

    async def _publish(self, now_ms: float) -> None:
        for e in self.engines:
            cut = 0
            while cut < len(e.pending) and e.pending[cut][0] <= now_ms - self.delay:
                cut += 1
            if not cut:
                continue
            events: list[pb.KvEvent] = []
            run: list[bytes] = []
            key = None
            for _, kind, medium, h in e.pending[:cut] + [(0, 0, 0, b"")]:
                if (kind, medium) != key and run:
                    events.append(self._event(key, run))
                    run = []
                key = (kind, medium)
                run.append(h)
            del e.pending[:cut]
            e.seq += 1
            ack = await self.stub.PublishEvents(pb.EventBatch(
                node_id=e.node_id, incarnation=e.incarnation, seq=e.seq, namespace=self.ns.to_proto(),
                events=events), metadata=self.metadata)
            if ack.status != pb.ACK_STATUS_APPLIED:
                raise RuntimeError(f"{e.node_id}: batch {e.seq} not applied: {ack}")
        if self.link_samples or self.pull_outcomes:
            await self.client.report_stats(links=self.link_samples, pulls=self.pull_outcomes)
            self.link_samples, self.pull_outcomes = [], []

    @staticmethod
    def _event(key: tuple[int, int], hashes: list[bytes]) -> pb.KvEvent:
        kind, medium = key
        if kind == _STORED:
            return pb.KvEvent(stored=pb.BlockStored(block_hashes=hashes, block_size=512, medium=medium))
        return pb.KvEvent(removed=pb.BlockRemoved(block_hashes=hashes, medium=medium))

    # -- the engines ------------------------------------------------------------------------

    def _candidates(self, now_ms: float) -> list[Candidate]:
        out = []
        for e in self.engines:
            backlog = sum(j.planned_tokens for j in e.queue)
            if e.busy:
                backlog += int(max(0.0, e.busy_until - now_ms) / 1000.0 * self.p.prefill_tokens_per_s)
            out.append(Candidate(e.node_id, e.node_id, len(e.queue), backlog))
        return out

    def _start(self, e: Engine, job: _Job, now_ms: float) -> None:
        p, t = self.p, self.totals
        hashes = job.hashes if self.v.sharing else []
        gpu_hit = _leading(hashes, e.gpu)
        local_hit = _leading(hashes, e.gpu, e.cpu)
        pulled, ready = 0, now_ms
        if job.source is not None:
            src = self.by_node[job.source.node_id]
            promised = job.source.cached_tokens // p.block_tokens
            have = _leading(hashes, src.cpu)
            t.routes_with_source += 1
            t.stale_routes += have < promised
            ready = now_ms + p.lookup_ms
            if have > local_hit:
                pulled = have - local_hit
                nbytes = pulled * p.block_bytes
                begin = max(ready, self.nic_free[src.index])
                ready = begin + 1000.0 * nbytes / p.link_bytes_per_s(src.index, e.index, len(self.engines))
                self.nic_free[src.index] = ready
                self.link_samples.append(LinkSample(src.node_id, e.node_id,
                                                    nbytes / max(1e-9, (ready - now_ms - p.lookup_ms) / 1000.0)))
                src.cpu.touch(hashes[:have])
                t.bytes_moved += nbytes
            self.pull_outcomes.append(PullOutcome(src.node_id, promised, min(have, promised)))
        cached = min((local_hit + pulled) * p.block_tokens, job.tokens)
        computed = max(job.tokens - cached, 1)
        promote = (local_hit - gpu_hit + pulled) * p.block_bytes
        finish = ready + 1000.0 * promote / p.promotion_bytes_per_s + 1000.0 * computed / p.prefill_tokens_per_s
        t.prompt_tokens += job.tokens
        t.gpu_tokens += min(gpu_hit * p.block_tokens, job.tokens)
        t.local_cpu_tokens += min(local_hit * p.block_tokens, job.tokens) - min(gpu_hit * p.block_tokens, job.tokens)
        t.peer_tokens += cached - min(local_hit * p.block_tokens, job.tokens)
        t.computed_tokens += computed
        e.busy, e.busy_until = True, finish
        self._order += 1
        heapq.heappush(self._done, (finish, self._order, e.index, job))

    def _finish(self, e: Engine, job: _Job, now_ms: float) -> None:
        self.totals.ttft_ms.append(now_ms - job.arrival_ms)
        self.totals.last_finish_ms = max(self.totals.last_finish_ms, now_ms)
        if self.v.sharing and job.hashes:
            for tier, medium in ((e.gpu, Medium.GPU), (e.cpu, Medium.CPU)):
                new, evicted = tier.insert(job.hashes)
                e.pending += [(now_ms, _STORED, int(medium), h) for h in new]
                e.pending += [(now_ms, _REMOVED, int(medium), h) for h in evicted]
        e.busy = False
        if e.queue:
            self._start(e, e.queue.popleft(), now_ms)

    async def run(self) -> Totals:
        await self.register()
        self.totals.first_arrival_ms = self.requests[0].arrival_ms
        for r in self.requests:
            while self._done and self._done[0][0] <= r.arrival_ms:
                finish, _, index, job = heapq.heappop(self._done)
                self._finish(self.engines[index], job, finish)
            if self.v.sharing:
                await self._publish(r.arrival_ms)
            hashes = self.hashes.of(r)
            started = time.perf_counter()
            d: RouteDecision = await self.client.route(
                self._candidates(r.arrival_ms), block_hashes=hashes, prompt_tokens=r.input_tokens,
                policy=self.v.policy, p2p=self.v.p2p, kv_bytes_per_token=self.p.kv_bytes_per_token)
            self.totals.route_rpc_ms.append(1000.0 * (time.perf_counter() - started))
            e = self.by_node[d.engine_id]
            cached = d.source.cached_tokens if d.source else d.local_cached_tokens
            planned = r.input_tokens - (cached if self.v.sharing else 0)
            job = _Job(r.arrival_ms, r.input_tokens, hashes, max(planned, 1), d.source)
            if e.busy:
                e.queue.append(job)
            else:
                self._start(e, job, r.arrival_ms)
        while self._done:
            finish, _, index, job = heapq.heappop(self._done)
            self._finish(self.engines[index], job, finish)
        return self.totals
