"""OpenTelemetry tracing for every kvmesh process: one TracerProvider from env, gRPC interceptors.

A process configures tracing once, on first use (a server built by
:func:`kvmesh.grpc_server.start_server`, a channel from :func:`kvmesh.channels.channel`,
or the engine connector), from the environment:

| variable | meaning |
|---|---|
| ``KVMESH_TRACE_EXPORTER`` | ``none`` (default), ``otlp`` (OTLP/gRPC; ``OTEL_EXPORTER_OTLP_ENDPOINT`` etc. apply), ``console``, or ``file`` |
| ``KVMESH_TRACE_FILE`` | with ``file``: append one JSON object per finished span to this path (tests read it) |
| ``OTEL_SERVICE_NAME`` | the service name (default: what the process names itself, e.g. ``kvmesh.v1.DataPlane``) |

With ``none`` no provider is installed and no interceptor is added, so tracing costs nothing.
W3C trace context travels in gRPC metadata (``traceparent``): the client interceptor injects it,
the server interceptor continues the caller's trace. Health probes and reflection are never traced.

Span attributes kvmesh adds (beyond OpenTelemetry's ``rpc.*``): ``kvmesh.tenant``,
``kvmesh.namespace`` (namespace fingerprint), ``kvmesh.blocks``, ``kvmesh.bytes``,
``kvmesh.tier``, ``kvmesh.outcome``; :data:`ATTR` names them.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace

log = logging.getLogger(__name__)

EXPORTERS = ("none", "otlp", "console", "file")


class ATTR:
    TENANT = "kvmesh.tenant"
    NAMESPACE = "kvmesh.namespace"
    BLOCKS = "kvmesh.blocks"
    BYTES = "kvmesh.bytes"
    TIER = "kvmesh.tier"
    OUTCOME = "kvmesh.outcome"
    SOURCE_NODE = "kvmesh.source_node"
    REQUEST_ID = "kvmesh.request_id"


_lock = threading.Lock()
_configured: str | None = None  # the exporter in use once configured


def configure(service_name: str, exporter: str | None = None, file_path: str | None = None) -> bool:
    """Install this process's TracerProvider (first call wins); True when tracing is on.

    ``exporter`` and ``file_path`` default to ``KVMESH_TRACE_EXPORTER`` / ``KVMESH_TRACE_FILE``;
    ``OTEL_SERVICE_NAME`` overrides ``service_name``. An unknown exporter raises ``ValueError``.
    """
    global _configured
    with _lock:
        if _configured is not None:
            return _configured != "none"
        kind = (exporter or os.environ.get("KVMESH_TRACE_EXPORTER") or "none").strip().lower()
        if kind not in EXPORTERS:
            raise ValueError(f"KVMESH_TRACE_EXPORTER={kind!r}: choose one of {', '.join(EXPORTERS)}")
        if kind != "none":
            trace.set_tracer_provider(_provider(kind, os.environ.get("OTEL_SERVICE_NAME") or service_name,
                                                file_path or os.environ.get("KVMESH_TRACE_FILE")))
        _configured = kind
        return kind != "none"


def enabled(default_service_name: str = "kvmesh") -> bool:
    """Is tracing on in this process? Configures it from the environment if nobody did yet."""
    return configure(default_service_name) if _configured is None else _configured != "none"


def _provider(kind: str, service_name: str, file_path: str | None):
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name, "process.pid": os.getpid()}))
    if kind == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    elif kind == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    else:
        if not file_path:
            raise ValueError("KVMESH_TRACE_EXPORTER=file needs KVMESH_TRACE_FILE")
        # Simple (synchronous) processor: a process killed a moment later has still written its spans.
        provider.add_span_processor(SimpleSpanProcessor(JsonFileExporter(file_path)))
    return provider


class JsonFileExporter:
    """Appends one JSON object per span to a file (several processes may share it: O_APPEND lines)."""

    def __init__(self, path: str) -> None:
        self._path = path

    def export(self, spans) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = []
        for span in spans:
            parent = span.parent
            lines.append(json.dumps({
                "name": span.name,
                "service": span.resource.attributes.get("service.name", ""),
                "pid": span.resource.attributes.get("process.pid", 0),
                "trace_id": format(span.context.trace_id, "032x"),
                "span_id": format(span.context.span_id, "016x"),
                "parent_id": format(parent.span_id, "016x") if parent else "",
                "kind": span.kind.name,
                "status": span.status.status_code.name,
                "start_ns": span.start_time,
                "end_ns": span.end_time,
                "attributes": {k: v if isinstance(v, (str, int, float, bool)) else list(v)
                               for k, v in (span.attributes or {}).items()},
                "links": [{"trace_id": format(link.context.trace_id, "032x"),
                           "span_id": format(link.context.span_id, "016x")} for link in span.links or ()],
            }))
        with open(self._path, "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def tracer(name: str = "kvmesh") -> trace.Tracer:
    return trace.get_tracer(name)


def _not_probe():
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(filters.any_of(filters.health_check(), filters.service_prefix("grpc.reflection.")))


def server_interceptors(service_name: str) -> list:
    """The tracing interceptor for a server (empty when tracing is off)."""
    if not enabled(service_name):
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(filter_=_not_probe())]


def client_interceptors() -> list:
    """The tracing interceptors for a client channel (empty when tracing is off)."""
    if not enabled():
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors(filter_=_not_probe(), request_hook=_request_attributes))


def _request_attributes(span, request) -> None:
    """Namespace and block count of any kvmesh request that carries them."""
    if not span.is_recording():
        return
    ns = getattr(request, "namespace", None)
    if ns is not None and ns.tenant:
        span.set_attribute(ATTR.TENANT, ns.tenant)
        try:
            from kvmesh.namespace import Namespace

            span.set_attribute(ATTR.NAMESPACE, Namespace.from_proto(ns).fingerprint)
        except Exception:  # noqa: BLE001 - a malformed namespace is the server's to reject
            pass
    hashes = getattr(request, "block_hashes", None)
    if hashes is not None:
        span.set_attribute(ATTR.BLOCKS, len(hashes))


def current_context():
    return otel_context.get_current()


async def run_in_context(ctx, coro):
    """Await ``coro`` under OpenTelemetry context ``ctx`` (taken in another thread)."""
    token = otel_context.attach(ctx)
    try:
        return await coro
    finally:
        otel_context.detach(token)


def set_attributes(span: trace.Span, attributes: dict[str, Any]) -> None:
    for key, value in attributes.items():
        if value is not None:
            span.set_attribute(key, value)


def shutdown() -> None:
    """Flush and stop the provider (at process exit; safe when tracing is off)."""
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


__all__: Sequence[str] = ("ATTR", "configure", "enabled", "tracer", "server_interceptors", "client_interceptors",
                          "run_in_context", "current_context", "set_attributes", "shutdown", "JsonFileExporter")
