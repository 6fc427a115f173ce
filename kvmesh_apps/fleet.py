"""A local kvmesh fleet as processes on loopback: Redis, the control plane, data planes, vLLM engines.

Shared by ``kvmesh up``, ``kvmesh demo`` and the end-to-end tests. :meth:`Fleet.start` starts
Redis (AOF on, in ``workdir``; no password-less user: the control plane and its ACL-only user get
fresh passwords) and the control plane with a bootstrap admin key, creates the
tenant, issues one node key per data plane through the TenantAdmin API and starts the data
planes with their keys (they publish tier changes and fetch pull grants with them). Engines
(:mod:`kvmesh_apps.engine_host`) are started on demand, attached to a node's data plane.

Secrets (Redis passwords, the admin key, node keys) go to files in ``<workdir>/secrets`` (0700
directory, 0600 files) and reach processes by file name: never on a command line, in the
environment or in a log.

With ``trace_dir`` every process writes its spans to ``<trace_dir>/<process>.jsonl``
(``KVMESH_TRACE_EXPORTER=file``, see kvmesh.tracing).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvmesh.channels import channel
from kvmesh_apps.engine_host import EngineProcess
from kvmesh_apps.procs import ServiceProcess
from kvmesh_apps.redis_server import RedisServer, fleet_users, write_secret
from kvmesh.v1 import tenant_admin_pb2 as ta_pb, tenant_admin_pb2_grpc as ta_grpc
from tenancy.grants import GrantSigner

DEFAULT_BLOCK_BYTES = 2 * 1024 * 1024


class Fleet:
    """The started processes, stopped in reverse order. Not thread-safe."""

    def __init__(self, workdir: Path, data_planes: int, admin_key: str, *, tenant: str = "demo",
                 block_bytes: int = DEFAULT_BLOCK_BYTES, block_tokens: int = 0, capacity: str = "256MiB",
                 trace_dir: Path | None = None) -> None:
        self.workdir = Path(workdir)
        self.admin_key = admin_key
        self.tenant = tenant
        self.block_bytes = block_bytes
        self.block_tokens = block_tokens
        self.capacity = capacity
        self.trace_dir = trace_dir
        self.secrets_dir = self.workdir / "secrets"
        self.redis_users = fleet_users(self.secrets_dir)
        self.redis = RedisServer(self.workdir / "redis", users=list(self.redis_users.values()))
        tmpfs = "/dev/shm" if Path("/dev/shm").is_dir() else None
        self.shm_dir = Path(tempfile.mkdtemp(prefix="kvmesh-fleet-", dir=tmpfs))
        self.control_plane: ServiceProcess | None = None
        self.data_planes: dict[str, ServiceProcess] = {}
        self.node_keys: dict[str, str] = {}
        self.engines: dict[str, EngineProcess] = {}
        self._wanted_data_planes = data_planes

    def _grant_key_file(self) -> Path:
        """The control plane's grant-signing key, generated on first start (mode 0600) and kept in the workdir."""
        path = self.workdir / "grant-signing-key.pem"
        if not path.exists():
            GrantSigner.create_file(path)
        return path

    # ---- lifecycle ----

    def start(self) -> "Fleet":
        try:
            self.redis.start()
            cp_user, acl_user = self.redis_users["control_plane"], self.redis_users["acl"]
            self.control_plane = ServiceProcess(
                ["control-plane", "--listen", "127.0.0.1:0", "--redis-url", self.redis.url,
                 "--redis-username", cp_user.name, "--redis-password-file", str(cp_user.password_file),
                 "--redis-acl-username", acl_user.name, "--redis-acl-password-file", str(acl_user.password_file),
                 "--admin-key-file", str(self.admin_key_file), "--grant-key-file", str(self._grant_key_file())],
                env=self._trace_env("control-plane"), log_path=self.workdir / "control-plane.log").start()
            if self._wanted_data_planes and importlib.util.find_spec("data_plane.server") is not None:
                nodes = [f"dp{i}" for i in range(1, self._wanted_data_planes + 1)]
                self.node_keys = asyncio.run(self._provision(nodes))
                for node, key in self.node_keys.items():
                    write_secret(self.node_key_file(node), key)
                for node in nodes:
                    self.data_planes[node] = self._start_data_plane(node)
        except BaseException:
            self.stop()
            raise
        return self

    async def _provision(self, nodes: list[str]) -> dict[str, str]:
        """Create the tenant and issue a node key per data plane (admin API)."""
        async with channel(self.control_plane.address, self.admin_key) as ch:
            admin = ta_grpc.TenantAdminStub(ch)
            await admin.CreateTenant(ta_pb.CreateTenantRequest(tenant_id=self.tenant,
                                                               display_name="the local fleet's tenant"))
            keys = {}
            for node in nodes:
                reply = await admin.IssueKey(ta_pb.IssueKeyRequest(role=ta_pb.ROLE_NODE, node_id=node,
                                                                   description=f"local fleet node {node}"))
                keys[node] = reply.secret
            return keys

    def _start_data_plane(self, node: str) -> ServiceProcess:
        args = ["data-plane", "--node-id", node, "--listen", "127.0.0.1:0", "--control-plane-address",
                self.control_plane.address, "--shm-dir", str(self.shm_dir), "--capacity-bytes", self.capacity,
                "--block-bytes", str(self.block_bytes), "--block-tokens", str(self.block_tokens),
                "--no-lock-memory"]
        args += ["--api-key-file", str(self.node_key_file(node))]
        env = {"UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"), **self._trace_env(f"data-plane-{node}")}
        return ServiceProcess(args, env=env, log_path=self.workdir / f"{node}.log").start()

    def stop(self) -> None:
        for engine in reversed(list(self.engines.values())):
            engine.stop()
        for proc in reversed(list(self.data_planes.values())):
            proc.stop()
        if self.control_plane is not None:
            self.control_plane.stop()
        self.redis.stop()
        shutil.rmtree(self.shm_dir, ignore_errors=True)

    def __enter__(self) -> "Fleet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- engines ----

    def connector_config(self, node: str, **overrides: Any) -> dict[str, Any]:
        """``kv_connector_extra_config`` for an engine co-located with ``node``.

        The key goes by file: vLLM logs its engine arguments, extra config included.
        """
        return {"data_plane_address": self.data_planes[node].address, "api_key_file": str(self.node_key_file(node)),
                "control_plane_address": self.control_plane.address, "tenant": self.tenant,
                "weight_version": "random-init", **overrides}

    def start_engine(self, name: str, model: Path, node: str | None, **spec: Any) -> EngineProcess:
        """Launch engine ``name`` on ``model`` attached to ``node`` (None: no connector); returns at once.

        ``spec`` may set ``connector`` (extra-config overrides), ``enable_prefix_caching``,
        ``max_model_len``. Call :meth:`EngineProcess.wait_ready` before using it. Each engine
        takes ~3 GiB and ~40 s to start on 2 cores: keep two alive at most.
        """
        overrides = spec.pop("connector", {}) or {}
        full = {"model": str(model), "connector": self.connector_config(node, **overrides) if node else None,
                **spec}
        work = self.workdir / "vllm"
        (work / "rpc").mkdir(parents=True, exist_ok=True)
        env = {
            "VLLM_CACHE_ROOT": str(work / "cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"),
            "VLLM_RPC_BASE_PATH": str(work / "rpc"),
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
            **self._trace_env(f"engine-{name}"),
        }
        engine = EngineProcess(name, full, env, self.workdir / f"engine-{name}.log").start()
        self.engines[name] = engine
        return engine

    def stop_engine(self, name: str) -> None:
        engine = self.engines.pop(name, None)
        if engine is not None:
            engine.stop()

    # ---- helpers ----

    @property
    def admin_key_file(self) -> Path:
        path = self.secrets_dir / "admin.key"
        if not path.exists():
            write_secret(path, self.admin_key)
        return path

    def node_key_file(self, node: str) -> Path:
        return self.secrets_dir / f"{node}.key"

    def _trace_env(self, process: str) -> dict[str, str]:
        if self.trace_dir is None:
            return {}
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        return {"KVMESH_TRACE_EXPORTER": "file", "KVMESH_TRACE_FILE": str(self.trace_dir / f"{process}.jsonl"),
                "OTEL_SERVICE_NAME": f"kvmesh-{process}"}

    def addresses(self) -> dict:
        return {
            "redis": self.redis.url,
            "control_plane": self.control_plane.address if self.control_plane else "",
            "data_planes": {node: p.address for node, p in self.data_planes.items()},
            "node_key_files": {node: str(self.node_key_file(node)) for node in self.node_keys},
            "tenant": self.tenant,
            "block_bytes": self.block_bytes,
            "block_tokens": self.block_tokens,
            "admin_key_file": str(self.admin_key_file),
            "redis_user": self.redis_users["control_plane"].name,
            "redis_password_file": str(self.redis_users["control_plane"].password_file),
            "workdir": str(self.workdir),
        }
