"""A local kvmesh fleet as processes on loopback: Redis, the control plane, data planes, vLLM engines.

Shared by ``kvmesh up``, ``kvmesh demo`` and the end-to-end tests. :meth:`Fleet.start` starts
Redis (AOF on, in ``workdir``; no password-less user: the control plane and its ACL-only user get
fresh passwords) and the control plane with a bootstrap admin key, creates the
tenant, issues one node key per data plane through the TenantAdmin API and starts the data
planes with their keys (they publish tier changes and fetch pull grants with them). Engines
(:mod:`kvmesh_apps.engine_host`) are started on demand, attached to a node's data plane.

Secrets (Redis passwords, the admin key, node keys) go to files in ``<workdir>/secrets`` (0700
directory, 0600 files) and reach processes by file name: never on a command line, in the
environment or in a log. A start in a work directory that holds them (a restart) reuses them: the
Redis passwords and the grant-signing key as they are, the tenant if it exists, and each node key
the control plane still knows for its node; the ACL file is rewritten to agree with the passwords,
keeping the tenant users Redis saved in it.

Every gRPC link is mutual TLS with a CA of the fleet's own in ``<workdir>/tls``
(:mod:`kvmesh_apps.fleet_tls`; kept on a restart in the same workdir); ``tls=False`` runs them in
plaintext. Clients of the fleet get their TLS from :meth:`Fleet.client_tls`.

Every service serves Prometheus metrics on a free loopback port (:meth:`Fleet.metrics`).
With a ``tether`` (``kvmesh up``) the children end whenever this process ends, SIGKILL included
(:class:`kvmesh_apps.procs.Tether`), and a :class:`kvmesh_apps.reaper.Reaper` removes the
shared-memory directory after them.

With ``trace_dir`` every process writes its spans to ``<trace_dir>/<process>.jsonl``
(``KVMESH_TRACE_EXPORTER=file``, see kvmesh.tracing).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any

import grpc

from kvmesh.channels import ClientTLS, channel
from kvmesh.errors import Unauthenticated
from kvmesh_apps.engine_host import EngineProcess
from kvmesh_apps.fleet_tls import ADMIN, FleetTLS
from kvmesh_apps.procs import ServiceProcess, Tether, stop_all
from kvmesh_apps.reaper import Reaper
from kvmesh_apps.redis_server import RedisServer, fleet_users, write_secret
from kvmesh.v1 import tenant_admin_pb2 as ta_pb, tenant_admin_pb2_grpc as ta_grpc
from tenancy import api_keys
from tenancy.grants import GrantSigner

DEFAULT_BLOCK_BYTES = 2 * 1024 * 1024
PROVISION_RETRY_S = 30.0  # how long provisioning rides out an UNAVAILABLE control plane at start


def _node_key_label(node: str) -> str:
    """The description of the node keys the local fleet issues: how it tells its own keys from an operator's."""
    return f"local fleet node {node}"


class Fleet:
    """The started processes, stopped in reverse order. Not thread-safe."""

    def __init__(self, workdir: Path, data_planes: int, admin_key: str, *, tenant: str = "demo",
                 block_bytes: int = DEFAULT_BLOCK_BYTES, block_tokens: int = 0, capacity: str = "256MiB",
                 trace_dir: Path | None = None, tether: Tether | None = None, stop_timeout_s: float = 10.0,
                 tls: bool = True) -> None:
        self.workdir = Path(workdir)
        self.admin_key = admin_key
        self.tenant = tenant
        self.block_bytes = block_bytes
        self.block_tokens = block_tokens
        self.capacity = capacity
        self.trace_dir = trace_dir
        self.tether = tether
        self.stop_timeout_s = stop_timeout_s
        self.secrets_dir = self.workdir / "secrets"
        self.redis_users = fleet_users(self.secrets_dir)
        self.redis = RedisServer(self.workdir / "redis", users=list(self.redis_users.values()), tether=tether)
        self.shm_dir: Path | None = None  # made by start()
        self.reaper: Reaper | None = None
        self.control_plane: ServiceProcess | None = None
        self.data_planes: dict[str, ServiceProcess] = {}
        self.node_keys: dict[str, str] = {}
        self.engines: dict[str, EngineProcess] = {}
        self._wanted_data_planes = data_planes
        self._wanted_tls = tls
        self.tls: FleetTLS | None = None  # made by start()

    def _grant_key_file(self) -> Path:
        """The control plane's grant-signing key, generated on first start (mode 0600) and kept in the workdir."""
        path = self.workdir / "grant-signing-key.pem"
        if not path.exists():
            GrantSigner.create_file(path)
        return path

    # ---- lifecycle ----

    def start(self) -> "Fleet":
        try:
            nodes = [f"dp{i}" for i in range(1, self._wanted_data_planes + 1)]
            if self._wanted_tls:
                self.tls = FleetTLS.ensure(self.workdir / "tls", nodes)
            tmpfs = "/dev/shm" if Path("/dev/shm").is_dir() else None
            self.shm_dir = Path(tempfile.mkdtemp(prefix="kvmesh-fleet-", dir=tmpfs))
            if self.tether is not None:
                self.reaper = Reaper(self.shm_dir, self.tether.hold_fds)
            # Redis on a socket in the fleet's private directory: nobody else on the host can take its clients
            self.redis.unix_socket = self.shm_dir / "redis.sock"
            self.redis.start()
            self._watch(self.redis.proc.pid)
            write_secret(self.admin_key_file, self.admin_key)
            cp_user, acl_user = self.redis_users["control_plane"], self.redis_users["acl"]
            self.control_plane = self._start_service(
                ["control-plane", "--listen", "127.0.0.1:0", "--redis-url", self.redis.url,
                 "--redis-username", cp_user.name, "--redis-password-file", str(cp_user.password_file),
                 "--redis-acl-username", acl_user.name, "--redis-acl-password-file", str(acl_user.password_file),
                 "--admin-key-file", str(self.admin_key_file), "--grant-key-file", str(self._grant_key_file()),
                 *(self.tls.control_plane_flags() if self.tls else [])],
                "control-plane", "control-plane")
            if self._wanted_data_planes and importlib.util.find_spec("data_plane.server") is not None:
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
        """:meth:`_provision_once`, again while the control plane answers UNAVAILABLE (its Redis stalled past the
        socket timeout: an ACL SAVE's fsync on a machine busy starting engines), for up to
        ``PROVISION_RETRY_S``; then the last error stands."""
        deadline = asyncio.get_running_loop().time() + PROVISION_RETRY_S
        while True:
            try:
                return await self._provision_once(nodes)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.5)

    async def _provision_once(self, nodes: list[str]) -> dict[str, str]:
        """The tenant (created unless it exists) and a node key per data plane: the one in its key file when the
        control plane still knows it for that node (a restart), else a new one (admin API). Before a new one is
        issued, the keys this fleet issued earlier for that node and nobody holds (its key file lost, or an
        IssueKey whose answer a stalled Redis timed out after it was stored) are revoked, so that no live
        credential for the node exists outside its key file."""
        async with channel(self.control_plane.address, self.admin_key, self.control_plane_tls()) as ch:
            admin = ta_grpc.TenantAdminStub(ch)
            tenants = await admin.ListTenants(ta_pb.ListTenantsRequest())
            if self.tenant not in {t.tenant_id for t in tenants.tenants}:
                await admin.CreateTenant(ta_pb.CreateTenantRequest(tenant_id=self.tenant,
                                                                   display_name="the local fleet's tenant"))
            live = [k for k in (await admin.ListKeys(ta_pb.ListKeysRequest())).keys
                    if k.role == ta_pb.ROLE_NODE and not k.revoked]
            keys = {}
            for node in nodes:
                kept = self._kept_node_key(node)
                if kept is not None and any(k.key_id == api_keys.parse(kept)[0] and k.node_id == node for k in live):
                    keys[node] = kept
                    continue
                for orphan in (k for k in live if k.node_id == node and k.description == _node_key_label(node)):
                    await admin.RevokeKey(ta_pb.RevokeKeyRequest(key_id=orphan.key_id))
                reply = await admin.IssueKey(ta_pb.IssueKeyRequest(role=ta_pb.ROLE_NODE, node_id=node,
                                                                   description=_node_key_label(node)))
                keys[node] = reply.secret
            return keys

    def _kept_node_key(self, node: str) -> str | None:
        path = self.node_key_file(node)
        key = path.read_text().strip() if path.exists() else ""
        try:
            api_keys.parse(key)
        except Unauthenticated:  # absent or not a key
            return None
        return key

    def _start_service(self, args: list[str], name: str, trace_name: str, env: dict[str, str] | None = None,
                       ) -> ServiceProcess:
        """``kvmesh <args>`` with metrics on a free port, logging to ``<workdir>/<name>.log``."""
        return ServiceProcess([*args, "--metrics-listen", "127.0.0.1:0"],
                              env={**(env or {}), **self._trace_env(trace_name)}, log_path=self.workdir / f"{name}.log",
                              tether=self.tether, on_spawn=self._watch).start()

    def _watch(self, pid: int) -> None:
        if self.reaper is not None and pid:
            self.reaper.watch(pid)

    def _start_data_plane(self, node: str) -> ServiceProcess:
        args = ["data-plane", "--node-id", node, "--listen", "127.0.0.1:0", "--control-plane-address",
                self.control_plane.address, "--shm-dir", str(self.shm_dir), "--capacity-bytes", self.capacity,
                "--block-bytes", str(self.block_bytes), "--block-tokens", str(self.block_tokens),
                "--no-lock-memory"]
        args += ["--api-key-file", str(self.node_key_file(node))]
        args += self.tls.data_plane_flags(node) if self.tls else []
        env = {"UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
        return self._start_service(args, node, f"data-plane-{node}", env)

    def restart_data_plane(self, node: str) -> None:
        """Kills data plane ``node`` (as a crash would) and starts it again at the same address: a new
        incarnation with a new, empty tier file."""
        self.data_planes[node].kill()
        self.start_again(f"data plane {node}")

    def stop(self) -> None:
        """Engines, then every data plane at once, the control plane and Redis; the shared-memory directory.

        A service still running ``stop_timeout_s`` after its SIGTERM is killed (e.g. a data plane stopped while its
        NIXL agent is still being created waits for it: seconds on a loaded host); its files in the
        shared-memory directory go with the directory."""
        for engine in reversed(list(self.engines.values())):
            engine.stop()
        stop_all(self.data_planes.values(), self.stop_timeout_s)
        if self.control_plane is not None:
            self.control_plane.stop(self.stop_timeout_s)
        self.redis.stop()
        if self.shm_dir is not None:
            shutil.rmtree(self.shm_dir, ignore_errors=True)
        if self.reaper is not None:
            self.reaper.finish()

    def stopped_services(self) -> dict[str, tuple[str, Path]]:
        """The services no longer running: name ("redis", "control plane", "data plane dp1") -> how it ended, in
        words, and its log."""
        services = [("redis", self.redis.proc, self.redis.workdir / "redis.log")]
        if self.control_plane is not None:
            services.append(("control plane", self.control_plane.proc, self.control_plane.log_path))
        services += [(f"data plane {node}", dp.proc, dp.log_path) for node, dp in self.data_planes.items()]
        stopped = {}
        for name, proc, log_path in services:
            if proc is not None and (code := proc.poll()) is not None:
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
                stopped[name] = how, log_path
        return stopped

    def start_again(self, name: str) -> str:
        """Starts service ``name`` (of :meth:`stopped_services`) again in place: the same address, metrics
        address, data and keys (Redis from its append-only file; a data plane as a new incarnation with an empty
        tier). Its address."""
        if name == "redis":
            self.redis.start()
            self._watch(self.redis.proc.pid)
            return self.redis.url
        if name == "control plane":
            self.control_plane = self.control_plane.again()
            return self.control_plane.address
        node = name.removeprefix("data plane ")
        self.data_planes[node] = self.data_planes[node].again()
        return self.data_planes[node].address

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
                "weight_version": "random-init", **(self.tls.connector_settings(node) if self.tls else {}),
                **overrides}

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
        return self.secrets_dir / "admin.key"

    def node_key_file(self, node: str) -> Path:
        return self.secrets_dir / f"{node}.key"

    def client_tls(self, name: str = ADMIN, server: str | None = None) -> ClientTLS | None:
        """How a client reaches the fleet's services: ``name``'s certificate (``admin``, a node id for that data
        plane's own, ``engine-<node>``), checking the server's names ``server`` (FleetTLS.client: an engine's
        checks its node's by default; a data plane's certificate names its node id alone), or None (plaintext)
        for a fleet started with ``tls=False``."""
        return self.tls.client(name, server) if self.tls else None

    def control_plane_tls(self, name: str = ADMIN) -> ClientTLS | None:
        """:meth:`client_tls` for the control plane, checking its certificate names it (``control-plane``)."""
        return self.tls.control_plane_client(name) if self.tls else None

    def _trace_env(self, process: str) -> dict[str, str]:
        if self.trace_dir is None:
            return {}
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        return {"KVMESH_TRACE_EXPORTER": "file", "KVMESH_TRACE_FILE": str(self.trace_dir / f"{process}.jsonl"),
                "OTEL_SERVICE_NAME": f"kvmesh-{process}"}

    def metrics(self) -> dict[str, str]:
        """Each service's Prometheus endpoint: ``{"control_plane": URL, "<node>": URL, ...}``."""
        procs = {"control_plane": self.control_plane, **self.data_planes}
        return {name: proc.metrics_url for name, proc in procs.items() if proc is not None and proc.metrics_url}

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
            "shm_dir": str(self.shm_dir or ""),
            "metrics": self.metrics(),
            "tls": self.tls.describe(list(self.data_planes)) if self.tls else None,
        }
