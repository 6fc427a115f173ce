"""Prometheus metrics: one registry per service instance, an RPC interceptor, and the HTTP endpoint.

Each service builds its own :class:`prometheus_client.CollectorRegistry` (no
process-wide singletons, so several services in one test process stay apart),
records RPC latency and status codes through :class:`RpcMetricsInterceptor`
(composed by kvmesh.grpc_server with the other interceptors) and serves
``/metrics`` on its ``metrics_port`` (0: not served).
"""

from __future__ import annotations

import time

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from kvmesh.grpc_server import rewrap_handler

LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts every RPC by method and status code and times unary ones (streams: time to end)."""

    def __init__(self, registry: CollectorRegistry, service: str) -> None:
        self._seconds = Histogram("kvmesh_rpc_seconds", "RPC handling time", ["service", "method"],
                                  registry=registry, buckets=LATENCY_BUCKETS)
        self._total = Counter("kvmesh_rpc", "RPCs handled", ["service", "method", "code"], registry=registry)
        self._service = service
        # Per method (only methods the server has): its latency child and its counters by status code, bound
        # once; labels() takes a lock and a dict lookup.
        self._children: dict[str, tuple[object, dict[str, object]]] = {}

    def _method_children(self, full_method: str) -> tuple[object, dict[str, object]]:
        found = self._children.get(full_method)
        if found is None:
            method = full_method.rsplit("/", 1)[-1]
            found = self._children[full_method] = (self._seconds.labels(self._service, method), {})
        return found

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc."):
            return handler
        seconds, by_code = self._method_children(details.method)
        method = details.method.rsplit("/", 1)[-1]

        def record(context, start: float) -> None:
            code = context.code() if hasattr(context, "code") else None
            name = code.name if isinstance(code, grpc.StatusCode) else "OK"
            seconds.observe(time.perf_counter() - start)
            counter = by_code.get(name)
            if counter is None:
                counter = by_code[name] = self._total.labels(self._service, method, name)
            counter.inc()

        def wrap(behavior, streaming: bool):
            if streaming:
                async def stream(request, context):
                    start = time.perf_counter()
                    try:
                        async for item in behavior(request, context):
                            yield item
                    finally:
                        record(context, start)

                return stream

            async def unary(request, context):
                start = time.perf_counter()
                try:
                    return await behavior(request, context)
                finally:
                    record(context, start)

            return unary

        return rewrap_handler(handler, wrap)


class MetricsEndpoint:
    """``/metrics`` over HTTP for one registry; ``port`` 0 serves nothing."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.port = 0
        self._server = None
        if port:
            self._server, _thread = start_http_server(port, addr=host, registry=registry)
            self.port = self._server.server_port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
