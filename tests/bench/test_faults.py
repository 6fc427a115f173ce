"""The fault matrix across network namespaces (kvmesh_apps/netns.py, kvmesh_apps/bench/faults.py). Root only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from kvmesh_apps.bench.faults import BLOCK_BYTES, block_ok, pattern
from kvmesh_apps.netns import Network

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not all(map(shutil.which, ("ip", "tc", "iptables"))),
                                reason="network namespaces need root, iproute2 and iptables")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_every_pulled_byte_is_checked():
    h = bytes(range(32))
    block = pattern(h).copy()
    assert block_ok(block, h)
    block[BLOCK_BYTES // 2] ^= 1  # negative control: one flipped bit fails the block
    assert not block_ok(block, h)
    assert not block_ok(np.zeros(BLOCK_BYTES, dtype=np.uint8), h)


@needs_root
def test_hosts_reach_each_other_and_a_drop_partitions_them():
    server = "import socket\ns=socket.socket();s.bind(('0.0.0.0',7100));s.listen(8)\nwhile True: s.accept()[0].close()"
    client = "import socket,sys\ntry:\n socket.create_connection((sys.argv[1],7100),timeout=1).close();print('ok')\n" \
             "except OSError: print('cut')"
    before = _namespaces()
    with Network() as net:
        a, b = net.add_host("a"), net.add_host("b")
        proc = subprocess.Popen([*net.prefix(a), sys.executable, "-c", server])
        try:
            def reach() -> str:
                return subprocess.run([*net.prefix(b), sys.executable, "-c", client, a.ip], capture_output=True,
                                      text=True, timeout=30).stdout.strip()

            for _ in range(50):
                if reach() == "ok":
                    break
                time.sleep(0.1)
            assert reach() == "ok"  # positive control
            net.drop(a, "INPUT", ["-s", b.ip, "-p", "tcp", "--dport", "7100"])
            assert reach() == "cut"
            net.undrop(a)
            assert reach() == "ok"
            assert net.tx_bytes(b) > 0
        finally:
            proc.kill()
            proc.wait()
    assert _namespaces() == before, "close() removes every namespace it made"


_SINK = "import socket\ns=socket.socket();s.bind(('0.0.0.0',7101));s.listen(1);print('up',flush=True)\n" \
        "c=s.accept()[0]\nwhile c.recv(1<<20): pass\nc.sendall(b'k');c.close()"
_SEND = "import socket,sys,time\nt0=time.monotonic();c=socket.create_connection((sys.argv[1],7101),timeout=60)\n" \
        "t1=time.monotonic();c.sendall(bytes(4<<20));c.shutdown(socket.SHUT_WR);c.recv(1)\n" \
        "print(round((t1-t0)*1000,1),round((time.monotonic()-t1)*1000,1))"


@needs_root
def test_delay_is_a_long_link_not_a_slow_sender():
    """20 ms each way between two hosts is a 40 ms RTT over which a fresh connection moves 4 MiB at link
    speed. Negative control (measured): with the delay on the sender's egress (NFQUEUE on OUTPUT, the
    earlier netdelay rule) TCP Small Queues counted the held packets against the socket and BBR paced
    to the few that got out: ~2.5 Mbit/s, ~13 s for 4 MiB."""
    with Network() as net:
        a, b = net.add_host("a"), net.add_host("b")
        sink = subprocess.Popen([*net.prefix(a), sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
        try:
            assert sink.stdout.readline().strip() == "up"
            for host in (a, b):
                net.delay(host, 20)
            out = subprocess.run([*net.prefix(b), sys.executable, "-c", _SEND, a.ip], capture_output=True,
                                 text=True, timeout=120)
            connect_ms, bulk_ms = map(float, out.stdout.split())
        finally:
            sink.kill()
            sink.wait()
    assert connect_ms >= 38, f"a connect is one RTT: {connect_ms} ms"
    assert bulk_ms < 5_000, f"4 MiB over 40 ms RTT took {bulk_ms} ms"


@needs_root
@pytest.mark.slow
def test_fault_matrix_subset():
    """A short subset of `kvmesh bench faults` on one redis-server (the whole matrix, with the Redis Cluster
    failover, is the benchmark)."""
    cases = "baseline,latency_20ms_each_way,nixl_partition_grpc_up,freeze_source_dp,node_restart"
    out = subprocess.run([sys.executable, "-m", "kvmesh_apps.cli", "bench", "faults", "--json", "--single-redis",
                          "--cases", cases],
                         capture_output=True, text=True, timeout=600)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["cases"]) == set(cases.split(",")), out.stderr[-3000:]
    assert result["failed"] == 0, json.dumps(result["cases"], indent=1)
    proof = result["nixl_over_tcp"]
    assert proof["n1_veth_tx_bytes"] >= proof["pulled_bytes"] > 0, "the pulled bytes crossed n1's veth (TCP)"
