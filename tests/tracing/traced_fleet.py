"""What the tracing tests share: a two-node fleet (mutual TLS) whose processes export their spans to files, dp1
holding an 8-block prefix as if its engine had computed it, and the stand-in engine (connector_client.py) run in a
child process that owns its TracerProvider."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from kvmesh.hashing import BlockHasher
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh_apps.fleet import Fleet

from data_plane.client import DataPlaneClient, SharedTier
from engine_connector.config import KV_LAYOUT

BS = 32
BLOCK_BYTES = 4096
CLIENT = Path(__file__).with_name("connector_client.py")
REPO = Path(__file__).resolve().parents[2]


@dataclass
class TracedFleet:
    fleet: Fleet
    trace_dir: Path
    ns: Namespace
    hashes: list[bytes]  # the prefix dp1 holds

    def run_client(self, args: dict, trace_file: str, service_name: str) -> dict:
        """connector_client.py with ``args`` (dp2's connector config and the prefix's hashes added); its JSON."""
        args = {"connector": self.fleet.connector_config("dp2"), "hashes": [h.hex() for h in self.hashes], **args}
        env = {**os.environ, "KVMESH_TRACE_EXPORTER": "file", "KVMESH_TRACE_FILE": str(self.trace_dir / trace_file),
               "OTEL_SERVICE_NAME": service_name}
        out = subprocess.run([sys.executable, str(CLIENT), json.dumps(args)], capture_output=True, text=True,
                             env=env, cwd=REPO, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    def spans(self) -> list[dict]:
        """Every span every process wrote (complete once the fleet stopped: SimpleSpanProcessor)."""
        return [json.loads(line) for path in sorted(self.trace_dir.glob("*.jsonl"))
                for line in path.read_text().splitlines()]


@contextmanager
def traced_fleet(tmp_path_factory, admin_key: str) -> Iterator[TracedFleet]:
    """The fleet with dp1 holding the prefix; stopped on exit."""
    trace_dir = tmp_path_factory.mktemp("traces")
    fleet = Fleet(tmp_path_factory.mktemp("fleet"), 2, admin_key, tenant="acme", block_bytes=BLOCK_BYTES,
                  block_tokens=BS, capacity=f"{64 * BLOCK_BYTES}", trace_dir=trace_dir).start()
    try:
        ns = Namespace("acme", "tiny", "rev1", CacheConfig(block_size=BS, kv_dtype="float32",
                                                           kv_layout=KV_LAYOUT)).validate()
        hashes = BlockHasher().block_hashes(list(range(8 * BS)), BS)
        asyncio.run(_seed(fleet, ns, hashes))
        yield TracedFleet(fleet, trace_dir, ns, hashes)
    finally:
        fleet.stop()


async def _seed(fleet: Fleet, ns: Namespace, hashes: list[bytes]) -> None:
    async with DataPlaneClient(fleet.data_planes["dp1"].address, key=fleet.node_keys["dp1"],
                               tls=fleet.client_tls("engine-dp1")) as client:
        tier = SharedTier.open(await client.describe_tier())
        for slot in await client.reserve(ns, hashes):
            tier.slot(slot)[:] = np.uint8(7)
        tier.close()
        await client.commit(ns, hashes)
