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
