"""Client channels to kvmesh services: credentials and trace context in metadata, optional (mutual) TLS.

Every kvmesh RPC carries ``authorization: Bearer <key>``; :func:`channel` adds it
to each call so client code never has to. With ``tls`` the channel verifies the
server against a CA and, for mutual TLS, presents a client certificate.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from kvmesh import tracing
from kvmesh.grpc_server import channel_options, tls_files


@dataclass(frozen=True)
class ClientTLS:
    ca_file: str
    cert_file: str | None = None  # mutual TLS: this client's certificate ...
    key_file: str | None = None  # ... and its private key
    server_name: str | None = None  # override the name checked in the server certificate

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC's credentials, from the files read now and checked (kvmesh.grpc_server.tls_files): a missing,
        non-PEM or mismatched one is a ValueError naming its setting (``tls_ca_file``, ``tls_cert_file``,
        ``tls_key_file``, the ``--tls-*`` flags) and the file, before any connection is tried."""
        ca, key, cert = tls_files(self.cert_file, self.key_file, self.ca_file, ca_setting="tls_ca_file")
        return grpc.ssl_channel_credentials(ca, key, cert)

    def options(self, options: list) -> list:
        """Channel ``options`` plus the server-name override, if any."""
        return [*options, ("grpc.ssl_target_name_override", self.server_name)] if self.server_name else options


class _Bearer:
    def __init__(self, key: str) -> None:
        self._pair = ("authorization", f"Bearer {key}")

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        if "authorization" not in metadata:
            metadata.add(*self._pair)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


# grpc.aio files each interceptor under the first of the four kinds it is, so one class per kind.
class _UnaryUnary(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _UnaryStream(_Bearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamUnary(_Bearer, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_Bearer, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def channel(address: str, key: str | None, tls: ClientTLS | None = None) -> grpc.aio.Channel:
    """An asyncio channel to ``address`` that authenticates every call with ``key``.

    When tracing is on (kvmesh.tracing), each call also carries the caller's W3C trace context.
    """
    interceptors = [cls(key) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)] if key else []
    interceptors += tracing.client_interceptors()
    options = channel_options()
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, tls.credentials(), options=tls.options(options),
                                   interceptors=interceptors)
