"""Runs the control-plane service: ``kvmesh control-plane [--flags]`` (or ``python -m control_plane.server``).

The server factory is the one place the service is composed: the block map
over Redis (each tenant through its own Redis ACL user), the tenant registry,
authentication (an interceptor on every RPC), authorization, grant signing,
the ControlPlane and TenantAdmin services, health, reflection and TLS.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from kvmesh.grpc_server import RunningServer, ServiceBinding, check_can_bind, server_tls, \
    start_server, wait_for_signal
from kvmesh.metrics import MetricsEndpoint, RpcMetricsInterceptor
from kvmesh.request_gate import InFlightLimit
from kvmesh.redis_client import redacted
from kvmesh.command_line import run_command
from kvmesh.settings_cli import service_main
from kvmesh.v1 import control_plane_pb2_grpc, tenant_admin_pb2_grpc
from tenancy.audit_limit import DenialAudit
from tenancy.auth import AuthInterceptor, Authenticator, call_owner
from tenancy.authz import Authorizer
from tenancy.key_cache import ChangeListener, KeyCache
from tenancy.servicer import TenantAdminServicer
from tenancy.store import RedisTenantStore

from control_plane.config import ControlPlaneConfig
from control_plane.core import ControlPlane
from control_plane.metrics import MeteredBlockMap, ReplicaCollector, RouteCollector
from control_plane.redis_block_map import RedisBlockMap
from control_plane.routing.router import Router
from control_plane.routing.stats import RedisStatsStore
from control_plane.servicer import ControlPlaneServicer
from control_plane.watch import BlockMapWatch

log = logging.getLogger(__name__)

SUBSCRIBE_WAIT_S = 5.0


@dataclass
class RunningControlPlane:
    core: ControlPlane
    server: RunningServer
    metrics: MetricsEndpoint
    key_changes: ChangeListener
    denials: DenialAudit

    @property
    def port(self) -> int:
        return self.server.port

    async def stop(self) -> None:
        await self.server.stop()
        self.metrics.stop()
        await self.key_changes.stop()
        await self.denials.close()  # the suppressed-denial counts still pending
        await self.core.close()


async def serve(config: ControlPlaneConfig) -> RunningControlPlane:
    """Starts the service in this event loop; returns once it is serving. Ports first, before Redis is touched:
    the metrics endpoint binds (a port in use fails at once), then the gRPC port is checked."""
    registry = CollectorRegistry()
    metrics = MetricsEndpoint(registry, config.metrics_listen)
    try:
        return await _serve(config, registry, metrics)
    except BaseException:
        metrics.stop()
        raise


async def _serve(config: ControlPlaneConfig, registry: CollectorRegistry, metrics: MetricsEndpoint,
                 ) -> RunningControlPlane:
    check_can_bind(config.listen)
    admin_key = config.bootstrap_admin_key()
    tls = server_tls(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)
    redis_auth = dict(username=config.redis_username, password=config.redis_secret())
    tenants = RedisTenantStore(config.redis_url, key_prefix=config.key_prefix, tenant_secret=config.tenant_secret(),
                               acl_username=config.redis_acl_username, acl_password=config.redis_acl_secret(),
                               **redis_auth)
    await tenants.drop_legacy_grant_key()  # the first Redis call: Redis down fails here, before any warning
    await tenants.refresh_redis_users()  # an upgrade: users an older version made get this version's rules
    signer, grant_keys = config.grant_keys()
    redis_map = RedisBlockMap(config.redis_url, lease_ms=config.lease_ms, key_prefix=config.key_prefix,
                              tenant_credentials=tenants.redis_credentials, read_replica=config.read_replica,
                              namespace_release_after_ms=int(config.namespace_release_after_s * 1000), **redis_auth)
    block_map = MeteredBlockMap(redis_map, registry)
    denials = DenialAudit(tenants.audit)  # denied and unauthenticated calls: rate-limited, counted beyond
    authz = Authorizer(tenants, denials, config.policy_ttl_s)
    stats = RedisStatsStore(config.redis_url, key_prefix=config.key_prefix, alpha=config.route_stats_ewma_alpha,
                            refresh_ms=config.route_stats_refresh_ms, max_per_node=config.route_stats_max_per_node,
                            **redis_auth)
    watch = BlockMapWatch(redis_map.replica, config.max_watches_per_key) if redis_map.replica is not None else None
    core = ControlPlane(block_map, config, tenants, authz, signer, Router(stats, config), grant_keys,
                        watch=watch, blocks_key=redis_map.blocks_key)
    keys = KeyCache(tenants.get_key, config.auth_cache_ttl_s)

    def tenant_changed(tenant_id: str) -> None:
        authz.forget(tenant_id)
        redis_map.forget_tenant(tenant_id)

    key_changes = ChangeListener(tenants.subscribe_changes, keys, on_tenant=tenant_changed)
    key_changes.start()
    auth = AuthInterceptor(Authenticator(keys.get, admin_key).authenticate, denials)
    services = [
        ServiceBinding(ControlPlaneServicer(core), control_plane_pb2_grpc.add_ControlPlaneServicer_to_server,
                       "kvmesh.v1.ControlPlane"),
        ServiceBinding(TenantAdminServicer(tenants, authz), tenant_admin_pb2_grpc.add_TenantAdminServicer_to_server,
                       "kvmesh.v1.TenantAdmin"),
    ]
    registry.register(RouteCollector(core.router.counters))
    if redis_map.replica is not None:
        registry.register(ReplicaCollector(redis_map.replica))
    interceptors = [RpcMetricsInterceptor(registry, "control-plane"), auth]
    in_flight = InFlightLimit(config.max_calls_in_flight_per_key, call_owner,
                              config.max_request_bytes_in_flight_per_key, config.max_request_bytes)
    server = await start_server(config.listen, services, interceptors=interceptors, tls=tls, in_flight=in_flight,
                                max_connections=config.max_connections)
    core.start_background()
    try:  # serve from a warm cache only once revocations flow (until then every call reads Redis)
        await asyncio.wait_for(key_changes.subscribed.wait(), SUBSCRIBE_WAIT_S)
    except asyncio.TimeoutError:
        log.warning("revocation feed not subscribed within %.0f s; API keys are read from Redis per call",
                    SUBSCRIBE_WAIT_S)
    return RunningControlPlane(core, server, metrics, key_changes, denials)


async def _run(config: ControlPlaneConfig) -> None:
    running = await serve(config)
    # the ~70,000 objects of the imports and start-up no longer walked by each full collection: 37 ms of event
    # loop each time, measured here, then 0
    gc.freeze()
    host = config.listen.rsplit(":", 1)[0]
    log.info("control plane serving on %s:%d (redis %s)", host, running.port, redacted(config.redis_url))
    if running.metrics.port:
        log.info("metrics on %s", running.metrics.url)
    print(f"kvmesh control-plane listening on {host}:{running.port}", flush=True)
    await wait_for_signal()
    await running.stop()


def main(argv: list[str]) -> int:
    return service_main(ControlPlaneConfig, argv, "kvmesh control-plane", _run, check=ControlPlaneConfig.bootstrap_admin_key)


if __name__ == "__main__":
    sys.exit(run_command("kvmesh control-plane", main, sys.argv[1:]))
