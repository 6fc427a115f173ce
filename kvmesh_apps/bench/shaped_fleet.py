"""A fleet over shaped links (root: Linux network namespaces), shared by ``kvmesh bench routing`` and ``kvmesh bench
prefetch``.

Redis and the control plane run in this namespace (on the switch's address); each node ``nK`` is a network
namespace (:class:`kvmesh_apps.netns.Network`) holding its data plane and, unless told otherwise, one vLLM CPU
engine with the kvmesh connector. Pulls cross the kernel's TCP stack between namespaces (NIXL over UCX's TCP
transport on the veths), shaped by ``tc``: an HTB class per destination on each node's egress at ``mbit(a, b)``,
and ``delay_ms[node]`` added to a node's link (``tc netem`` where the kernel has it, else
:mod:`kvmesh_apps.netdelay`). Each data plane serves its metrics on its node's address (:meth:`metrics_url`).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from engine_connector.config import KV_LAYOUT
from kvmesh.channels import channel
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh.v1 import tenant_admin_pb2 as ta_pb, tenant_admin_pb2_grpc as ta_grpc
from kvmesh_apps.engine_host import BLOCK_SIZE, EngineProcess
from kvmesh_apps.kv_shape import KVShape
from kvmesh_apps.netns import Network
from kvmesh_apps.procs import ServiceProcess
from kvmesh_apps.redis_server import RedisServer
from tenancy.api_keys import new_key

DP_PORT = 7000


class ShapedFleet:
    """Redis and the control plane here; a data plane (and an engine) per network namespace; shaped links."""

    def __init__(self, workdir: Path, nodes: int, mbit: Callable[[str, str], float], max_model_len: int,
                 block_bytes: int, *, delay_ms: dict[str, float] | None = None, tenant: str = "routing",
                 capacity: str = "512MiB", engines: dict[str, dict[str, Any]] | None = None) -> None:
        """``engines``: per node, overrides of its engine's spec (``max_num_seqs``, ``connector`` settings);
        default: every node gets an engine with ``max_num_seqs`` 1."""
        self.workdir = workdir
        self.block_bytes = block_bytes
        self.names = [f"n{i + 1}" for i in range(nodes)]
        self.mbit = mbit
        self.delay_ms = delay_ms or {}
        self.tenant = tenant
        self.capacity = capacity
        self.engine_specs = engines if engines is not None else {name: {} for name in self.names}
        self.net = Network()
        self.redis = RedisServer(workdir / "redis")
        self.admin_key = new_key()[1]
        self.shm_dir = Path(tempfile.mkdtemp(prefix="kvmesh-shaped-", dir="/dev/shm"))
        self.cp: ServiceProcess | None = None
        self.dps: dict[str, ServiceProcess] = {}
        self.engines: dict[str, EngineProcess] = {}
        self.key_files: dict[str, Path] = {}
        self.max_model_len = max_model_len

    def _shape(self) -> None:
        """HTB on each node's egress: one class per destination at that pair's rate."""
        for a in self.names:
            host = self.net.hosts[a]
            self.net.run(host, "tc", "qdisc", "replace", "dev", "kv0", "root", "handle", "1:", "htb", "r2q", "100")
            for j, b in enumerate(self.names):
                if a == b:
                    continue
                cls = f"1:{10 + j}"
                rate = f"{self.mbit(a, b)}mbit"
                self.net.run(host, "tc", "class", "add", "dev", "kv0", "parent", "1:", "classid", cls, "htb", "rate",
                             rate, "ceil", rate, "burst", "64kb")
                self.net.run(host, "tc", "filter", "add", "dev", "kv0", "parent", "1:", "protocol", "ip", "prio", "1",
                             "u32", "match", "ip", "dst", f"{self.net.hosts[b].ip}/32", "flowid", cls)
            if self.delay_ms.get(a):
                self.net.delay(host, self.delay_ms[a])

    def start(self, model: Path) -> None:
        self.net.open()
        for name in self.names:
            self.net.add_host(name)
        self._shape()
        self.redis.start()
        self.cp = ServiceProcess(["control-plane", "--listen", f"{self.net.host_ip}:0", "--redis-url", self.redis.url],
                                 env={"KVMESH_CP_ADMIN_KEY": self.admin_key},
                                 log_path=self.workdir / "control-plane.log").start()
        keys = asyncio.run(self._provision())
        secrets = self.workdir / "secrets"
        secrets.mkdir(mode=0o700, exist_ok=True)
        for name, key in keys.items():
            path = self.key_files[name] = secrets / f"{name}.key"
            path.write_text(key)
            path.chmod(0o600)
        for name in self.names:
            host = self.net.hosts[name]
            self.dps[name] = ServiceProcess(
                ["data-plane", "--node-id", name, "--listen", f"{host.ip}:{DP_PORT}", "--control-plane-address",
                 self.cp.address, "--shm-dir", str(self.shm_dir), "--capacity-bytes", self.capacity, "--block-bytes",
                 str(self.block_bytes), "--block-tokens", str(BLOCK_SIZE), "--no-lock-memory",
                 "--api-key-file", str(self.key_files[name]), "--metrics-listen", f"{host.ip}:0"],
                env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": "kv0"}, prefix=Network.prefix(host),
                log_path=self.workdir / f"dp-{name}.log").start()
        for name, spec in self.engine_specs.items():
            self.engines[name] = self._engine(name, model, **spec)
        for engine in self.engines.values():
            engine.wait_ready(600.0)

    def _engine(self, name: str, model: Path, max_num_seqs: int = 1, connector: dict | None = None) -> EngineProcess:
        host = self.net.hosts[name]
        work = self.workdir / "vllm"
        (work / "rpc").mkdir(parents=True, exist_ok=True)
        settings = {"data_plane_address": f"{host.ip}:{DP_PORT}", "api_key_file": str(self.key_files[name]),
                    "control_plane_address": self.cp.address, "tenant": self.tenant, "weight_version": "random-init",
                    **(connector or {})}
        spec = {"model": str(model), "connector": settings, "max_model_len": self.max_model_len,
                "max_num_seqs": max_num_seqs}
        env = {"VLLM_CACHE_ROOT": str(work / "cache"), "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"),
               "VLLM_RPC_BASE_PATH": str(work / "rpc"), "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "UCX_TLS": "tcp", "UCX_NET_DEVICES": "kv0"}
        return EngineProcess(name, spec, env, self.workdir / f"engine-{name}.log",
                             prefix=Network.prefix(host)).start()

    def stop_engine(self, name: str) -> None:
        engine = self.engines.pop(name, None)
        if engine is not None:
            engine.stop()

    async def _provision(self) -> dict[str, str]:
        async with channel(self.cp.address, self.admin_key) as ch:
            admin = ta_grpc.TenantAdminStub(ch)
            await admin.CreateTenant(ta_pb.CreateTenantRequest(tenant_id=self.tenant))
            return {name: (await admin.IssueKey(ta_pb.IssueKeyRequest(role=ta_pb.ROLE_NODE, node_id=name))).secret
                    for name in self.names}

    async def scheduler_key(self) -> str:
        """A new scheduler key of the fleet's tenant (Route with prefetch orders, as a router holds)."""
        async with channel(self.cp.address, self.admin_key) as ch:
            reply = await ta_grpc.TenantAdminStub(ch).IssueKey(ta_pb.IssueKeyRequest(
                role=ta_pb.ROLE_SCHEDULER, tenant_id=self.tenant))
        return reply.secret

    def namespace(self, model: Path, shape: KVShape) -> Namespace:
        """The namespace the fleet's engines save ``model``'s blocks in."""
        return Namespace(self.tenant, str(model), "random-init", CacheConfig(
            block_size=BLOCK_SIZE, kv_dtype=shape.dtype, kv_layout=KV_LAYOUT, parallel_layout="tp1-pp1",
            hash_seed=os.environ.get("PYTHONHASHSEED", ""))).validate()

    def metrics_url(self, name: str) -> str:
        return self.dps[name].metrics_url

    def source(self, name: str, request_id: str) -> dict:
        return {"remote_kv_source": {"kv_request_id": request_id, "remote_host": self.net.hosts[name].ip,
                                     "remote_port": DP_PORT, "remote_node_id": name}}

    def stop(self) -> None:
        for engine in self.engines.values():
            engine.stop()
        for dp in self.dps.values():
            dp.stop()
        if self.cp is not None:
            self.cp.stop()
        self.redis.stop()
        self.net.close()
        shutil.rmtree(self.shm_dir, ignore_errors=True)
