"""A malicious source, as a process of its own: ``python -m tests.security.rogue_source --log FILE``.

It plays a registered node (its key is the test's to register) that consumers pull from, with a real NIXL agent
(UCX, as its environment says) and a real gRPC server speaking the data-plane protocol, and it lies:

* every Lookup answers HIT for every hash (pinned under a lease it makes up);
* every send (a Lookup with landing addresses) fails with UNAVAILABLE, as a WRITE that may still land would;
* every Release answers ``settled=false`` under the same agent name: it never proves anything over. And before
  answering, it WRITEs a marker block (every byte 0xEE) into the landing addresses of that lease, with the
  consumer's metadata from the handshake: the late write held landing slots exist for.

It prints ``rogue listening on <address>``; every late write is a JSON line in the log file: the time, the lease
and the outcome (``DONE``, or what NIXL raised).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import time
import uuid

import grpc
import numpy as np

from kvmesh.grpc_server import ServiceBinding, start_server
from kvmesh.v1 import data_plane_pb2 as pb, data_plane_pb2_grpc as pb_grpc

MARKER = 0xEE


class RogueSource(pb_grpc.DataPlaneServicer):
    def __init__(self, node_id: str, block_bytes: int, log_path: str) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self._node_id = node_id
        self._block_bytes = block_bytes
        self._log_path = log_path
        self._agent = nixl_agent(f"{node_id}-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=["UCX"]))
        self._marker = np.full(block_bytes, MARKER, dtype=np.uint8)
        self._reg = self._agent.register_memory([(self._marker.ctypes.data, block_bytes, 0, "")], "DRAM")
        self._consumer = ""  # the consumer's agent, loaded from its handshake
        self._landing: dict[str, list[int]] = {}  # lease -> the landing addresses its send named

    async def ExchangeAgentMetadata(self, request, context):
        if request.agent_metadata:
            try:
                name = self._agent.add_remote_agent(request.agent_metadata)
                self._consumer = name.decode() if isinstance(name, bytes) else name
            except Exception:  # noqa: BLE001 - already loaded: keep the one there
                pass
        return pb.ExchangeAgentMetadataResponse(node_id=self._node_id, agent_name=self._agent.name,
                                                agent_metadata=b"", block_bytes=self._block_bytes)

    async def Lookup(self, request, context):
        n = len(request.block_hashes)
        if request.landing_addrs:  # the send
            self._landing[request.lease_id] = list(request.landing_addrs)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the WRITE failed and may still land")
        return pb.LookupResponse(
            statuses=[pb.BLOCK_STATUS_HIT] * n, block_bytes=self._block_bytes, lease_id=secrets.token_hex(16),
            addrs=[4096 * (i + 1) for i in range(n)],
            checksums=[1] * n)

    async def Release(self, request, context):
        addrs = self._landing.get(request.lease_id)
        if addrs and self._consumer:
            outcome = await asyncio.to_thread(self._late_write, addrs)
            with open(self._log_path, "a") as log:
                log.write(json.dumps({"t": time.time(), "lease": request.lease_id, "outcome": outcome}) + "\n")
        return pb.ReleaseResponse(settled=False, agent_name=self._agent.name)

    def _late_write(self, addrs: list[int]) -> str:
        agent = self._agent
        local = [(self._marker.ctypes.data, self._block_bytes, 0)] * len(addrs)
        remote = [(a, self._block_bytes, 0) for a in addrs]
        try:
            handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, "DRAM"),
                                           agent.get_xfer_descs(remote, "DRAM"), self._consumer)
            state = agent.transfer(handle)
            deadline = time.monotonic() + 5
            while state == "PROC" and time.monotonic() < deadline:
                state = agent.check_xfer_state(handle)
            handle.release()
            return state
        except Exception as exc:  # noqa: BLE001 - what NIXL says is the outcome
            return f"{type(exc).__name__}: {exc}"


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--node-id", default="node-b")
    parser.add_argument("--block-bytes", type=int, required=True)
    parser.add_argument("--log", required=True)
    args = parser.parse_args()
    servicer = RogueSource(args.node_id, args.block_bytes, args.log)
    server = await start_server("127.0.0.1:0", [ServiceBinding(servicer, pb_grpc.add_DataPlaneServicer_to_server,
                                                               "kvmesh.v1.DataPlane")])
    print(f"rogue listening on 127.0.0.1:{server.port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    asyncio.run(main())
