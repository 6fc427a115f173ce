"""A peer that stops answering holds at most its share of a node's transfer threads, and no transfer waits for a
thread past its own bound: real NIXL agents (UCX over tcp), two of them in a child process that is SIGSTOPped
while this process reads from them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from data_plane.transfer import NotPosted, TransferFailed

from tests.data_plane.helpers import nixl_pair

pytestmark = pytest.mark.nixl

BLOCK = 64 << 10
SLOTS = 16
STUCK_S = 20.0  # bound of the reads the frozen peers hold

_FROZEN_PEERS = """
import asyncio, json, pathlib, sys
from data_plane.shm import SharedRegion
from data_plane.transfer import NixlTransport

async def main(where, block, slots):
    held, out = [], []
    for name in ("f1", "f2"):
        region = SharedRegion(pathlib.Path(where) / f"{name}.tier", block, slots, owner=True)
        transport = NixlTransport(name, region, progress_wait_ms=10)
        await transport.ready(60.0)
        held.append((transport, region))
        out.append({"metadata": transport.metadata().hex(), "base": region.base_addr})
    print("agents", json.dumps(out), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


@pytest.fixture
def frozen_peers(shm_dir, monkeypatch):
    """Two agents in a child process: yields ``(pid, [(metadata, region base address), ...])``."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # as nixl_pair's
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    child = subprocess.Popen([sys.executable, "-c", _FROZEN_PEERS, str(shm_dir), str(BLOCK), str(SLOTS)],
                             stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        line = ""
        while line is not None and not line.startswith("agents "):  # NIXL logs to stdout too
            line = child.stdout.readline() or None
        assert line, "the child process building the agents exited"
        agents = json.loads(line.removeprefix("agents "))
        yield child.pid, [(bytes.fromhex(a["metadata"]), a["base"]) for a in agents]
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait(30)


async def test_a_frozen_peer_holds_its_share_of_the_threads_and_no_transfer_waits_past_its_bound(
        shm_dir, monkeypatch, frozen_peers):
    async with nixl_pair(shm_dir, monkeypatch, "h", BLOCK, SLOTS) as (src, dst, (src_region, dst_region)):
        pid, agents = frozen_peers
        peers = [src.add_peer(metadata) for metadata, _ in agents]
        dst_peer = src.add_peer(dst.metadata())

        def read(i: int, slot: int, timeout_s: float):
            local = [src_region.base_addr + src_region.offset(slot)]
            return src.read(peers[i], local, [agents[i][1] + slot * BLOCK], BLOCK, timeout_s)

        async def write(slot: int, timeout_s: float) -> float:
            t0 = time.monotonic()
            await src.write(dst_peer, [src_region.offset(slot)], [dst_region.base_addr + dst_region.offset(slot)],
                            BLOCK, timeout_s)
            return time.monotonic() - t0

        for i in range(2):  # control: both answer while running
            await read(i, 0, 30.0)
        src_region.slot(1)[:] = 3
        assert await write(1, 30.0) < 5 and np.all(dst_region.slot(1) == 3)

        os.kill(pid, signal.SIGSTOP)
        stuck = [asyncio.ensure_future(read(0, 1 + k % 8, STUCK_S)) for k in range(8)]
        await asyncio.sleep(0.5)
        assert not any(t.done() for t in stuck)
        # the frozen peer holds half the threads: a healthy peer's transfer still finds one
        src_region.slot(2)[:] = 5
        assert await write(2, 10.0) < 3.0, "a frozen peer's reads held every transfer thread"
        assert np.all(dst_region.slot(2) == 5)
        # a transfer behind the frozen peer's share fails at its own bound
        t0 = time.monotonic()
        with pytest.raises(TransferFailed, match="timed out") as behind:
            await read(0, 9, 1.0)
        assert time.monotonic() - t0 < 3.0 and isinstance(behind.value, NotPosted)

        # a second frozen peer takes the other half: a transfer no thread starts by its deadline fails then
        stuck += [asyncio.ensure_future(read(1, 1 + k % 8, STUCK_S)) for k in range(8)]
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        with pytest.raises(TransferFailed, match="timed out") as queued:
            await write(3, 1.5)
        assert time.monotonic() - t0 < 3.5, "a transfer waited for a thread past its bound"
        assert isinstance(queued.value, NotPosted) and not queued.value.may_still_write

        os.kill(pid, signal.SIGCONT)
        await asyncio.wait_for(asyncio.gather(*stuck, return_exceptions=True), STUCK_S + 10)
        src_region.slot(4)[:] = 7  # control: the threads are free again, and the healthy peer's endpoint was kept
        assert await write(4, 30.0) < 5 and np.all(dst_region.slot(4) == 7)
