"""``kvmesh up``: the docker-compose.yml topology as local processes, without Docker.

Starts a :class:`kvmesh_apps.fleet.Fleet`: Redis (AOF on, in ``--workdir``, passwords
generated, no password-less user), the control plane, a tenant and ``--data-planes``
data-plane nodes with their node keys, on free loopback ports; prints their addresses and
the files holding the keys (never a secret itself), and stops everything on Ctrl-C.
Engines are not started (they need a model): the printed ``vllm serve`` line attaches
one to a data plane. ``--json`` prints the addresses as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
from pathlib import Path

from kvmesh_apps.fleet import Fleet
from tenancy.api_keys import new_key

ENGINE_HINT = (
    "vllm serve MODEL --block-size 32 --kv-transfer-config "
    "'{{\"kv_connector\":\"KvmeshConnector\",\"kv_role\":\"kv_both\",\"kv_load_failure_policy\":\"recompute\","
    "\"kv_connector_extra_config\":{{\"data_plane_address\":\"{address}\",\"api_key_file\":\"{key_file}\","
    "\"control_plane_address\":\"{cp}\",\"tenant\":\"{tenant}\",\"auto_source\":true}}}}'"
)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh up", description=__doc__.split("\n")[0])
    parser.add_argument("--data-planes", type=int, default=2)
    parser.add_argument("--workdir", default="", help="Redis data and service logs (default: a new temp dir)")
    parser.add_argument("--json", action="store_true", help="print the addresses as one JSON line")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvmesh-up-"))
    workdir.mkdir(parents=True, exist_ok=True)
    admin_key = os.environ.get("KVMESH_ADMIN_KEY") or new_key()[1]  # written to <workdir>/secrets/admin.key
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
                hint = ENGINE_HINT.format(address=address, key_file=info["node_key_files"][node],
                                          cp=info["control_plane"], tenant=info["tenant"])
                print(f"  engine:      {hint}")
            print(f"admin key      in {info['admin_key_file']}")
            print(f"redis user     {info['redis_user']}, password in {info['redis_password_file']}")
            print(f"logs           {workdir}\nCtrl-C stops everything.", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        fleet.stop()
    return 0
