"""The black-box judge (tests/security/blackbox_probe.py) against a real `kvmesh up` fleet: with dp1's key and
certificate only, every RPC of the control plane, the tenant admin API and the data planes is tried against tenant
``victim`` (dp2 only), with positive controls, plus malformed input, idle connections, many streams and made-up
names. Every probe must hold. (The huge-request and fault probes run with ``python -m
tests.security.blackbox_probe``: they freeze the fleet's processes and move hundreds of MiB.)"""

from __future__ import annotations

import pytest

from tests.deploy.up_fleet import start_up, stop_all_ups
from tests.security.blackbox_probe import Judge

pytestmark = [pytest.mark.slow, pytest.mark.nixl]


async def test_one_node_key_gets_nothing_of_another_tenant_and_bounded_resources(tmp_path):
    started = []
    try:
        _, info = start_up(tmp_path / "up", "--block-bytes", "4096", "--capacity", "1MiB", started=started)
        rows = await Judge(info).run(heavy=False)
    finally:
        stop_all_ups(started)
    failed = [f"[{r.area}] {r.what}: expected {r.expected}; got {r.got}" for r in rows if not r.ok]
    assert len(rows) > 60 and not failed, "\n".join(failed)
