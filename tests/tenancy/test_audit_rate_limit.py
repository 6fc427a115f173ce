"""Denied and unauthenticated calls cannot flush the audit stream: their entries are rate-limited, and what is
not written one by one is counted and written as a summary (never dropped silently). Real control plane and
Redis. Before the limit, 200 unauthenticated Pings wrote 200 entries in 0.6 s: about 5 minutes of that rolls the
whole stream (~100,000 entries) over, admin actions included."""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import pytest

from kvmesh.v1 import common_pb2, tenant_admin_pb2 as tpb

FLOOD = 200


async def test_a_flood_of_denied_calls_writes_a_bounded_number_of_entries_and_counts_the_rest(
        fleet, control_plane):
    await fleet.tenant("tenant-a")  # an admin action before the flood
    anonymous = fleet.cp(None)
    t0 = time.monotonic()
    for _ in range(FLOOD):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await anonymous.Ping(common_pb2.PingRequest())
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # each is still refused
    elapsed = time.monotonic() - t0
    await fleet.tenant("tenant-b")  # and one after it

    entries = (await fleet.admin.ListAudit(tpb.ListAuditRequest(limit=10_000))).entries
    one_by_one = [e for e in entries if e.action == "denied:Ping"]
    denials = control_plane.denials
    assert len(one_by_one) <= denials._burst + denials._per_s * elapsed + 1, \
        f"{len(one_by_one)} entries for {FLOOD} denials in {elapsed:.2f}s"
    assert one_by_one, "positive control: the first denials are audited one by one"
    assert {"tenant-a", "tenant-b"} <= {e.target for e in entries if e.action == "CreateTenant"}

    await denials.flush()  # what the window would write within window_s (and a stop writes at once)
    entries = (await fleet.admin.ListAudit(tpb.ListAuditRequest(limit=10_000))).entries
    summaries = [e for e in entries if e.action == "suppressed:Ping"]
    assert len(summaries) == 1 and summaries[0].outcome == "SUPPRESSED"
    counted = int(re.match(r"(\d+) more denied:Ping entries", summaries[0].detail).group(1))
    assert len(one_by_one) + counted == FLOOD, "every denial is written or counted"
    print(f"{FLOOD} unauthenticated Pings in {elapsed:.2f}s: {len(one_by_one)} entries, 1 summary of {counted}")


async def test_suppressed_counts_are_written_once_the_window_ends(fleet, control_plane, monkeypatch):
    """Nobody needs to call flush: the window's own timer writes the count."""
    denials = control_plane.denials
    monkeypatch.setattr(denials, "_window_s", 0.5)
    denials._tokens = 0  # the bucket is empty: the next denial is counted, not written
    with pytest.raises(grpc.aio.AioRpcError):
        await fleet.cp(None).Ping(common_pb2.PingRequest())
    for _ in range(50):
        entries = (await fleet.admin.ListAudit(tpb.ListAuditRequest(limit=100))).entries
        if any(e.action == "suppressed:Ping" and e.detail.startswith("1 more") for e in entries):
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the suppressed denial was never written")


async def test_a_flush_with_the_store_frozen_waits_one_timeout_not_one_per_pair(fleet, control_plane, redis_server):
    """Found in review: the summaries were written one (actor, action) pair after another, each waiting out the
    store's 2 s timeout while Redis was frozen: a control plane stopping after a flood of denials from many actors
    (up to 1,024 pairs) waited ~34 minutes. After the first failed write the rest are logged. Control: once Redis
    answers, the next summaries are written."""
    import signal

    from tenancy.model import AuditEntry

    denials = control_plane.denials
    denials._tokens = 0
    denials._per_s = 0.0  # every denial below is counted, not written one by one

    async def deny(actors: range) -> None:
        for i in actors:
            await denials(AuditEntry(int(time.time() * 1000), f"actor-{i}", "denied:Ping", "-", "UNAUTHENTICATED"))

    await deny(range(20))  # 20 pairs
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        await denials.flush()
        took = time.monotonic() - started
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    assert took < 6.0, f"a flush of 20 pairs took {took:.1f} s with the store frozen (one timeout: ~2 s)"
    await deny(range(100, 103))
    await denials.flush()
    entries = (await fleet.admin.ListAudit(tpb.ListAuditRequest(limit=1_000))).entries
    assert {f"actor-{i}" for i in range(100, 103)} <= {e.actor for e in entries if e.action == "suppressed:Ping"}
