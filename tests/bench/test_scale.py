"""`kvmesh bench scale`: run tiny end to end (one Valkey and a 3-shard cluster with replicas, real control planes),
its figures measured, a failover that never recovers named in one line within its bound, and the user's errors."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest
import redis

from kvmesh import errors
from kvmesh_apps.bench.scale import Backend, failover, fleet, primary_for

TINY = ["--blocks", "4096", "--checkpoints", "1024", "--nodes", "24", "--prompt-blocks", "64", "--namespaces", "3",
        "--lookups", "20", "--failover-timeout-s", "30"]


def kvmesh(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmesh_apps.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_scale_bench_measures_both_backends_and_a_failover():
    out = kvmesh("bench", "scale", "--json", *TINY)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert list(result["sizes"]) == ["1024", "4096"]
    for backend in ("redis", "cluster"):
        sizes = result["backends"][backend]["sizes"]
        assert [s["blocks"] for s in sizes.values()] == [1024, 4096]
        for s in sizes.values():
            # measured, not constant: latencies are positive and ordered, memory grew with the map
            assert 0 < s["lookup_p50_ms"] <= s["lookup_p99_ms"] and 0 < s["direct_lookup_p50_ms"] <= s["direct_lookup_p99_ms"]
            # a block is at least its 32-byte hash and 8 holders' 2-byte entries; far more is a measuring error
            assert 48 <= s["redis_map_bytes_per_block"] <= s["redis_bytes_per_block"] < 2000, s
        assert sizes["4096"]["redis_used_memory_bytes"] > sizes["1024"]["redis_used_memory_bytes"]
    assert result["sizes"] == result["backends"]["redis"]["sizes"]
    assert result["redis_bytes_per_block"] == result["sizes"]["4096"]["redis_bytes_per_block"]
    for backend in result["backends"].values():  # one node left and its entries were swept
        assert backend["gc_swept_slots"] == 1 and backend["gc_sweep_s"] > 0
    cluster = result["backends"]["cluster"]
    assert cluster["shards"] == 3 and cluster["replica_node_used_memory_bytes"] > 0
    # the cluster's failure detection alone takes its node timeout (2 s); recovery is bounded by the run's wait
    assert 1.0 < result["failover_recovery_s"] == cluster["failover_recovery_s"] < 30
    # the control plane answers from its in-memory replica: the shard's outage may not reach its lookups at all
    assert 0 < cluster["failover_recovery_rpc_s"] < 30
    # the in-memory replica, resynced cold from the whole map, answers every lookup (each checked in the run)
    assert result["replica_blocks"] == 4096 and result["replica_resync_s"] > 0
    assert 0 < result["replica_bytes_per_block"] and 0 < result["replica_lookup_p50_ms"] <= result["replica_lookup_p99_ms"]
    assert result["sizes_backend"] == "redis"
    last = cluster["sizes"]["4096"]  # a replica resynced from the cluster's three shards holds the same map
    assert last["replica_blocks"] == 4096 and last["replica_resync_s"] > 0 and last["replica_bytes_per_block"] > 0


def test_cluster_only_builds_the_map_on_the_cluster_alone():
    out = kvmesh("bench", "scale", "--json", "--cluster-only", *TINY)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert list(result["backends"]) == ["cluster"] and result["sizes_backend"] == "cluster"
    assert result["sizes"] == result["backends"]["cluster"]["sizes"] and list(result["sizes"]) == ["1024", "4096"]
    assert 1.0 < result["failover_recovery_s"] < 30 and result["replica_blocks"] == 4096


async def _failover_without_replica(backend: Backend, timeout_s: float) -> tuple[float, BaseException | None]:
    async with fleet(backend, namespaces=3, nodes=8, holders=4, prompt_blocks=16, concurrency=4) as (writer, lookups):
        await writer.store_until(6, window=6)
        backend.wait_replicas_synced(30)
        victim = primary_for(backend, await lookups.block_map.blocks_key(lookups.layout.namespace(0)))
        for node in backend.replicas():
            with redis.Redis(port=node.port) as r:
                if r.info("replication")["master_port"] == victim.port:
                    node.proc.kill()  # the shard's only replica: nothing can take over
        t0 = time.perf_counter()
        try:
            await failover(backend, lookups, 0, timeout_s)
        except errors.Unavailable as exc:
            return time.perf_counter() - t0, exc
        return time.perf_counter() - t0, None


def test_failover_that_never_recovers_fails_in_one_line_within_its_bound(tmp_path):
    """The shard's primary and its only replica are gone: the measurement gives up after its bound (plus at most
    one attempt's own timeout) with one line naming the primary, instead of hanging or reporting a figure.
    (The positive control, a shard whose replica takes over, is the end-to-end test above.)"""
    backend = Backend(tmp_path, shards=3).start()
    try:
        elapsed, exc = asyncio.run(_failover_without_replica(backend, timeout_s=4.0))
    finally:
        backend.stop()
    assert exc is not None, "lookups answered although the shard had no primary and no replica"
    assert "did not answer correctly within 4 s" in str(exc) and "\n" not in str(exc), exc
    assert 4.0 <= elapsed < 12.0


@pytest.mark.parametrize("args, env, words", [
    (["--blocks", "0"], {}, ["--blocks"]),
    (["--blocks", "100", "--checkpoints", "50,200"], {}, ["--checkpoints"]),
    (["--shards", "2"], {}, ["--shards"]),
    (["--cluster-only", "--shards", "0"], {}, ["--cluster-only"]),
    (["--holders", "9", "--nodes", "8"], {}, ["--holders"]),
    (["--blocks", "100"], {"KVMESH_REDIS_SERVER": "/nonexistent/valkey-server"}, ["KVMESH_REDIS_SERVER"]),
])
def test_user_errors_fail_in_one_line(args, env, words):
    out = kvmesh("bench", "scale", *args, env=env, timeout=60)
    lines = out.stderr.splitlines()
    assert out.returncode != 0 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("kvmesh bench scale: error: ") and all(w in lines[0] for w in words), lines[0]
