"""The one place gRPC servers are built: services, health, reflection, interceptors.

Every kvmesh service starts through :func:`start_server`, so cross-cutting
behaviour (authentication, tracing, metrics) is composed here and nowhere else.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvmesh import errors, tracing

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ServiceBinding:
    """A servicer, the generated function that adds it, and its full name."""

    servicer: Any
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    full_name: str  # e.g. "kvmesh.v1.ControlPlane"


@dataclass(frozen=True)
class ServerTLS:
    """TLS for a server; with ``client_ca_file``, mutual TLS (clients must present a certificate it signed)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        ca = Path(self.client_ca_file).read_bytes() if self.client_ca_file else None
        pair = [(Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes())]
        return grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=ca is not None)


def server_tls(cert_file: str | None, key_file: str | None, client_ca_file: str | None) -> ServerTLS | None:
    """A ServerTLS from optional settings: none, or cert and key (and optionally a client CA), whose files are
    read now (a missing or unreadable one fails a service's start before anything runs)."""
    if not cert_file and not key_file:
        if client_ca_file:
            raise ValueError("a client CA (mutual TLS) needs a server certificate and key too; set tls_cert_file "
                             "and tls_key_file, or unset tls_client_ca_file")
        return None
    if not (cert_file and key_file):
        raise ValueError("TLS needs both a certificate file and a key file; set tls_cert_file and tls_key_file")
    tls = ServerTLS(cert_file, key_file, client_ca_file)
    tls.credentials()
    return tls


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health_aio.HealthServicer

    async def stop(self, grace: float | None = 1.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


def rewrap_handler(handler: grpc.RpcMethodHandler, wrap, request_deserializer=None) -> grpc.RpcMethodHandler:
    """The same RPC handler with its behavior replaced by ``wrap(behavior, streaming_response)`` (and its
    request deserializer, when given).

    The one place server interceptors (authentication, metrics, decoding) rebuild a handler, whatever its kind.
    """
    kwargs = dict(request_deserializer=request_deserializer or handler.request_deserializer,
                  response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary, False), **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream, True), **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary, False), **kwargs)
    return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream, True), **kwargs)


@dataclass(frozen=True, slots=True)
class _Undecodable:
    """What the request deserializer hands on when a payload is not a valid message of the RPC's type."""

    message: str


def _tolerant(deserializer):
    """``deserializer``, answering :class:`_Undecodable` instead of raising (gRPC would answer UNKNOWN)."""
    if deserializer is None:
        return None
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    type_name = descriptor.full_name if descriptor is not None else "the request type"

    def decode(raw: bytes):
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - any decoding failure is the caller's malformed payload
            return _Undecodable(f"request is not a valid {type_name} ({exc.__class__.__name__}: "
                                f"{str(exc).split(': ')[-1] or 'malformed'})")

    return decode


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Undecodable protobuf payloads answer INVALID_ARGUMENT naming the expected type (unary and streaming
    requests alike), instead of gRPC's UNKNOWN with an exception class name and a logged traceback.

    It is the innermost interceptor, so the handler it wraps is the registered one: the wrapped handler is
    built once per method and reused (nothing in it depends on the call)."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None or not details.method.startswith("/kvmesh."):
            return handler  # health and reflection are grpc's own (and reflection iterates requests synchronously)
        found = self._wrapped.get(details.method)
        if found is not None and found[0] is handler:
            return found[1]
        if handler.request_streaming:
            wrap = _check_each_request
        else:
            wrap = _check_stream_response if handler.response_streaming else _check_unary
        wrapped = rewrap_handler(handler, lambda behavior, _: wrap(behavior),
                                 request_deserializer=_tolerant(handler.request_deserializer))
        self._wrapped[details.method] = (handler, wrapped)
        return wrapped


def _check_unary(behavior):
    async def unary(request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behavior(request, context)

    return unary


def _check_stream_response(behavior):
    async def stream(request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        async for item in behavior(request, context):
            yield item

    return stream


def _check_each_request(behavior):
    async def checked(requests, context):
        async for request in requests:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            yield request

    def call(requests, context):
        return behavior(checked(requests, context), context)

    return call


CallOwner = Callable[[grpc.aio.ServicerContext], "str | None"]


class InFlightLimit(grpc.aio.ServerInterceptor):
    """At most ``limit`` calls of one caller served at once (a streaming call counts until it ends); the next
    answers RESOURCE_EXHAUSTED at once. Without it one key holder could keep any number of large requests in
    flight (a 64 MiB message costs ~150 MiB while it is served) and crowd out every other caller.

    ``owner(context)``: who the call counts against (its authenticated key), None for calls nobody is charged
    for. It is read when the handler starts, so this interceptor comes after the one that authenticates (whose
    handler wrapper sets the caller). Health and reflection are not limited. Threading: one event loop."""

    def __init__(self, limit: int, owner: CallOwner, setting: str) -> None:
        """``setting``: the configuration field that sets ``limit`` (named in the refusal)."""
        self._limit = limit
        self._owner = owner
        self._setting = setting
        self._in_flight: dict[str, int] = {}
        # Nothing of a wrapped handler depends on the call (the owner is read when it runs): built once per method.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith("/kvmesh."):
            return handler
        found = self._wrapped.get(details.method)
        if found is not None and found[0] is handler:
            return found[1]
        wrapped = rewrap_handler(handler, self._limited)
        self._wrapped[details.method] = (handler, wrapped)
        return wrapped

    async def _enter(self, context) -> str | None:
        owner = self._owner(context)
        if owner is None:
            return None
        count = self._in_flight.get(owner, 0)
        if count >= self._limit:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the calling key already has {count} calls in flight here, the most one key may "
                                f"have ({self._setting}); retry once some have ended")
        self._in_flight[owner] = count + 1
        return owner

    def _leave(self, owner: str | None) -> None:
        if owner is None:
            return
        left = self._in_flight[owner] - 1
        if left:
            self._in_flight[owner] = left
        else:
            del self._in_flight[owner]

    def _limited(self, behavior, streaming: bool):
        if streaming:
            async def stream(request, context):
                owner = await self._enter(context)
                try:
                    async for item in behavior(request, context):
                        yield item
                finally:
                    self._leave(owner)

            return stream

        async def unary(request, context):
            owner = await self._enter(context)
            try:
                return await behavior(request, context)
            finally:
                self._leave(owner)

        return unary


async def wait_for_signal() -> None:
    """Returns on SIGINT or SIGTERM (a service's main loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


KEEPALIVE_MS = 2_000
# A connection that has not finished its TLS handshake and HTTP/2 preface by then is closed (gRPC's default, 120 s,
# let anyone who reaches the port hold one of the service's file descriptors per connection for two minutes).
HANDSHAKE_TIMEOUT_MS = 10_000


def channel_options() -> list[tuple[str, int]]:
    """Every client channel: message limits, and HTTP/2 keepalive pings, so a connection whose packets are
    dropped (a partition, a peer frozen or gone without a FIN) is declared dead within ~2 x KEEPALIVE_MS and
    the next call reconnects, instead of waiting out TCP retransmission backoff (measured: > 10 s after a
    partition healed, `kvmesh bench faults`). Reconnect attempts back off to at most KEEPALIVE_MS (gRPC's default
    grows to 120 s), so a long-lived channel is usable again within ~2 s of its server coming back."""
    return [
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", KEEPALIVE_MS),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options() -> list[tuple[str, int]]:
    """Every server: message limits, it accepts the clients' keepalive pings (the default would answer
    pings more often than every 5 minutes with GOAWAY "too_many_pings"), and it binds its port exclusively
    (no SO_REUSEPORT, which gRPC sets by default): a second process cannot bind a port a live one holds, so
    a new incarnation answering at a data plane's address proves the old one exited (data_plane.reclaim)."""
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def check_can_bind(address: str) -> None:
    """Raises a domain error naming ``address`` when it cannot be bound (gRPC's own failure is a RuntimeError
    and a log line of its core on stderr)."""
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise errors.InvalidArgument(f"listen address {address!r} is not host:port; give e.g. 127.0.0.1:50051")
    if int(port) == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise errors.InvalidArgument(f"cannot listen on {address}: {exc.strerror}; give a local host name or "
                                     "address") from None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: TIME_WAIT is no conflict
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                raise errors.Unavailable(f"cannot listen on {address}: {exc.strerror}; pick another port (the "
                                         "listen setting) or stop the process that holds it") from None


async def start_server(
    address: str,
    services: Sequence[ServiceBinding],
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    tls: ServerTLS | None = None,
    in_flight: InFlightLimit | None = None,
) -> RunningServer:
    """Start an aio server on ``address`` ("host:port", port 0 picks a free one).

    Tracing (kvmesh.tracing, from env) wraps every other interceptor, so a denied call is traced too;
    health probes and reflection are not traced. ``in_flight`` comes after ``interceptors`` (it charges the
    caller the authenticating one among them established). The :class:`DecodeGuard` is innermost: a request
    that is not a valid message reaches no servicer and answers INVALID_ARGUMENT.
    """
    traced = tracing.server_interceptors(services[0].full_name if services else "kvmesh")
    limited = [in_flight] if in_flight is not None else []
    server = grpc.aio.server(interceptors=[*traced, *interceptors, *limited, DecodeGuard()],
                             options=server_options())
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    for binding in services:
        binding.add_to_server(binding.servicer, server)
        names.append(binding.full_name)
    reflection.enable_server_reflection(names, server)
    check_can_bind(address)
    try:
        port = server.add_insecure_port(address) if tls is None else server.add_secure_port(address, tls.credentials())
    except RuntimeError:  # "Failed to bind": taken between the check and here
        port = 0
    if port == 0:
        raise errors.Unavailable(f"cannot listen on {address}: address in use or not local; pick another port "
                                 "(the listen setting) or stop the process that holds it")
    await server.start()
    for binding in services:
        await health.set(binding.full_name, health_pb2.HealthCheckResponse.SERVING)
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server=server, port=port, health=health)
