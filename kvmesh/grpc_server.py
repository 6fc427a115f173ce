"""The one place gRPC servers are built: services, health, reflection, interceptors.

Every kvmesh service starts through :func:`start_server`, so cross-cutting
behaviour (authentication, tracing, metrics) is composed here and nowhere else.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import grpc
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvmesh import errors, tracing
from kvmesh.request_gate import InFlightLimit, RequestGate

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Connections a server holds at once, unless its config says otherwise; past it a new one is closed as it arrives.
MAX_CONNECTIONS = 4096
# Descriptors kept for everything else a service opens (Redis connections, files, NIXL) when fitting the cap.
SPARE_DESCRIPTORS = 1024

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServiceBinding:
    """A servicer, the generated function that adds it, and its full name."""

    servicer: Any
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    full_name: str  # e.g. "kvmesh.v1.ControlPlane"


_CERT_FIX = "give the PEM certificate `kvmesh up` wrote (<workdir>/tls/*.crt; compose: tls.crt) or one your CA issued"
_CA_FIX = "give the CA's PEM certificate (`kvmesh up`: <workdir>/tls/ca.crt; compose: ca.crt)"
_KEY_FIX = "give the PEM private key written with the certificate (`kvmesh up`: <workdir>/tls/*.key; compose: tls.key)"


def _named(setting: str, path: str) -> str:
    """How a TLS file is named in an error: the setting, its flag and the path (``tls_cert_file
    (--tls-cert-file) /x/cert.pem``); the environment variable is the setting's name with the service's prefix."""
    return f"{setting} (--{setting.replace('_', '-')}) {path}"


def _certificates(path: str, setting: str, fix: str) -> tuple[bytes, list[x509.Certificate]]:
    """The PEM bytes of ``path`` and the certificates in them; ValueError naming ``setting`` when there is none
    (an unreadable file raises its OSError, which names the file)."""
    data = Path(path).read_bytes()
    try:
        return data, x509.load_pem_x509_certificates(data)
    except (ValueError, UnsupportedAlgorithm):
        raise ValueError(f"{_named(setting, path)}: not a PEM certificate; {fix}") from None


def _ca_bundle(path: str, setting: str) -> bytes:
    """A CA file's bytes, if it holds a PEM certificate block: not parsed further (a bundle may hold certificates
    this library refuses, or OpenSSL's TRUSTED CERTIFICATE blocks, that gRPC reads)."""
    data = Path(path).read_bytes()
    if b"-----BEGIN " not in data or b"CERTIFICATE-----" not in data:
        raise ValueError(f"{_named(setting, path)}: not a PEM certificate; {_CA_FIX}")
    return data


def _private_key(path: str, setting: str):
    data = Path(path).read_bytes()
    try:
        return data, serialization.load_pem_private_key(data, password=None)
    except TypeError:  # "Password was not given but private key is encrypted"
        raise ValueError(f"{_named(setting, path)}: the private key is encrypted; gRPC cannot ask for its "
                         "passphrase, give it unencrypted (e.g. `openssl pkey -in KEY -out KEY.plain`)") from None
    except (ValueError, UnsupportedAlgorithm):
        raise ValueError(f"{_named(setting, path)}: not a PEM private key; {_KEY_FIX}") from None


def _public(key) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def tls_files(cert_file: str | None, key_file: str | None, ca_file: str | None, *, ca_setting: str,
              cert_setting: str = "tls_cert_file", key_setting: str = "tls_key_file",
              ) -> tuple[bytes | None, bytes | None, bytes | None]:
    """The PEM bytes ``(ca, key, cert)`` of a party's TLS files (None: not given), each checked before gRPC sees it
    (gRPC's own failure is a few lines of its core on stderr and a refused port or handshake, that blame the
    address): the CA file holds certificates, the certificate file a certificate (its chain), the key file an
    unencrypted private key, and that key is the one of the (first) certificate. ValueError names the setting,
    its flag and the file; the certificate and the key go together (one without the other is refused too).
    The one place both sides check their files: :class:`ServerTLS` and kvmesh.channels.ClientTLS."""
    if bool(cert_file) != bool(key_file):
        raise ValueError(f"{_named(cert_setting, cert_file or 'unset')} and {_named(key_setting, key_file or 'unset')}"
                         ": a certificate and its private key go together; give both, or neither")
    ca = _ca_bundle(ca_file, ca_setting) if ca_file else None
    if not (cert_file and key_file):
        return ca, None, None
    cert, certs = _certificates(cert_file, cert_setting, _CERT_FIX)
    key, private = _private_key(key_file, key_setting)
    try:
        matches = _public(private.public_key()) == _public(certs[0].public_key())
    except (ValueError, TypeError, UnsupportedAlgorithm):
        matches = False
    if not matches:
        raise ValueError(f"{_named(key_setting, key_file)} is not the private key of "
                         f"{_named(cert_setting, cert_file)}; give the key written with that certificate (e.g. "
                         "admin.key with admin.crt, tls.key with tls.crt)")
    return ca, key, cert


@dataclass(frozen=True)
class ServerTLS:
    """TLS for a server; with ``client_ca_file``, mutual TLS (clients must present a certificate it signed)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        """gRPC's credentials, from the files read now and checked (:func:`tls_files`: ValueError naming a bad
        one)."""
        ca, key, cert = tls_files(self.cert_file, self.key_file, self.client_ca_file,
                                  ca_setting="tls_client_ca_file")
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def server_tls(cert_file: str | None, key_file: str | None, client_ca_file: str | None) -> ServerTLS | None:
    """A ServerTLS from optional settings: none, or cert and key (and optionally a client CA), whose files are
    read and checked now (a missing, unreadable, non-PEM or mismatched one fails a service's start before anything
    runs, in one line naming the setting and the file: :func:`tls_files`)."""
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


async def wait_for_signal() -> None:
    """Returns on SIGINT or SIGTERM (a service's main loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


KEEPALIVE_MS = 2_000
# A ping unanswered this long ends its connection (a frozen peer); more than KEEPALIVE_MS, so that a server on a
# machine the engines keep busy is not dropped for answering late.
PING_TIMEOUT_MS = 5_000
# A connection that has not finished its TLS handshake and HTTP/2 preface by then is closed (gRPC's default, 120 s,
# let anyone who reaches the port hold one of the service's file descriptors per connection for two minutes).
HANDSHAKE_TIMEOUT_MS = 10_000
# A connection with no call in progress for this long is closed (GOAWAY; the client reconnects at its next call):
# without it, a key holder's connections that never call stayed open for good, one descriptor and ~66 KiB each.
IDLE_CONNECTION_MS = 60_000


def channel_options() -> list[tuple[str, int]]:
    """Every client channel: message limits, and HTTP/2 keepalive pings, so a connection whose packets are
    dropped (a partition, a peer frozen or gone without a FIN) is declared dead within KEEPALIVE_MS +
    PING_TIMEOUT_MS (~7 s) and the next call reconnects, instead of waiting out TCP retransmission backoff
    (measured: > 10 s after a partition healed, `kvmesh bench faults`). Reconnect attempts back off to at most
    KEEPALIVE_MS (gRPC's default grows to 120 s), so a long-lived channel is usable again within ~2 s of its
    server coming back."""
    return [
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", KEEPALIVE_MS),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", PING_TIMEOUT_MS),  # gRPC's own watchdog on a ping: the same bound
        # how long a ping waits for its answer: keepalive_timeout_ms alone left it at gRPC's 60 s (measured: a call
        # with no deadline on an open channel to a frozen server failed after 60 s; ~7 s with this)
        ("grpc.http2.ping_timeout_ms", PING_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(max_request_bytes: int = MAX_MESSAGE_BYTES,
                   max_connections: int = MAX_CONNECTIONS) -> list[tuple[str, int]]:
    """Every server: message limits, at most ``max_connections`` connections (past it a new one is closed as it
    arrives), idle ones closed, it accepts the clients' keepalive pings (the default would answer
    pings more often than every 5 minutes with GOAWAY "too_many_pings"), and it binds its port exclusively
    (no SO_REUSEPORT, which gRPC sets by default): a second process cannot bind a port a live one holds, so
    a new incarnation answering at a data plane's address proves the old one exited (data_plane.reclaim)."""
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.max_connection_idle_ms", IDLE_CONNECTION_MS),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", max_request_bytes),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def fit_connections(max_connections: int) -> int:
    """The connection cap this process can keep: its descriptor limit is raised (up to the hard limit) to hold
    ``max_connections`` plus SPARE_DESCRIPTORS; where the hard limit is lower, the cap shrinks to fit it (logged),
    so that connections can never take the descriptors the service needs for Redis, files and peers."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + SPARE_DESCRIPTORS
    if soft != resource.RLIM_INFINITY and soft < need:
        soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    fitted = max_connections if soft == resource.RLIM_INFINITY else min(max_connections, soft - SPARE_DESCRIPTORS)
    if fitted < max_connections:
        log.warning("max_connections %d lowered to %d: this process may open %d files (ulimit -n); raise the "
                    "limit to serve more connections", max_connections, max(fitted, 1), soft)
    return max(fitted, 1)


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
    max_connections: int = MAX_CONNECTIONS,
) -> RunningServer:
    """Start an aio server on ``address`` ("host:port", port 0 picks a free one).

    Tracing (kvmesh.tracing, from env) wraps every other interceptor, so a denied call is traced too;
    health probes and reflection are not traced. The :class:`RequestGate` is innermost: it applies ``in_flight``
    (charging the caller the authenticating interceptor among ``interceptors`` established), reads each request
    only then, and a request that is not a valid message reaches no servicer and answers INVALID_ARGUMENT. A
    request larger than ``in_flight.max_request_bytes`` is refused by gRPC as it arrives (RESOURCE_EXHAUSTED).
    At most ``max_connections`` connections are held (:func:`fit_connections`), idle ones closed.
    """
    traced = tracing.server_interceptors(services[0].full_name if services else "kvmesh")
    max_request_bytes = in_flight.max_request_bytes if in_flight is not None else MAX_MESSAGE_BYTES
    gate = RequestGate(in_flight, max_request_bytes)
    server = grpc.aio.server(interceptors=[*traced, *interceptors, gate],
                             options=server_options(max_request_bytes, fit_connections(max_connections)))
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    for binding in services:
        binding.add_to_server(binding.servicer, server)
        names.append(binding.full_name)
    reflection.enable_server_reflection(names, server)
    gate.health_watches.services.update(["", *(binding.full_name for binding in services)])  # what health.set names
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
