"""Where the simulation's routing decisions are made: the real control plane, or its router in process.

- :class:`ControlPlaneBackend`: a real control-plane process over a real Redis;
  every decision is a ``Route`` RPC, every tier change a ``PublishEvents`` batch,
  every measurement a ``ReportStats``. Speculative entries and the pull ledger
  run on the control plane's wall clock, so the caller sets their TTL for the
  replay's compressed time.
- :class:`InProcessBackend`: the same :class:`~control_plane.routing.router.Router`
  (policies, cost model, speculative entries, ledger) on the simulation's virtual
  clock, over an in-memory copy of the published events and an in-memory moving
  average of the reports. It is what the sweeps run (hundreds of replays); the
  default point runs both and prints both.

Either way the router sees only what was published (``event_delay_ms`` late) and
reported (noisy probes and observed pulls); the simulator's truth stays in the
simulator.
"""

from __future__ import annotations

import collections
from abc import ABC, abstractmethod

from kvmesh.hashing import Extras
from kvmesh.namespace import Namespace
from kvmesh.v1 import control_plane_pb2 as pb, control_plane_pb2_grpc as pb_grpc

from control_plane.model import Medium, NodePrefix, PrefixMatch
from control_plane.routing.config import RoutingSettings
from control_plane.routing.cost_model import Figures
from control_plane.routing.router import Router
from control_plane.routing.stats import StatsStore
from control_plane.routing.types import (
    Candidate, EngineSample, LinkSample, Policy, PullOutcome, RouteDecision, RouteRequest, StatsReport,
)
from control_plane.scheduler_client import SchedulerClient

STORED, REMOVED = 1, 2


class Backend(ABC):
    @abstractmethod
    async def register(self, nodes: list[tuple[str, str, str]]) -> None:
        """Registers (node id, data-plane address, zone) triples (nodes of one zone share its uplink)."""

    @abstractmethod
    async def route(self, now_ms: float, candidates: list[Candidate], hashes: list[bytes], prompt_tokens: int,
                    policy: Policy, p2p: bool, kv_bytes_per_token: int) -> RouteDecision:
        """One placement."""

    @abstractmethod
    async def publish(self, now_ms: float, node_id: str, events: list[tuple[int, int, bytes]]) -> None:
        """Tier changes of one node, (kind, medium, hash), in order."""

    @abstractmethod
    async def report(self, now_ms: float, links: list[LinkSample], engines: list[EngineSample],
                     pulls: list[PullOutcome]) -> None:
        """Measured figures and pull outcomes."""

    async def close(self) -> None:
        """Releases connections."""


class _MemoryStats(StatsStore):
    """The stats store's moving averages, in memory (one simulation, one process)."""

    def __init__(self, alpha: float) -> None:
        self._alpha = alpha
        self._links: dict[tuple[str, str], float] = {}
        self._engines: dict[str, float] = {}

    def _fold(self, table: dict, key, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else old + self._alpha * (value - old)

    async def report(self, report: StatsReport, reporter: str = "") -> None:
        for s in report.links:
            self._fold(self._links, (s.source_node_id, s.dest_node_id), s.bytes_per_s)
        for e in report.engines:
            self._fold(self._engines, e.engine_id, e.prefill_tokens_per_s)

    async def figures(self) -> Figures:
        return Figures(dict(self._links), dict(self._engines))

    async def close(self) -> None:
        pass


class InProcessBackend(Backend):
    def __init__(self, namespace: Namespace, settings: RoutingSettings) -> None:
        self.now_s = 0.0
        self.ns = namespace
        self._zone: dict[str, str] = {}
        self.router = Router(_MemoryStats(settings.route_stats_ewma_alpha), settings, clock=lambda: self.now_s,
                             zone_of=lambda node: self._zone.get(node, node))
        self._held: dict[str, dict[int, set[bytes]]] = {}   # node -> medium -> hashes
        self._address: dict[str, str] = {}

    async def register(self, nodes: list[tuple[str, str, str]]) -> None:
        for node, address, zone in nodes:
            self._address[node] = address
            self._zone[node] = zone
            self._held[node] = collections.defaultdict(set)

    async def _lookup(self, ns: Namespace, hashes: list[bytes], token_ids: list[int], extras: Extras,
                      tiers: int) -> PrefixMatch:
        holders = []
        for node, media in self._held.items():
            per_tier = {}
            for medium in Medium:
                held, n = media[int(medium)], 0
                while n < len(hashes) and hashes[n] in held:
                    n += 1
                per_tier[medium] = n
            lead = 0
            while lead < len(hashes) and any(hashes[lead] in media[int(m)] for m in Medium):
                lead += 1
            if lead:
                holders.append(NodePrefix(node, self._address[node], lead, per_tier))
        holders.sort(key=lambda h: (-h.leading_blocks, h.node_id))
        return PrefixMatch(len(hashes), holders)

    async def route(self, now_ms, candidates, hashes, prompt_tokens, policy, p2p, kv_bytes_per_token):
        self.now_s = now_ms / 1000.0
        request = RouteRequest(self.ns, tuple(candidates), tuple(hashes), (), Extras(), prompt_tokens, policy, p2p,
                               0, kv_bytes_per_token)
        return await self.router.route(request, self._lookup)

    async def publish(self, now_ms, node_id, events):
        held = self._held[node_id]
        for kind, medium, h in events:
            (held[medium].add if kind == STORED else held[medium].discard)(h)

    async def report(self, now_ms, links, engines, pulls):
        self.now_s = now_ms / 1000.0
        await self.router.report(StatsReport(tuple(links), tuple(engines), tuple(pulls)))


class ControlPlaneBackend(Backend):
    def __init__(self, client: SchedulerClient, stub: pb_grpc.ControlPlaneStub, metadata: tuple) -> None:
        self.client = client
        self.stub = stub
        self.metadata = metadata
        self.ns = client.namespace
        self._seq: dict[str, tuple[int, int]] = {}   # node -> (incarnation, last seq)

    async def register(self, nodes):
        for node, address, _ in nodes:   # the control plane knows no zones: its ledger counts NICs only
            reply = await self.stub.RegisterNode(pb.RegisterNodeRequest(node=pb.NodeInfo(
                node_id=node, data_plane_address=address)), metadata=self.metadata)
            self._seq[node] = (reply.incarnation, reply.next_seq - 1)

    async def route(self, now_ms, candidates, hashes, prompt_tokens, policy, p2p, kv_bytes_per_token):
        return await self.client.route(candidates, block_hashes=hashes, prompt_tokens=prompt_tokens, policy=policy,
                                       p2p=p2p, kv_bytes_per_token=kv_bytes_per_token)

    async def publish(self, now_ms, node_id, events):
        batch: list[pb.KvEvent] = []
        run: list[bytes] = []
        key = None
        for kind, medium, h in events + [(0, 0, b"")]:
            if (kind, medium) != key and run:
                k, m = key
                batch.append(pb.KvEvent(stored=pb.BlockStored(block_hashes=run,
                                                                        block_size=self.ns.cache_config.block_size,
                                                                        medium=m))
                             if k == STORED else pb.KvEvent(removed=pb.BlockRemoved(block_hashes=run, medium=m)))
                run = []
            key = (kind, medium)
            run.append(h)
        incarnation, seq = self._seq[node_id]
        self._seq[node_id] = (incarnation, seq + 1)
        ack = await self.stub.PublishEvents(pb.EventBatch(
            node_id=node_id, incarnation=incarnation, seq=seq + 1, namespace=self.ns.to_proto(), events=batch),
            metadata=self.metadata)
        if ack.status != pb.ACK_STATUS_APPLIED:
            raise RuntimeError(f"{node_id}: batch {seq + 1} not applied: {ack}")

    async def report(self, now_ms, links, engines, pulls):
        await self.client.report_stats(links=links, engines=engines, pulls=pulls)

    async def close(self):
        await self.client.close()
