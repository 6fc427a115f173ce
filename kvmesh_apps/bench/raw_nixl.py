"""The NIXL floor of ``kvmesh bench pull``: the same bytes moved by NIXL alone between two processes.

Two processes, no data plane: each maps a region of ``n`` blocks (shared memory, pre-faulted, as a node's CPU
tier) and registers it with its own NIXL agent (UCX backend, built as the data plane builds it: same progress
wait); the source loads the destination's metadata and WRITEs all ``n`` blocks into it, as a gated pull's source
does, with the descriptors the data plane would use (one per run of consecutive slots on both sides, here one)
split over ``lanes`` transfer requests posted at once from ``lanes`` threads (the backend gets one UCX worker per
lane). No gRPC, grant, lease, checksum or commit: what the gated pull adds is the difference.
"""

from __future__ import annotations

import mmap
import multiprocessing
import statistics
import threading
import time

import numpy as np

from data_plane.transfer import lane_descriptors, new_nixl_agent

PROGRESS_WAIT_MS = 100  # the data plane's default nixl_progress_wait_ms


def _region(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    mapping = mmap.mmap(-1, nbytes, mmap.MAP_SHARED)
    array = np.frombuffer(mapping, dtype=np.uint8)
    array[::mmap.PAGESIZE] = 1  # faulted in before any transfer
    return mapping, array


def _agent(name: str, array: np.ndarray, lanes: int):
    agent = new_nixl_agent(name, PROGRESS_WAIT_MS, workers=lanes)
    agent.register_memory([(array.ctypes.data, array.nbytes, 0, "")], "DRAM")
    return agent


def _destination(conn, nbytes: int, lanes: int) -> None:
    _, array = _region(nbytes)
    agent = _agent("raw-dst", array, lanes)
    conn.send((agent.get_agent_metadata(), array.ctypes.data))
    conn.recv()  # the source's results went out: done
    del agent


def _write(agent, peer: str, local: np.ndarray, remote: np.ndarray) -> None:
    handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, "DRAM"),
                                   agent.get_xfer_descs(remote, "DRAM"), peer)
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    handle.release()
    if state != "DONE":
        raise RuntimeError(f"raw NIXL WRITE failed ({state})")


def _source(conn, block_bytes: int, n: int, rounds: int, lanes: int) -> None:
    nbytes = block_bytes * n
    parent, child = multiprocessing.get_context("spawn").Pipe()
    dst = multiprocessing.get_context("spawn").Process(target=_destination, args=(child, nbytes, lanes))
    dst.start()
    try:
        metadata, remote_base = parent.recv()
        _, array = _region(nbytes)
        agent = _agent("raw-src", array, lanes)
        peer = agent.add_remote_agent(metadata)
        offsets = np.arange(n, dtype=np.uint64) * np.uint64(block_bytes)
        pairs = lane_descriptors(offsets + np.uint64(array.ctypes.data), offsets + np.uint64(remote_base),
                                 block_bytes, lanes)
        seconds = []
        for _ in range(rounds + 1):  # the first warms up (connection, registration caches)
            t0 = time.perf_counter()
            threads = [threading.Thread(target=_write, args=(agent, peer, local, remote)) for local, remote in pairs]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            seconds.append(time.perf_counter() - t0)
        conn.send(seconds[1:])
        parent.send(None)
    finally:
        dst.join(30)
        if dst.is_alive():
            dst.kill()


def raw_nixl_gbps(block_bytes: int, n: int, rounds: int, lanes: int) -> float:
    """GB/s of ``n`` blocks of ``block_bytes`` WRITten by NIXL alone from one process into another (median of
    ``rounds`` after a warm-up)."""
    parent, child = multiprocessing.get_context("spawn").Pipe()
    src = multiprocessing.get_context("spawn").Process(target=_source, args=(child, block_bytes, n, rounds, lanes))
    src.start()
    try:
        if not parent.poll(120):
            raise RuntimeError("the raw NIXL transfer did not finish within 120 s")
        seconds = parent.recv()
    finally:
        src.join(30)
        if src.is_alive():
            src.kill()
    return block_bytes * n / statistics.median(seconds) / 1e9
