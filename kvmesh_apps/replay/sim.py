"""The replay in virtual time: engines (:mod:`engine`), the network (:mod:`network`), a router (:mod:`backends`).

One :class:`Simulation` replays a window of the trace for one variant (policy,
P2P on or off, or no sharing). Arrivals are routed in order; between arrivals
engine steps and KV loads complete as events. A routed pull reads the source's
CPU tier when the destination's scheduler first examines the request, not when
it was routed: a source that evicted meanwhile serves fewer blocks (a stale
route). Tier changes reach the router ``event_delay_ms`` late; the router is
told only noisy probes (every link at start and every ``reprobe_s``), the
engines' measured prefill throughput (every ``report_s``) and the pulls it
observes.

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
_STEP, _LOADED = 1, 2
_PROBE_BYTES = 1 << 30


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
        self.engines = [Engine(i, f"{variant.slug}-e{i}", profile.gpu_kv_blocks, profile.cpu_tier_blocks,
                               profile.block_tokens) for i in range(engines)]
        self.factor = [self.rng.lognormvariate(0.0, profile.engine_noise) for _ in range(engines)]
        self.by_node = {e.node_id: e for e in self.engines}
        self.net = Network(engines, profile.racks, profile.nic_bytes_per_s, profile.inter_rack_bytes_per_s)
        self.pcie_free = [0.0] * engines
        self.totals = Totals()
        self._heap: list = []
        self._order = 0
        self._macro: dict[int, tuple] = {}   # engine -> (start_ms, per_step_ms, steps, decodes, chunks)
        self._links: list[LinkSample] = []
        self._pulls: list[PullOutcome] = []
        self._next_probe = 0.0
        self._next_report = 0.0
        self._alone: dict[int, float] = {}

    # -- what the router is told --------------------------------------------------------

    def _noisy(self, value: float) -> float:
        return value * self.rng.lognormvariate(0.0, self.p.probe_noise)

    def _probe_links(self) -> list[LinkSample]:
        out = []
        for a in self.engines:
            for b in self.engines:
                if a is not b:
                    _, bps = self.net.path(a.index, b.index)
                    out.append(LinkSample(a.node_id, b.node_id, self._noisy(bps)))
        return out

    def _calibrate(self, e: Engine) -> EngineSample:
        ms = self.costs.prefill_alone_ms(8192, 0, self.p.max_batched_tokens) * self.factor[e.index]
        return EngineSample(e.node_id, self._noisy(8192 / (ms / 1000.0)))

    async def _tell_router(self, now_ms: float) -> None:
        engines: list[EngineSample] = []
        if now_ms >= self._next_probe:
            self._links += self._probe_links()
            self._next_probe = now_ms + 1000.0 * self.p.reprobe_s
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
            else:
                e, s = payload
                self._loaded(e, s, at)

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
        ready, pulled = now_ms, 0
        if s.source is not None:
            src = self.by_node[s.source.node_id]
            promised = s.source.cached_tokens // p.block_tokens
            have = src.cpu.leading(hashes)
            t.routes_with_source += 1
            t.stale_routes += have < promised
            self._pulls.append(PullOutcome(src.node_id, promised, min(have, promised)))
            if have > local:
                pulled = have - local
                src.cpu.release(hashes[:have])
                x = self.net.transfer(src.index, e.index, pulled * p.block_bytes, now_ms + p.lookup_ms)
                self._links.append(LinkSample(src.node_id, e.node_id, self._noisy(x.measured_bytes_per_s)))
                ready = x.end_ms
                t.bytes_moved += x.nbytes
                t.pulls += 1
        load = local - gpu_hit + pulled
        if not load:
            s.phase = Phase.READY
            return False
        start = max(ready, self.pcie_free[e.index])
        end = self.pcie_free[e.index] = start + 1000.0 * load * p.block_bytes / p.promotion_bytes_per_s
        if pulled:
            tokens = min((local + pulled) * p.block_tokens, s.prompt - 1) - min(local * p.block_tokens, s.prompt - 1)
            t.peer_tokens += tokens
            recompute = self.costs.prefill_alone_ms(tokens, local * p.block_tokens, p.max_batched_tokens)
            if end - now_ms >= recompute:
                t.pulls_slower_than_recompute += 1
                t.slow_pull_tokens += tokens
        s.loaded_blocks = local + pulled
        s.phase = Phase.LOADING
        e.waiting.popleft()
        e.loading.add(s)
        self._push(end, _LOADED, (e, s))
        return True

    def _loaded(self, e: Engine, s: Seq, now_ms: float) -> None:
        """A KV load ended: pulled blocks land in the CPU tier, every loaded block in the GPU prefix cache."""
        blocks = s.hashes[: s.loaded_blocks]
        self._note(e, now_ms, STORED, _CPU, e.cpu.insert(blocks))
        self._note(e, now_ms, REMOVED, _CPU, e.cpu.evict(e.cpu.overflow()))
        self._note(e, now_ms, STORED, _GPU, e.gpu.insert(blocks))
        for h in blocks:
            e.gpu.pins[h] += 1
        s.pinned = list(blocks)
        self._make_room(e, now_ms, 0)
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
                self._note(e, now_ms, STORED, _CPU, e.cpu.insert(s.hashes))
                self._note(e, now_ms, REMOVED, _CPU, e.cpu.evict(e.cpu.overflow()))
            if s.generated >= s.output:
                finished.append(s)
        for s in finished:
            e.running.remove(s)
            e.private_blocks -= s.private_blocks
            for h in s.pinned:
                e.gpu.pins[h] -= 1
            e.gpu.release(s.hashes)
        self._start_step(e, now_ms)

    # -- the replay ---------------------------------------------------------------------

    def _alone_ms(self, prompt: int) -> float:
        ms = self._alone.get(prompt)
        if ms is None:
            ms = self._alone[prompt] = self.costs.prefill_alone_ms(prompt, 0, self.p.max_batched_tokens)
        return ms

    def _candidates(self) -> list[Candidate]:
        out = []
        for e in self.engines:
            waiting, tokens = e.backlog()
            out.append(Candidate(e.node_id, e.node_id, waiting, tokens))
        return out

    async def run(self) -> Totals:
        p, t = self.p, self.totals
        await self.backend.register([(e.node_id, f"10.0.{p.rack_of(e.index, len(self.engines))}.{e.index + 10}:7100")
                                     for e in self.engines])
        await self.backend.report(0.0, self._probe_links(), [self._calibrate(e) for e in self.engines], [])
        self._next_probe = 1000.0 * p.reprobe_s
        t.first_arrival_ms = self.requests[0].arrival_ms
        t.last_arrival_ms = self.requests[-1].arrival_ms
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
            e.waiting.append(Seq(r.arrival_ms, prompt, max(1, r.output_tokens), hashes, d.source,
                                 max(1, prompt - cached)))
            self._kick(e, r.arrival_ms)
        self._advance(math.inf)
        return t
