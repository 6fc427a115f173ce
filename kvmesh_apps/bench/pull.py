"""``kvmesh bench pull``: NIXL peer-pull throughput between data-plane processes on loopback.

Per case (64 x 2 MiB, 1,024 x 64 KiB) it starts two sources and a destination
node, stores the blocks on a source through the shared region, and times
``Pull`` RPCs end to end from this process: the source lookup, one batched
NIXL transfer of every block, the CRC-32C check of every block and the commit
are all inside the timed window. The default source WRITEs the blocks the
grant covers into the destination's reserved slots (the gated byte path,
``pull_*``); the other serves one-sided READs (``serve_peer_reads``,
``*_ungated``); rounds alternate between them, and ``gating_cost_fraction_*``
is the gated median time over the ungated one, minus 1 (``gating_cost_fraction``:
the worse case). ``transfer_gbps_*`` is the gated send alone (the call in
which the source WRITEs the blocks its Lookup pinned, from the node's own
timing). ``acquire_ms_*``: the destination's local ``Acquire`` of all the blocks a
gated pull brought (what an engine asks before reading them; it checks each
block's CRC-32C); ``pull_then_acquire_ms_*`` the gated pull and that Acquire
(per round, summed), ``pull_pinned_ms_*`` a gated Pull asked to pin the prefix
itself (``lease_ms``: the engine's path, one call, the pulled blocks checked
once), in rounds alternating with the others. ``memcpy_gbps`` is a
single-thread copy of the same bytes in this process, measured between the
pull rounds. ``raw_nixl_gbps_*`` is the floor the transport sets: the same
blocks WRITten by NIXL alone between two other processes, no kvmesh code
(:mod:`kvmesh_apps.bench.raw_nixl`), with the data planes' ``--lanes``, after
the case's pulls; ``pull_vs_raw_nixl_*`` is the gated pull over it.

``idle_cpu_fraction``: CPU time (user + system, from /proc) of the busier of
the two data-plane processes over ``--idle-seconds`` without traffic, after the
2 MiB case's pulls (connections established), as a fraction of one core.
``coalesced_bytes_ratio``: 16 simultaneous Pulls of one 2,000-token prefix on
one node (64 KiB blocks): bytes the pulls moved from the source / one prefix's
bytes (1.0 when they share one transfer). The last line with ``--json`` is one
JSON object.
"""

from __future__ import annotations

import base64
import asyncio
import json
import os
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
from crc32c import crc32c

from kvmesh.command_line import Parser, positive_float, positive_int
from kvmesh.namespace import CacheConfig, Namespace
from tenancy.api_keys import new_key
from tenancy.grants import Grant, GrantSigner
from tenancy.peer_proof import NodeIdentity, encode_public_key

from data_plane.client import DataPlaneClient, SharedTier
from kvmesh_apps.bench.raw_nixl import raw_nixl_gbps
from kvmesh_apps.dp_process import DataPlaneProcess
from kvmesh_apps.procs import cpu_seconds

CASES = (("2mib", 2 << 20, 64), ("64kib", 64 << 10, 1024))
SMALL_CASES = (("2mib", 2 << 20, 8), ("64kib", 64 << 10, 128))  # --small: the same fields, in seconds
NS = Namespace("bench", "bench-model", "r0", CacheConfig(block_size=32))
PREFIX_TOKENS = 2_000  # the coalescing case: one prompt prefix, full blocks only (as vLLM stores them)
CONCURRENT_PULLS = 16


async def _idle_cpu(pids: list[int], seconds: float) -> float:
    """The largest CPU fraction (of one core) any of ``pids`` used over ``seconds`` of no traffic."""
    before = [cpu_seconds(p) for p in pids]
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    wall = time.monotonic() - t0
    return max((cpu_seconds(p) - b) / wall for p, b in zip(pids, before))


async def _coalesced(sc: DataPlaneClient, stier: SharedTier, dc: DataPlaneClient, src, grant: bytes,
                     block_bytes: int) -> float:
    """Bytes moved by CONCURRENT_PULLS simultaneous pulls of one prefix / that prefix's bytes."""
    n = PREFIX_TOKENS // NS.cache_config.block_size
    hashes = await _fill_source(sc, stier, n, first=False)
    results = await asyncio.gather(*(dc.pull(NS, hashes, src.node_id, src.address, grant=grant)
                                     for _ in range(CONCURRENT_PULLS)))
    if any(r.pulled + r.already_local != n for r in results):
        raise RuntimeError(f"coalescing: some pulls did not get all {n} blocks: {[r.pulled for r in results]}")
    return sum(r.bytes_pulled for r in results) / (n * block_bytes)


class _Memcpy:
    """Single-thread copies of ``nbytes`` between two pre-faulted buffers (like the pinned tiers)."""

    def __init__(self, nbytes: int) -> None:
        self.src = np.full(nbytes, 7, dtype=np.uint8)
        self.dst = np.full(nbytes, 1, dtype=np.uint8)

    def gbps(self) -> float:
        t0 = time.perf_counter()
        np.copyto(self.dst, self.src)
        return self.src.nbytes / (time.perf_counter() - t0) / 1e9


async def _fill_source(client: DataPlaneClient, tier: SharedTier, n: int, first: bool) -> list[bytes]:
    """Commits n blocks under fresh hashes (first time: writes distinct bytes into every slot; every time, each
    block's index into its first 8 bytes and last byte: the tier is larger than n, so the slots move)."""
    hashes = [os.urandom(32) for _ in range(n)]
    slots = await client.reserve(NS, hashes)
    if -1 in slots:
        raise RuntimeError("the source refused a reservation")
    for i, slot in enumerate(slots):
        view = tier.slot(slot)
        if first:
            view[:] = i % 251
        view[-1] = i % 251
        view[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
    await client.commit(NS, hashes)
    return hashes


async def _case(name: str, block_bytes: int, n: int, rounds: int, shm_dir: Path, log, idle_s: float,
                lanes: int) -> dict:
    # Grants as a control plane would sign them, with a key made for this run.
    signer = GrantSigner.generate()
    flags = dict(listen="127.0.0.1:0", shm_dir=shm_dir, block_bytes=block_bytes, capacity_bytes=block_bytes * n,
                 transfer_lanes=lanes,
                 max_hashes_per_request=max(n, 4096), grant_public_key=base64.b64encode(signer.public_key).decode())
    # Two sources in one run, pulled from alternately: the default one WRITEs what the grant covers (gated),
    # the other hands out its NIXL metadata and is READ one-sided (serve_peer_reads, ungated).
    # a source twice the pull: one peer pins at most half a node's slots of a tenant's blocks (data_plane.tier)
    served = {**flags, "capacity_bytes": 2 * block_bytes * n}
    sources = {"gated": DataPlaneProcess(f"bench-src-{name}", {**served, "api_key": new_key()[1]}),
               "ungated": DataPlaneProcess(f"bench-srcr-{name}", {**served, "api_key": new_key()[1]},
                                           env={"KVMESH_DP_SERVE_PEER_READS": "true"})}
    dst = DataPlaneProcess(f"bench-dst-{name}", {**flags, "api_key": new_key()[1]})
    src = sources["gated"]
    me = NodeIdentity()  # this process, as a peer, for the lookup latency

    def sign(consumer: str, public_key: bytes, source: str) -> bytes:
        return signer.sign(Grant(NS.tenant, NS.fingerprint, consumer, encode_public_key(public_key), source,
                                 int(time.time() * 1000) + 3_600_000))

    try:
        async with DataPlaneClient(src.address, key=src.api_key) as sc, \
                DataPlaneClient(sources["ungated"].address, key=sources["ungated"].api_key) as uc, \
                DataPlaneClient(dst.address, key=dst.api_key) as dc, \
                DataPlaneClient(src.address, peer_proof=lambda g, m: me.proof(g, m, src.node_id)) as peer:
            clients = {"gated": sc, "ungated": uc}
            tiers = {mode: SharedTier.open(await c.describe_tier()) for mode, c in clients.items()}
            description = await dc.describe_tier()
            dtier = SharedTier.open(description)
            grants = {mode: sign(dst.node_id, description.peer_public_key, source.node_id)
                      for mode, source in sources.items()}
            peer_grant = sign("bench-peer", me.public_key, src.node_id)
            wall: dict[str, list[float]] = {"gated": [], "ungated": [], "pinned": []}
            transfer: list[float] = []
            acquire: list[float] = []
            memcpy = []
            copier = _Memcpy(n * block_bytes)
            modes = ("gated", "ungated", "pinned")
            for r in range(rounds + 1):  # round 0 warms up (handshake, registration caches)
                for mode in modes[r % 3:] + modes[:r % 3]:  # each mode first in turn
                    by = "ungated" if mode == "ungated" else "gated"  # the pinned pull is a gated one
                    source = sources[by]
                    hashes = await _fill_source(clients[by], tiers[by], n, first=r == 0)
                    t0 = time.perf_counter()
                    result = await dc.pull(NS, hashes, source.node_id, source.address, grant=grants[by],
                                           lease_ms=60_000 if mode == "pinned" else 0)
                    elapsed = time.perf_counter() - t0
                    if result.pulled != n or (mode == "pinned" and len(result.slots) != n):
                        raise RuntimeError(f"pull {name} ({mode}): only {result.pulled} of {n} blocks arrived, "
                                           f"{len(result.slots)} pinned")
                    if result.lease_id:
                        await dc.release(result.lease_id)
                    if r:
                        wall[mode].append(elapsed)
                        if mode == "gated":
                            transfer.append(result.transfer_ms / 1000)
                            t0 = time.perf_counter()  # the engine's Acquire of the pulled prefix
                            slots, lease = await dc.acquire(NS, hashes)
                            acquire.append(time.perf_counter() - t0)
                            await dc.release(lease)
                            if len(slots) != n:
                                raise RuntimeError(f"acquire {name}: {len(slots)} of {n} pulled blocks")
                    log(f"{name} round {r} {mode}: {n * block_bytes / elapsed / 1e9:.2f} GB/s end to end, "
                        f"transfer {result.transfer_ms:.1f} ms, lookup {result.lookup_ms:.2f} ms")
                memcpy.append(copier.gbps())
            slots, lease = await dc.acquire(NS, hashes[-1:])
            last = dtier.slot(slots[0])
            intact = int.from_bytes(bytes(last[:8]), "little") == n - 1 and last[-1] == (n - 1) % 251
            del last  # views must be gone before the tier is unmapped
            await dc.release(lease)
            if not intact:
                raise RuntimeError(f"pull {name}: the last block's bytes differ from the source's")
            out = {}
            if name == "64kib":
                out["coalesced_bytes_ratio"] = await _coalesced(sc, tiers["gated"], dc, src, grants["gated"],
                                                                block_bytes)
                log(f"coalescing: {CONCURRENT_PULLS} pulls of one prefix moved "
                    f"{out['coalesced_bytes_ratio']:.2f}x its bytes")
            lookups = []
            if name == "2mib":
                for _ in range(200):
                    t0 = time.perf_counter()
                    answer, _ = await peer.lookup(NS, hashes[:1], grant=peer_grant)  # as a pulling peer does
                    lookups.append((time.perf_counter() - t0) * 1000)
                    await peer.release(answer.lease_id, grant=peer_grant)
                log(f"idle: measuring both nodes' CPU over {idle_s:.0f}s without traffic")
                out["idle_cpu_fraction"] = await _idle_cpu([src.proc.pid, dst.proc.pid], idle_s)
            del copier
            for tier in tiers.values():
                tier.close()
            dtier.close()
    finally:
        for source in sources.values():
            source.stop()
        dst.stop()
    nbytes = n * block_bytes
    raw = await asyncio.to_thread(raw_nixl_gbps, block_bytes, n, rounds, lanes)
    log(f"{name} raw NIXL (no kvmesh code, {lanes} lane(s)): {raw:.2f} GB/s")
    gated, ungated = statistics.median(wall["gated"]), statistics.median(wall["ungated"])
    out |= {
        f"pull_gbps_{name}": nbytes / gated / 1e9,
        f"raw_nixl_gbps_{name}": raw,
        f"pull_vs_raw_nixl_{name}": nbytes / gated / 1e9 / raw,
        f"transfer_gbps_{name}": nbytes / statistics.median(transfer) / 1e9,
        f"memcpy_gbps_{name}": statistics.median(memcpy[1:]),
        f"pull_ms_{name}": gated * 1000,
        f"pull_ms_{name}_ungated": ungated * 1000,
        f"pull_gbps_{name}_ungated": nbytes / ungated / 1e9,
        f"gating_cost_fraction_{name}": gated / ungated - 1,
        f"acquire_ms_{name}": statistics.median(acquire) * 1000,
        f"pull_then_acquire_ms_{name}": statistics.median(map(sum, zip(wall["gated"], acquire))) * 1000,
        f"pull_pinned_ms_{name}": statistics.median(wall["pinned"]) * 1000,
    }
    if lookups:
        out["peer_lookup_p50_ms"] = statistics.median(lookups)
        out["peer_lookup_p99_ms"] = sorted(lookups)[int(len(lookups) * 0.99) - 1]
    return out


def _gbps(fn, nbytes: int) -> float:
    buf = np.full(nbytes, 3, dtype=np.uint8)
    t0 = time.perf_counter()
    fn(buf)
    return nbytes / (time.perf_counter() - t0) / 1e9


async def _run(rounds: int, shm_dir: Path, log, idle_s: float, lanes: int, cases=CASES) -> dict:
    results: dict = {"rounds": rounds, "transfer_lanes": lanes,
                     "verify": "crc32c of every block, inside the timed window"}
    for name, block_bytes, n in cases:
        results.update(await _case(name, block_bytes, n, rounds, shm_dir, log, idle_s, lanes))
    results["memcpy_gbps"] = results.pop("memcpy_gbps_2mib")
    results["ratio_2mib"] = results["pull_gbps_2mib"] / results["memcpy_gbps"]
    results["ratio_2mib_transfer_only"] = results["transfer_gbps_2mib"] / results["memcpy_gbps"]
    results["ratio_64kib"] = results["pull_gbps_64kib"] / results.pop("memcpy_gbps_64kib")
    results["gating_cost_fraction"] = max(results["gating_cost_fraction_2mib"],
                                          results["gating_cost_fraction_64kib"])
    results["crc32_gbps"] = _gbps(zlib.crc32, 128 << 20)  # zlib's, for comparison
    results["crc32c_gbps"] = _gbps(crc32c, 128 << 20)  # the one pulls verify with
    return results


def main(argv: list[str]) -> int:
    parser = Parser(prog="kvmesh bench pull", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    parser.add_argument("--rounds", type=positive_int, default=5, help="timed pulls per case (after one warm-up)")
    parser.add_argument("--idle-seconds", type=positive_float, default=10.0,
                        help="how long to measure the idle nodes' CPU (idle_cpu_fraction)")
    parser.add_argument("--lanes", type=positive_int, default=1,
                        help="the data planes' transfer_lanes (and the raw NIXL transfer's)")
    parser.add_argument("--small", action="store_true", help="8 x 2 MiB and 128 x 64 KiB blocks (a quick check)")
    args = parser.parse_args(argv)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-", dir="/dev/shm") as shm_dir:
        results = asyncio.run(_run(args.rounds, Path(shm_dir), lambda msg: print(msg, flush=True),
                                   args.idle_seconds, args.lanes, SMALL_CASES if args.small else CASES))
    for key, value in results.items():
        if not args.json:
            print(f"{key:28} {value:.3f}" if isinstance(value, float) else f"{key:28} {value}")
    if args.json:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()}))
    return 0
