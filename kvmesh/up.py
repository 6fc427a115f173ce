"""``kvmesh up``: the docker-compose.yml topology as local processes, without Docker.

Starts a Redis (AOF on, in ``--workdir``), the control plane and ``--data-planes``
data-plane nodes (when the data plane is installed) on free loopback ports,
prints their addresses and the admin key, and stops everything on Ctrl-C.
Engines are not started (they need a model): the printed ``vllm serve`` line
attaches one to a data plane. ``--json`` prints the addresses as one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

from kvmesh.procs import ServiceProcess
from kvmesh.redis_server import RedisServer
from tenancy.api_keys import new_key

ENGINE_HINT = (
    "vllm serve MODEL --block-size 32 --kv-transfer-config "
    "'{{\"kv_connector\":\"KvmeshConnector\",\"kv_connector_module_path\":\"engine_connector.connector\","
    "\"kv_role\":\"kv_both\",\"kv_connector_extra_config\":{{\"store_path\":\"/dev/shm/kvmesh-engine-{node}\"}}}}'"
)


class Fleet:
    """The started processes, stopped in reverse order."""

    def __init__(self, workdir: Path, data_planes: int, admin_key: str) -> None:
        self.workdir = workdir
        self.admin_key = admin_key
        self.redis = RedisServer(workdir / "redis")
        tmpfs = "/dev/shm" if Path("/dev/shm").is_dir() else None
        self.shm_dir = Path(tempfile.mkdtemp(prefix="kvmesh-up-", dir=tmpfs))
        self.control_plane: ServiceProcess | None = None
        self.data_planes: dict[str, ServiceProcess] = {}
        self._wanted_data_planes = data_planes

    def start(self) -> "Fleet":
        try:
            self.redis.start()
            self.control_plane = ServiceProcess(
                ["control-plane", "--listen", "127.0.0.1:0", "--redis-url", self.redis.url],
                env={"KVMESH_CP_ADMIN_KEY": self.admin_key}, log_path=self.workdir / "control-plane.log").start()
            if self._wanted_data_planes and importlib.util.find_spec("data_plane.server") is not None:
                for i in range(1, self._wanted_data_planes + 1):
                    node = f"dp{i}"
                    self.data_planes[node] = ServiceProcess(
                        ["data-plane", "--node-id", node, "--listen", "127.0.0.1:0", "--control-plane-address",
                         self.control_plane.address, "--shm-dir", str(self.shm_dir), "--capacity-bytes", "256MiB",
                         "--no-lock-memory"],
                        env={"UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")},
                        log_path=self.workdir / f"{node}.log").start()
        except BaseException:
            self.stop()
            raise
        return self

    def addresses(self) -> dict:
        return {
            "redis": self.redis.url,
            "control_plane": self.control_plane.address if self.control_plane else "",
            "data_planes": {node: p.address for node, p in self.data_planes.items()},
            "admin_key": self.admin_key,
            "workdir": str(self.workdir),
        }

    def stop(self) -> None:
        for proc in reversed(list(self.data_planes.values())):
            proc.stop()
        if self.control_plane is not None:
            self.control_plane.stop()
        self.redis.stop()
        shutil.rmtree(self.shm_dir, ignore_errors=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh up", description=__doc__.split("\n")[0])
    parser.add_argument("--data-planes", type=int, default=2)
    parser.add_argument("--workdir", default="", help="Redis data and service logs (default: a new temp dir)")
    parser.add_argument("--json", action="store_true", help="print the addresses as one JSON line")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvmesh-up-"))
    workdir.mkdir(parents=True, exist_ok=True)
    admin_key = os.environ.get("KVMESH_ADMIN_KEY") or new_key()[1]
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    fleet = Fleet(workdir, args.data_planes, admin_key).start()
    try:
        info = fleet.addresses()
        if args.json:
            print(json.dumps(info), flush=True)
        else:
            print(f"redis          {info['redis']}")
            print(f"control plane  {info['control_plane']}")
            for node, address in info["data_planes"].items():
                print(f"data plane     {node} {address}")
                print(f"  engine:      {ENGINE_HINT.format(node=node)}")
            print(f"admin key      {admin_key}")
            print(f"logs           {workdir}\nCtrl-C stops everything.", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        fleet.stop()
    return 0
