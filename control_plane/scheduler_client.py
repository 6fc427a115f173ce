"""A small client for custom schedulers: ask the control plane where a request should run.

Example::

    from control_plane.scheduler_client import Candidate, SchedulerClient

    async with SchedulerClient("cp:50051", namespace, api_key=key) as client:
        decision = await client.route(
            [Candidate("engine-a", "node-a", waiting_requests=2, running_tokens=9000),
             Candidate("engine-b", "node-b")],
            token_ids=prompt_ids)
        send_to(decision.engine_id, kv_transfer_params=decision.kv_transfer_params())

``decision.kv_transfer_params()`` is ``{"remote_kv_source": {...}}`` when the
control plane named a peer to pull the prefix from, else ``{}``. Errors are
``grpc.aio.AioRpcError`` with the status codes of docs/api.md.
"""

from __future__ import annotations

from typing import Sequence

import grpc

from kvmesh.channels import ClientTLS
from kvmesh.grpc_server import channel_options
from kvmesh.hashing import Extras
from kvmesh.namespace import Namespace
from kvmesh.v1 import control_plane_pb2_grpc as pb_grpc

from control_plane.routing import wire
from control_plane.routing.types import (
    Candidate, EngineSample, LinkSample, Policy, PullOutcome, RouteDecision, RouteRequest, StatsReport,
)

__all__ = ["Candidate", "EngineSample", "LinkSample", "Policy", "PullOutcome", "RouteDecision", "SchedulerClient"]


class SchedulerClient:
    def __init__(self, address: str, namespace: Namespace, *, api_key: str | None = None,
                 timeout_s: float = 5.0, tls: ClientTLS | None = None) -> None:
        """``tls``: the control plane's CA (and this client's certificate when it requires mutual TLS); None:
        plaintext."""
        self.namespace = namespace.validate()
        options = channel_options()
        self._channel = (grpc.aio.insecure_channel(address, options=options) if tls is None else
                         grpc.aio.secure_channel(address, tls.credentials(), options=tls.options(options)))
        self._stub = pb_grpc.ControlPlaneStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._timeout = timeout_s

    async def route(self, candidates: Sequence[Candidate], *, token_ids: Sequence[int] = (),
                    block_hashes: Sequence[bytes] = (), prompt_tokens: int = 0, extras: Extras = Extras(),
                    policy: Policy | None = None, p2p: bool = True, min_cached_token_delta: int = 0,
                    kv_bytes_per_token: int = 0, kv_request_id: str = "") -> RouteDecision:
        """The engine to run on, the KV source to pull from (if any) and why. ``policy`` None: the server's."""
        request = RouteRequest(self.namespace, tuple(candidates), tuple(block_hashes), tuple(token_ids), extras,
                               prompt_tokens, policy, p2p, min_cached_token_delta, kv_bytes_per_token,
                               kv_request_id)
        reply = await self._stub.Route(wire.route_request_to_pb(request), metadata=self._metadata,
                                       timeout=self._timeout)
        return wire.route_decision(reply)

    async def report_stats(self, *, links: Sequence[LinkSample] = (), engines: Sequence[EngineSample] = (),
                           pulls: Sequence[PullOutcome] = ()) -> None:
        """Measured figures for the cost model, and outcomes of routed pulls."""
        report = StatsReport(tuple(links), tuple(engines), tuple(pulls))
        await self._stub.ReportStats(wire.stats_report_to_pb(report), metadata=self._metadata,
                                     timeout=self._timeout)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "SchedulerClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
