"""Runs the control-plane service: ``kvmesh control-plane [--flags]``."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

from kvmesh.grpc_server import RunningServer, ServiceBinding, start_server
from kvmesh.settings_cli import parse_settings
from kvmesh.v1 import control_plane_pb2_grpc

from control_plane.config import ControlPlaneConfig
from control_plane.core import ControlPlane
from control_plane.redis_block_map import RedisBlockMap
from control_plane.servicer import ControlPlaneServicer

log = logging.getLogger(__name__)


@dataclass
class RunningControlPlane:
    core: ControlPlane
    server: RunningServer

    @property
    def port(self) -> int:
        return self.server.port

    async def stop(self) -> None:
        await self.server.stop()
        await self.core.close()


async def serve(config: ControlPlaneConfig) -> RunningControlPlane:
    """Starts the service in this event loop; returns once it is serving."""
    block_map = RedisBlockMap(config.redis_url, lease_ms=config.lease_ms, key_prefix=config.key_prefix,
                              username=config.redis_username, password=config.redis_password)
    core = ControlPlane(block_map, config)
    binding = ServiceBinding(ControlPlaneServicer(core), control_plane_pb2_grpc.add_ControlPlaneServicer_to_server,
                             "kvmesh.v1.ControlPlane")
    server = await start_server(config.listen, [binding])
    core.start_background()
    return RunningControlPlane(core, server)


async def _run(config: ControlPlaneConfig) -> None:
    running = await serve(config)
    host = config.listen.rsplit(":", 1)[0]
    log.info("control plane serving on %s:%d (redis %s)", host, running.port, config.redis_url)
    print(f"kvmesh control-plane listening on {host}:{running.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await running.stop()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_run(parse_settings(ControlPlaneConfig, argv, "kvmesh control-plane")))
    return 0
