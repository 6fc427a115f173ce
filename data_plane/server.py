"""Runs one node's data plane: ``kvmesh data-plane [--flags]`` (or ``python -m data_plane.server``).

Startup order: region (mlock) -> NIXL agent (registers the region) -> core ->
gRPC server -> event publisher (optional). Once serving it prints one line,
``kvmesh data-plane <node_id> listening on <advertised address>``, that
scripts and tests wait for. The local API answers from then on; pulls and peer
calls wait for the NIXL agent, which may take seconds more on a loaded host:
its readiness is the gRPC health status of :data:`TRANSFERS_HEALTH`
(NOT_SERVING until the agent is up, SERVING after; NOT_SERVING for good when
it could not be created).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from grpc_health.v1 import health_pb2

from kvmesh import tracing
from kvmesh.errors import Unavailable
from kvmesh.request_gate import InFlightLimit
from kvmesh.grpc_server import RunningServer, ServiceBinding, check_can_bind, server_tls, \
    start_server, wait_for_signal
from kvmesh.metrics import MetricsEndpoint, RpcMetricsInterceptor
from kvmesh.command_line import run_command
from kvmesh.settings_cli import service_main
from kvmesh.v1 import data_plane_pb2_grpc

from tenancy.auth import AuthInterceptor, auth_metadata

from data_plane.auth import NodeAuth
from data_plane.config import DataPlaneConfig
from data_plane.core import DataPlaneCore
from data_plane.disk import DiskTier
from data_plane.eviction import PolicyRegistry
from data_plane.metrics import DataPlaneMetrics, TierUsageCollector
from data_plane.prefetch import Prefetcher
from data_plane.shm import SharedRegion
from data_plane.servicer import DataPlaneServicer
from data_plane.transfer import NixlTransport

log = logging.getLogger(__name__)

TRANSFERS_HEALTH = "kvmesh.v1.DataPlane.Transfers"  # health service name: SERVING once NIXL transfers can run
_AGENT_START_BOUND_S = 3600.0


@dataclass
class RunningDataPlane:
    core: DataPlaneCore
    server: RunningServer
    publisher: Any | None  # control_plane.publisher.EventPublisher
    metrics: MetricsEndpoint
    auth: NodeAuth
    prefetcher: Prefetcher
    transfers_ready: asyncio.Task | None = None  # reports the NIXL agent's readiness (TRANSFERS_HEALTH)

    @property
    def address(self) -> str:
        return self.core.address

    async def stop(self) -> None:
        # the WRITEs in flight end before the port is given up (a new incarnation there proves none is left)
        await self.core.sends.drain(self.core.config.max_pull_timeout_ms / 1000)
        if self.transfers_ready is not None:
            self.transfers_ready.cancel()
        await self.server.stop()
        self.metrics.stop()
        if self.publisher is not None:
            await self.publisher.flush(timeout=2.0)
            await self.publisher.stop()
        await self.prefetcher.close()
        await self.core.close()
        await self.auth.close()


def build_core(config: DataPlaneConfig, auth: NodeAuth, metrics: DataPlaneMetrics) -> DataPlaneCore:
    registry = PolicyRegistry()
    policy = registry.create(config.eviction_policy, config.num_slots)
    disk = None
    if config.disk_dir is not None:
        disk = DiskTier(config.disk_dir / f"kvmesh-dp-{config.node_id}.disk", config.block_bytes,
                        config.disk_slots, registry.create(config.disk_eviction_policy, config.disk_slots))
    region = SharedRegion(config.shm_path, config.block_bytes, config.num_slots, owner=True,
                          lock_memory=config.lock_memory)
    try:
        transport = NixlTransport(config.node_id, region, config.nixl_progress_wait_ms, config.transfer_lanes,
                                  config.transfer_piece_bytes, config.landing_slots, config.max_landing_sources,
                                  config.landing_renewals_per_source)
    except BaseException:
        region.close()
        if disk is not None:
            disk.close()
        raise
    with_cp = bool(config.control_plane_address)
    return DataPlaneCore(config, region, policy, transport, disk=disk, metrics=metrics,
                         grants=auth.grant_for if with_cp else None, limits=auth.tenant_limit if with_cp else None,
                         peer_proof=auth.peer_proof, peer_tls=config.peer_tls,
                         routes=auth.check_route if config.require_route_token else None,
                         epochs=auth.refresh_tenant if with_cp else None)


async def serve(config: DataPlaneConfig) -> RunningDataPlane:
    """Starts the node in this event loop; returns once it is serving. What a user can get wrong fails before the
    region and the NIXL agent exist: the metrics endpoint binds first, then the gRPC port and the TLS files."""
    metrics = DataPlaneMetrics()
    endpoint = MetricsEndpoint(metrics.registry, config.metrics_listen)
    try:
        return await _serve(config, metrics, endpoint)
    except BaseException:
        endpoint.stop()
        raise


async def _serve(config: DataPlaneConfig, metrics: DataPlaneMetrics, endpoint: MetricsEndpoint) -> RunningDataPlane:
    check_can_bind(config.listen)
    tls = server_tls(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)
    if config.client_tls() is not None:
        config.client_tls().credentials()
    auth = NodeAuth(config.node_id, config.node_key(), config.grant_public_key, config.control_plane_address,
                    timeout_s=config.control_plane_timeout_ms / 1000,
                    refresh_s=config.control_plane_refresh_ms / 1000, tls=config.client_tls(),
                    grant_keys_refresh_s=config.grant_keys_refresh_s)
    core = build_core(config, auth, metrics)
    metrics.registry.register(TierUsageCollector(config.node_id, core.usage))
    auth.watch_epochs(core.learn_epoch)
    prefetcher = Prefetcher(core.pull, core.block_bytes, metrics.registry, enabled=config.prefetch_enabled,
                            timeout_ms=config.prefetch_timeout_ms, cap_bytes=config.prefetch_cap_bytes,
                            use_window_s=config.prefetch_use_window_ms / 1000,
                            pull_timeout_ms=config.pull_timeout_ms, max_pull_timeout_ms=config.max_pull_timeout_ms)
    try:
        binding = ServiceBinding(DataPlaneServicer(core, auth, prefetcher),
                                 data_plane_pb2_grpc.add_DataPlaneServicer_to_server,
                                 "kvmesh.v1.DataPlane")
        interceptors = [RpcMetricsInterceptor(metrics.registry, "data-plane"),
                        AuthInterceptor(auth.authenticate, peer=auth.peer_principal)]
        in_flight = InFlightLimit(config.max_calls_in_flight_per_key, auth.call_owner,
                                  config.max_request_bytes_in_flight_per_key, config.max_request_bytes)
        server = await start_server(config.listen, [binding], interceptors=interceptors, tls=tls, in_flight=in_flight,
                                    max_connections=config.max_connections)
    except BaseException:
        await core.close()
        await auth.close()
        raise
    core.address = config.advertised(server.port)
    await server.health.set(TRANSFERS_HEALTH, health_pb2.HealthCheckResponse.NOT_SERVING)
    transfers_ready = asyncio.get_running_loop().create_task(_report_transfers_ready(core, server))
    core.start_background()
    publisher = None
    if config.control_plane_address:
        from control_plane.publisher import EventPublisher, NodeInfo

        publisher = EventPublisher(config.control_plane_address,
                                   NodeInfo(config.node_id, core.address, pool=config.pool), core.snapshot,
                                   metadata=auth_metadata(auth.node_key), tls=config.client_tls())
        core.events = publisher
        await publisher.start()
    return RunningDataPlane(core, server, publisher, endpoint, auth, prefetcher, transfers_ready)


async def _report_transfers_ready(core: DataPlaneCore, server: RunningServer) -> None:
    """TRANSFERS_HEALTH turns SERVING once the NIXL agent is up (it stays NOT_SERVING if it never is)."""
    try:
        await core.transport.ready(_AGENT_START_BOUND_S)
    except Unavailable as exc:
        log.error("node %s serves no transfers: %s", core.node_id, exc)
        return
    await server.health.set(TRANSFERS_HEALTH, health_pb2.HealthCheckResponse.SERVING)


async def _freeze_startup_objects(core: DataPlaneCore, timeout_s: float = 120.0) -> None:
    """Once the NIXL agent exists (its imports bring torch's objects), moves everything allocated so far out of
    the garbage collector's reach: a full collection no longer walks them, which otherwise stalled the loop for
    tens of milliseconds in the middle of a pull's 1,000 block records (measured)."""
    try:
        await core.transport.ready(timeout_s)
    except Unavailable:
        pass
    gc.freeze()


async def _run(config: DataPlaneConfig) -> None:
    running = await serve(config)
    tier = running.core.describe()
    log.info("node %s: %d slots x %d bytes in %s (mlock %s), disk tier %s, policy %s", config.node_id,
             tier.num_slots, tier.block_bytes, tier.shm_path, "on" if tier.locked else "off",
             f"{config.disk_slots} slots" if config.disk_dir else "off", config.eviction_policy)
    if running.metrics.port:
        log.info("metrics on %s", running.metrics.url)
    print(f"kvmesh data-plane {config.node_id} listening on {running.address}", flush=True)
    freeze = asyncio.get_running_loop().create_task(_freeze_startup_objects(running.core))
    await wait_for_signal()
    freeze.cancel()
    await running.stop()


def main(argv: list[str]) -> int:
    code = service_main(DataPlaneConfig, argv, "kvmesh data-plane", _run, check=DataPlaneConfig.node_key)
    # Stopped in order (sends drained, events flushed, region unlinked): what is left is the interpreter's
    # teardown, ~0.9 s of it torch's (imported by NIXL), which would hold up every stop of a fleet. Flush what
    # its exit handlers would (spans, logs) and skip it.
    tracing.shutdown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(run_command("kvmesh data-plane", main, sys.argv[1:]))
