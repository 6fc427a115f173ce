"""Prometheus metrics: one registry per service instance, an RPC interceptor, and the HTTP endpoint.

Each service builds its own :class:`prometheus_client.CollectorRegistry` (no
process-wide singletons, so several services in one test process stay apart),
records RPC latency and status codes through :class:`RpcMetricsInterceptor`
(composed by kvmesh.grpc_server with the other interceptors) and serves
``/metrics`` on its ``metrics_listen`` address: ``host:port``, port 0 picking any free port (as for
``listen``), empty or ``off`` serving nothing (:func:`metrics_address`).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Annotated
from wsgiref.simple_server import WSGIRequestHandler, make_server

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from pydantic import AfterValidator

from kvmesh.errors import InvalidArgument, Unavailable
from kvmesh.grpc_server import rewrap_handler

OFF = ("", "off")
STOP_POLL_S = 0.1  # how often the endpoint's loop looks for stop(): the longest stop() waits
# Nobody authenticates to /metrics, so what one client can hold is bounded: each connection is a thread and a file
# descriptor of the service itself (measured: 300 idle connections held 300 threads for ever, and enough of them
# would leave the service no descriptor for its gRPC clients or Redis). A connection that sends or reads nothing for
# this long is closed, and past this many at once a new one is closed at once (a scrape retries).
METRICS_IO_TIMEOUT_S = 5.0
MAX_METRICS_CONNECTIONS = 16

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


def metrics_address(setting: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``metrics_listen`` setting, port 0 meaning any free port; None for empty or ``off``.
    :class:`InvalidArgument` (one line) for anything else."""
    if setting.strip().lower() in OFF:
        return None
    host, sep, port = setting.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise InvalidArgument(f"metrics_listen {setting!r} is not host:port; give e.g. 127.0.0.1:9464, "
                              "127.0.0.1:0 for any free port, or off")
    return host.strip("[]") or "127.0.0.1", int(port)


def _valid_setting(setting: str) -> str:
    try:
        metrics_address(setting)
    except InvalidArgument as exc:
        raise ValueError(str(exc)) from None
    return setting


MetricsListen = Annotated[str, AfterValidator(_valid_setting)]
"""A service's ``metrics_listen`` setting, checked when the settings are read."""
METRICS_LISTEN_HELP = ("host:port of the Prometheus /metrics endpoint (port 0: any free port, logged as 'metrics on "
                       "URL'; empty or off: no endpoint)")


class MetricsEndpoint:
    """``/metrics`` over HTTP for one registry, at a ``metrics_listen`` setting (:func:`metrics_address`).

    ``port`` is the bound port (0 when off). A port that cannot be bound raises :class:`Unavailable`, one line
    naming the address and what to do."""

    def __init__(self, registry: CollectorRegistry, setting: str) -> None:
        self.host, self.port = "", 0
        self._server = None
        address = metrics_address(setting)
        if address is None:
            return
        host, port = address
        try:
            self._server = make_server(host, port, make_wsgi_app(registry), _server_class(host),
                                       handler_class=_QuietHandler)
        except OSError as exc:
            raise Unavailable(f"cannot listen on {host}:{port} for metrics: {exc.strerror or exc}; give "
                              "metrics_listen another port, port 0 for any free one, or off") from None
        self.host, self.port = host, self._server.server_port
        threading.Thread(target=self._server.serve_forever, args=(STOP_POLL_S,), daemon=True,
                         name="metrics-http").start()

    @property
    def url(self) -> str:
        """``http://host:port/metrics`` (empty when off)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics" if self.port else ""

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


class _QuietHandler(WSGIRequestHandler):
    def setup(self) -> None:
        self.timeout = METRICS_IO_TIMEOUT_S  # on every read and write of the connection
        super().setup()

    def log_message(self, format, *args) -> None:  # no access log on stderr
        pass


def _server_class(host: str) -> type[ThreadingWSGIServer]:
    class Server(ThreadingWSGIServer):
        """At most MAX_METRICS_CONNECTIONS connections served at once (more are closed unserved); a client that
        stalls is dropped quietly (socketserver would print a traceback on the service's stderr)."""

        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        request_queue_size = 128  # accepted and closed at once past the cap, rather than left to retry their SYN
        _slots = threading.BoundedSemaphore(MAX_METRICS_CONNECTIONS)

        def process_request(self, request, client_address) -> None:
            if not self._slots.acquire(blocking=False):
                self.shutdown_request(request)
                return
            try:
                super().process_request(request, client_address)
            except BaseException:  # no thread started: it will not release the slot
                self._slots.release()
                self.shutdown_request(request)
                raise

        def process_request_thread(self, request, client_address) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                self._slots.release()

        def handle_error(self, request, client_address) -> None:
            pass  # a client that timed out or hung up: nothing to report

    return Server
