"""The replay in virtual time: engines (:mod:`engine`), the network (:mod:`network`), a router (:mod:`backends`).

One :class:`Simulation` replays a window of the trace for one variant (policy,
P2P on or off, or no sharing). Arrivals are routed in order; between arrivals
engine steps, network flows, KV loads and offloads complete as events. A routed
pull reads the source's CPU tier when the destination's scheduler first examines
the request, not when it was routed: a source that evicted meanwhile serves fewer
blocks (a stale route), and never more than the route named. The pull is a flow
on the shared network (:mod:`network`: fair shares on every link, the rack
uplinks included); one not done after ``pull_timeout_ms`` is cancelled and its
tokens recomputed (the connector's timeout). Pulled blocks are then promoted over
the engine's PCIe link; finished prompts are offloaded to the CPU tier over it
(in time, not at once), and reach the tier only when the copy ends.

The router is told only what a real one is: the engines' queues as a snapshot
taken every ``load_report_ms`` (plus what this gateway routed since), tier
changes ``event_delay_ms`` late, each link's bandwidth from a calibration on the
idle network at start, then from probes that are real transfers on the simulated
network (one pair at a time, every link once per ``reprobe_s``) and from every
pull, measured over the whole transfer (sharing included); the engines' measured
prefill throughput (every ``report_s``) and the pulls' outcomes.

TTFT = arrival to the end of the step that prefilled the prompt's last token.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from dataclasses import dataclass, field

from control_plane.model import Medium
from control_plane.routing.types import Candidate, EngineSample, LinkSample, Policy, PullOutcome
from kvmesh_apps.replay.backends import REMOVED, STORED, Backend
from kvmesh_apps.replay.costs import StepCosts
from kvmesh_apps.replay.engine import Engine, Phase, Seq
from kvmesh_apps.replay.network import Network
from kvmesh_apps.replay.profile import Profile
from kvmesh_apps.replay.trace import BlockHashes, TraceRequest

_GPU, _CPU = int(Medium.GPU), int(Medium.CPU)
_STEP, _LOADED, _NET, _TIMEOUT, _OFFLOADED, _SNAPSHOT, _PROBE = 1, 2, 3, 4, 5, 6, 7


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


@dataclass
class Totals:
    ttft_ms: list[float] = field(default_factory=list)
    alone_ms: list[float] = field(default_factory=list)    # each TTFT's prompt prefilled alone, from scratch
    wait_ms: list[float] = field(default_factory=list)     # queue + KV load before the prefill began
    first_arrival_ms: float = 0.0
    last_arrival_ms: float = 0.0
    last_first_token_ms: float = 0.0
    prompt_tokens: int = 0
    gpu_tokens: int = 0
    local_cpu_tokens: int = 0
    peer_tokens: int = 0
    computed_tokens: int = 0
    slow_pull_tokens: int = 0       # pulled, but the pull took longer than prefilling them would have
    bytes_moved: int = 0
    pulls: int = 0
    pulls_slower_than_recompute: int = 0
    pull_timeouts: int = 0          # pulls cancelled after ``pull_timeout_ms``: their tokens were recomputed
    routes_with_source: int = 0
    stale_routes: int = 0
    route_ms: list[float] = field(default_factory=list)


class Simulation:
    def __init__(self, variant: Variant, requests: list[TraceRequest], hashes: BlockHashes, profile: Profile,
                 engines: int, backend: Backend, event_delay_ms: float, seed: int = 0,
                 costs: StepCosts | None = None) -> None:
        """``costs``: the engines' step costs (default: the Vidur-measured H100 table at ``profile.speed``)."""
        self.v = variant
        self.p = profile
        self.requests = requests
        self.hashes = hashes
        self.backend = backend
        self.delay = event_delay_ms
        self.rng = random.Random(seed)
        self.costs = costs or StepCosts(profile.speed)
        self.engines = [Engine(i, f"{variant.slug}-e{i}", profile.gpu_blocks, profile.cpu_blocks, profile.block_tokens)
                        for i in range(engines)]
        self.factor = [self.rng.lognormvariate(0.0, profile.engine_noise) for _ in range(engines)]
        self.by_node = {e.node_id: e for e in self.engines}
        self.net = Network(engines, profile.racks, profile.nic_bytes_per_s, profile.inter_rack_bytes_per_s)
        self.pcie_free = [0.0] * engines          # host -> GPU copies (promotion of loaded blocks)
        self.offload_free = [0.0] * engines       # GPU -> host copies (offload of prefilled blocks)
        self._flows: dict[int, tuple] = {}        # flow id -> ("pull", engine, seq, source) | ("probe", a, b)
        self._flow_ids = 0
        self._net_version = 0
        self._seen = [(0, 0)] * engines           # the last load snapshot per engine (waiting, tokens) ...
        self._routed_since = [[0, 0] for _ in range(engines)]   # ... and what was routed to it since
        self._pairs = [(a, b) for a in range(engines) for b in range(engines) if a != b]
        self._next_pair = 0
        self.totals = Totals()
        self._heap: list = []
        self._order = 0
        self._macro: dict[int, tuple] = {}   # engine -> (start_ms, per_step_ms, steps, decodes, chunks)
        self._links: list[LinkSample] = []
        self._pulls: list[PullOutcome] = []
        self._next_report = 0.0
        self._alone: dict[int, float] = {}

    # -- what the router is told --------------------------------------------------------

    def _noisy(self, value: float) -> float:
        return value * self.rng.lognormvariate(0.0, self.p.probe_noise)

    def _calibrate_links(self) -> list[LinkSample]:
        """Every link measured once on the idle network before the replay (with measurement noise)."""
        return [LinkSample(self.engines[a].node_id, self.engines[b].node_id, self._noisy(
            self.net.transfer_alone(a, b, self.p.probe_bytes).measured_bytes_per_s)) for a, b in self._pairs]

    def _calibrate(self, e: Engine) -> EngineSample:
        ms = self.costs.prefill_alone_ms(8192, 0, self.p.max_batched_tokens) * self.factor[e.index]
        return EngineSample(e.node_id, self._noisy(8192 / (ms / 1000.0)))

    async def _tell_router(self, now_ms: float) -> None:
        engines: list[EngineSample] = []
        if now_ms >= self._next_report:
            for e in self.engines:
                if e.prefill_step_ms > 0:
                    engines.append(EngineSample(e.node_id, e.prefill_tokens / (e.prefill_step_ms / 1000.0)))
                    e.prefill_tokens, e.prefill_step_ms = 0, 0.0
            self._next_report = now_ms + 1000.0 * self.p.report_s
        if self._links or engines or self._pulls:
            await self.backend.report(now_ms, self._links, engines, self._pulls)
            self._links, self._pulls = [], []
        if not self.v.sharing:
            return
        for e in self.engines:
            cut = 0
            while cut < len(e.pending_events) and e.pending_events[cut][0] <= now_ms - self.delay:
                cut += 1
            if cut:
                await self.backend.publish(now_ms, e.node_id, [ev[1:] for ev in e.pending_events[:cut]])
                del e.pending_events[:cut]

    # -- events -------------------------------------------------------------------------

    def _push(self, at_ms: float, kind: int, payload) -> None:
        self._order += 1
        heapq.heappush(self._heap, (at_ms, self._order, kind, payload))

    def _advance(self, until_ms: float) -> None:
        while self._heap and self._heap[0][0] <= until_ms:
            at, _, kind, payload = heapq.heappop(self._heap)
            if kind == _STEP:
                e, version = payload
                if version == e.step_version:
                    self._end_step(e, at)
            elif kind == _LOADED:
                e, s = payload
                self._loaded(e, s, at)
            elif kind == _NET:
                if payload == self._net_version:
                    for flow_id, x in self.net.finish(at):
                        self._flow_done(self._flows.pop(flow_id), x)
                    self._net_changed()
            elif kind == _TIMEOUT:
                self._pull_timeout(payload, at)
            elif kind == _OFFLOADED:
                e, hashes = payload
                self._note(e, at, STORED, _CPU, e.cpu.insert(hashes))
                self._note(e, at, REMOVED, _CPU, e.cpu.evict(e.cpu.overflow()))
            elif kind == _SNAPSHOT:
                self._snapshot(at)
            else:
                self._probe(at)

    # -- the network --------------------------------------------------------------------

    def _net_changed(self) -> None:
        self._net_version += 1
        end = self.net.next_end_ms()
        if end < math.inf:
            self._push(end, _NET, self._net_version)

    def _start_flow(self, what: tuple, source: int, dest: int, nbytes: int, now_ms: float) -> int:
        self._flow_ids += 1
        self._flows[self._flow_ids] = what
        self.net.start(self._flow_ids, source, dest, nbytes, now_ms)
        self._net_changed()
        return self._flow_ids

    def _flow_done(self, what: tuple, x) -> None:
        if what[0] == "probe":
            _, a, b = what
            self._links.append(LinkSample(self.engines[a].node_id, self.engines[b].node_id, x.measured_bytes_per_s))
            return
        _, e, s, src = what
        t = self.totals
        self._links.append(LinkSample(src.node_id, e.node_id, x.measured_bytes_per_s))
        t.bytes_moved += x.nbytes
        t.pulls += 1
        self._promote(e, s, x.end_ms + self.p.lookup_ms, s.pulling)

    def _pull_timeout(self, flow_id: int, now_ms: float) -> None:
        """The connector gave up on the pull: the request goes on with its own tiers and recomputes the rest."""
        if not self.net.cancel(flow_id, now_ms):
            return
        _, e, s, _ = self._flows.pop(flow_id)
        self._net_changed()
        self.totals.pull_timeouts += 1
        self._promote(e, s, now_ms, 0)

    def _probe(self, now_ms: float) -> None:
        """The next link's probe starts: a real transfer of ``probe_bytes``; its sample comes when it ends."""
        a, b = self._pairs[self._next_pair % len(self._pairs)]
        self._next_pair += 1
        self._start_flow(("probe", a, b), a, b, self.p.probe_bytes, now_ms)
        nxt = now_ms + 1000.0 * self.p.reprobe_s / len(self._pairs)
        if nxt <= self.totals.last_arrival_ms:
            self._push(nxt, _PROBE, None)

    def _snapshot(self, now_ms: float) -> None:
        """The router's periodic look at every engine's queue (what a metrics scrape returns)."""
        self._seen = [e.backlog() for e in self.engines]
        self._routed_since = [[0, 0] for _ in self.engines]
        nxt = now_ms + self.p.load_report_ms
        if nxt <= self.totals.last_arrival_ms:
            self._push(nxt, _SNAPSHOT, None)

    def _note(self, e: Engine, now_ms: float, kind: int, medium: int, hashes: list[bytes]) -> None:
        if self.v.sharing:
            e.pending_events += [(now_ms, kind, medium, h) for h in hashes]

    def _make_room(self, e: Engine, now_ms: float, need: int) -> bool:
        short = need - e.free_blocks()
        if short > 0:
            self._note(e, now_ms, REMOVED, _GPU, e.gpu.evict(short))
        return e.free_blocks() >= need

    # -- the scheduler of one engine --------------------------------------------------

    def _kick(self, e: Engine, now_ms: float) -> None:
        """New work for ``e``: start a step if idle, or cut a macro decode step short."""
        if not e.busy:
            self._start_step(e, now_ms)
            return
        macro = self._macro.get(e.index)
        if macro is None:
            return
        start, per, steps, decodes, chunks = macro
        done = min(steps, int((now_ms - start) // per) + 1)
        if done < steps:
            e.step_version += 1
            self._macro[e.index] = (start, per, done, decodes, chunks)
            self._push(start + done * per, _STEP, (e, e.step_version))

    def _examine(self, e: Engine, s: Seq, now_ms: float) -> bool:
        """First look at a waiting request: start loading its KV (True: it stepped aside)."""
        p, t = self.p, self.totals
        hashes = s.hashes
        gpu_hit = e.gpu.leading(hashes)
        local = gpu_hit
        while local < len(hashes) and (hashes[local] in e.gpu or hashes[local] in e.cpu):
            local += 1
        t.gpu_tokens += min(gpu_hit * p.block_tokens, s.prompt - 1)
        t.local_cpu_tokens += min(local * p.block_tokens, s.prompt - 1) - min(gpu_hit * p.block_tokens, s.prompt - 1)
        s.examined_ms, s.local_blocks, s.gpu_blocks = now_ms, local, gpu_hit
        pulling = 0
        if s.source is not None:
            src = self.by_node[s.source.node_id]
            promised = s.source.cached_tokens // p.block_tokens
            held = src.cpu.leading(hashes)
            have = min(held, promised)    # never more than the route named
            t.routes_with_source += 1
            t.stale_routes += held < promised
            self._pulls.append(PullOutcome(src.node_id, promised, have))
            if have > local:
                pulling = s.pulling = have - local
                src.cpu.release(hashes[:have])
                flow = self._start_flow(("pull", e, s, src), src.index, e.index, pulling * p.block_bytes, now_ms)
                self._push(now_ms + p.pull_timeout_ms, _TIMEOUT, flow)
        if not pulling and local == gpu_hit:
            s.phase = Phase.READY
            return False
        s.phase = Phase.LOADING
        e.waiting.popleft()
        e.loading.add(s)
        if not pulling:
            self._promote(e, s, now_ms, 0)
        return True

    def _promote(self, e: Engine, s: Seq, ready_ms: float, pulled: int) -> None:
        """The blocks to load are in the local tiers (``pulled`` of them just arrived): copy them to the GPU."""
        p, t = self.p, self.totals
        local = s.local_blocks
        load = local - s.gpu_blocks + pulled
        start = max(ready_ms, self.pcie_free[e.index])
        end = self.pcie_free[e.index] = start + 1000.0 * load * p.block_bytes / p.promotion_bytes_per_s
        if pulled:
            tokens = min((local + pulled) * p.block_tokens, s.prompt - 1) - min(local * p.block_tokens, s.prompt - 1)
            t.peer_tokens += tokens
            recompute = self.costs.prefill_alone_ms(tokens, local * p.block_tokens, p.max_batched_tokens)
            if end - s.examined_ms >= recompute:
                t.pulls_slower_than_recompute += 1
                t.slow_pull_tokens += tokens
        s.loaded_blocks = local + pulled
        self._push(end, _LOADED, (e, s))

    def _loaded(self, e: Engine, s: Seq, now_ms: float) -> None:
        """A KV load ended: pulled blocks land in the CPU tier, and the loaded blocks in the GPU prefix cache as
        far as there is room for them (the leading ones; never more than the GPU holds: the rest is recomputed)."""
        blocks = s.hashes[: s.loaded_blocks]
        self._note(e, now_ms, STORED, _CPU, e.cpu.insert(blocks))
        self._note(e, now_ms, REMOVED, _CPU, e.cpu.evict(e.cpu.overflow()))
        present = [h for h in blocks if h in e.gpu]
        for h in present:                 # kept while room is made for the others
            e.gpu.pins[h] += 1
        self._make_room(e, now_ms, len(blocks) - len(present))
        room = max(0, e.free_blocks())
        fits = 0
        for h in blocks:
            if h not in e.gpu:
                if not room:
                    break
                room -= 1
            fits += 1
        for h in present:
            e.gpu.pins[h] -= 1
        kept = blocks[:fits]
        self._note(e, now_ms, STORED, _GPU, e.gpu.insert(kept))
        for h in kept:
            e.gpu.pins[h] += 1
        s.pinned = list(kept)
        e.loading.discard(s)
        s.phase = Phase.READY
        e.waiting.appendleft(s)
        self._kick(e, now_ms)

    def _admit(self, e: Engine, s: Seq, now_ms: float) -> bool:
        hit = e.gpu.leading(s.hashes)
        need = e.blocks_of(s.prompt + s.output) - hit
        for h in s.hashes[:hit]:
            e.gpu.pins[h] += 1
        for h in s.pinned:
            e.gpu.pins[h] -= 1
        s.pinned = s.hashes[:hit]
        if not self._make_room(e, now_ms, need):
            return False
        s.cached = min(hit * self.p.block_tokens, s.prompt - 1)
        s.private_blocks = need
        e.private_blocks += need
        s.phase = Phase.PREFILL
        s.wait_ms = now_ms - s.arrival_ms
        e.waiting.popleft()
        e.running.append(s)
        return True

    def _start_step(self, e: Engine, now_ms: float) -> None:
        p = self.p
        decodes = [s for s in e.running if s.phase is Phase.DECODE]
        budget = p.max_batched_tokens - len(decodes)
        chunks: list[tuple[Seq, int]] = []
        for s in e.running:
            if s.phase is Phase.PREFILL and budget > 0:
                c = min(budget, s.remaining_prefill)
                chunks.append((s, c))
                budget -= c
        blocked = len(e.running) >= p.max_running
        while e.waiting and budget > 0 and not blocked:
            s = e.waiting[0]
            if s.phase is Phase.WAITING and self._examine(e, s, now_ms):
                continue
            if not self._admit(e, s, now_ms):
                blocked = True   # out of KV memory: the queue waits for a sequence to finish
                break
            c = min(budget, s.remaining_prefill)
            chunks.append((s, c))
            budget -= c
        if not decodes and not chunks:
            e.busy = False
            self._macro.pop(e.index, None)
            return
        e.busy = True
        context = sum(s.prompt + s.generated for s in decodes)
        steps = 1
        if not chunks and (blocked or not e.waiting):
            steps = min(s.output - s.generated for s in decodes)
            context += len(decodes) * (steps - 1) // 2
        tokens = len(decodes) + sum(c for _, c in chunks)
        per = self.costs.step_ms(tokens, [(c, s.cached + s.computed) for s, c in chunks], context)
        per *= self.factor[e.index] * self.rng.lognormvariate(0.0, p.step_noise / math.sqrt(steps))
        if p.shared_machine:
            per *= 1.0 + p.shared_machine * (sum(x.busy for x in self.engines) - 1)
        e.step_version += 1
        self._macro[e.index] = (now_ms, per, steps, decodes, chunks)
        self._push(now_ms + steps * per, _STEP, (e, e.step_version))

    def _end_step(self, e: Engine, now_ms: float) -> None:
        t = self.totals
        _, per, steps, decodes, chunks = self._macro.pop(e.index)
        finished = []
        for s in decodes:
            s.generated += steps
            if s.generated >= s.output:
                finished.append(s)
        if chunks:
            e.prefill_tokens += sum(c for _, c in chunks)
            e.prefill_step_ms += per
        for s, c in chunks:
            s.computed += c
            if s.remaining_prefill:
                continue
            t.ttft_ms.append(now_ms - s.arrival_ms)
            t.alone_ms.append(self._alone_ms(s.prompt))
            t.wait_ms.append(s.wait_ms)
            t.last_first_token_ms = max(t.last_first_token_ms, now_ms)
            t.computed_tokens += s.computed
            s.phase, s.generated = Phase.DECODE, 1
            if self.v.sharing and s.hashes:
                new = e.gpu.insert(s.hashes)
                self._note(e, now_ms, STORED, _GPU, new)
                converted = len(s.hashes) - len(s.pinned)
                s.private_blocks -= converted
                e.private_blocks -= converted
                for h in s.hashes[len(s.pinned):]:
                    e.gpu.pins[h] += 1
                s.pinned = list(s.hashes)
                self._offload(e, s.hashes, now_ms)
            if s.generated >= s.output:
                finished.append(s)
        for s in finished:
            e.running.remove(s)
            e.private_blocks -= s.private_blocks
            for h in s.pinned:
                e.gpu.pins[h] -= 1
            e.gpu.release(s.hashes)
        self._start_step(e, now_ms)

    def _offload(self, e: Engine, hashes: list[bytes], now_ms: float) -> None:
        """A prefilled prompt's blocks are copied to the node's CPU tier (the blocks it lacks, over the engine's
        GPU-to-host link, after the copies before them); they are there, and published, when the copy ends."""
        new = sum(h not in e.cpu for h in hashes)
        start = max(now_ms, self.offload_free[e.index])
        end = start + 1000.0 * new * self.p.block_bytes / self.p.promotion_bytes_per_s
        if new:
            self.offload_free[e.index] = end
        self._push(end, _OFFLOADED, (e, list(hashes)))

    # -- the replay ---------------------------------------------------------------------

    def _alone_ms(self, prompt: int) -> float:
        ms = self._alone.get(prompt)
        if ms is None:
            ms = self._alone[prompt] = self.costs.prefill_alone_ms(prompt, 0, self.p.max_batched_tokens)
        return ms

    def _candidates(self) -> list[Candidate]:
        """The engines as the router sees them: the last snapshot of their queues plus what was routed since."""
        return [Candidate(e.node_id, e.node_id, seen[0] + since[0], seen[1] + since[1])
                for e, seen, since in zip(self.engines, self._seen, self._routed_since)]

    async def run(self) -> Totals:
        p, t = self.p, self.totals
        await self.backend.register([(e.node_id, f"10.0.{self.net.rack[e.index]}.{e.index + 10}:7100",
                                      f"rack{self.net.rack[e.index]}") for e in self.engines])
        await self.backend.report(0.0, self._calibrate_links(), [self._calibrate(e) for e in self.engines], [])
        t.first_arrival_ms = self.requests[0].arrival_ms
        t.last_arrival_ms = self.requests[-1].arrival_ms
        self._push(0.0, _SNAPSHOT, None)
        if len(self._pairs) and p.reprobe_s > 0:
            self._push(1000.0 * p.reprobe_s / len(self._pairs), _PROBE, None)
        for r in self.requests:
            self._advance(r.arrival_ms)
            await self._tell_router(r.arrival_ms)
            hashes = self.hashes.of(r) if self.v.sharing else []
            started = time.perf_counter()
            d = await self.backend.route(r.arrival_ms, self._candidates(), hashes, r.input_tokens, self.v.policy,
                                         self.v.p2p, p.kv_bytes_per_token)
            t.route_ms.append(1000.0 * (time.perf_counter() - started))
            e = self.by_node[d.engine_id]
            cached = d.source.cached_tokens if d.source else d.local_cached_tokens
            prompt = max(1, r.input_tokens)
            t.prompt_tokens += prompt
            planned = max(1, prompt - cached)
            since = self._routed_since[e.index]
            since[0] += 1
            since[1] += planned
            e.waiting.append(Seq(r.arrival_ms, prompt, max(1, r.output_tokens), hashes, d.source, planned))
            self._kick(e, r.arrival_ms)
        self._advance(math.inf)
        return t
