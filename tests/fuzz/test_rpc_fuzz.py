"""Every RPC of every service, fed requests drawn from its proto schema and undecodable payloads.

Each answer must be a documented status with a clear message (never INTERNAL or UNKNOWN), client errors leave
no traceback in the logs, the services keep running and health stays SERVING.
"""

from __future__ import annotations

import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.v1 import common_pb2, control_plane_pb2, data_plane_pb2, tenant_admin_pb2
from tests.fuzz.conftest import BLOCK_BYTES, TENANT
from tests.fuzz.proto_strategies import message, plausible_namespace

SERVICES = {
    "kvmesh.v1.ControlPlane": control_plane_pb2,
    "kvmesh.v1.TenantAdmin": tenant_admin_pb2,
    "kvmesh.v1.DataPlane": data_plane_pb2,
}
METHODS = [(svc, m) for svc, mod in SERVICES.items() for m in mod.DESCRIPTOR.services_by_name[svc.split(".")[-1]].methods]
# Statuses a servicer may answer; INTERNAL, UNKNOWN, DATA_LOSS, UNIMPLEMENTED are bugs here.
DOCUMENTED = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.OUT_OF_RANGE,
}
FUZZ = settings(max_examples=25, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])
HINTS = {
    "namespace": plausible_namespace(TENANT),
    "tenant": st.just(TENANT), "tenant_id": st.just(TENANT),
    "block_bytes": st.just(BLOCK_BYTES),
    "node_id": st.sampled_from(["fuzz-node", "fuzz-peer"]),
    "source_node_id": st.just("fuzz-peer"),
    "source_address": st.sampled_from(["127.0.0.1:1", "127.0.0.1:0", "[::1]:1"]),
    "block_hashes": st.lists(st.binary(min_size=32, max_size=32), min_size=1, max_size=4),
    "timeout_ms": st.integers(0, 400),
    "grant": st.one_of(st.binary(max_size=40), st.text(max_size=40).map(str.encode)),
}


class Tracebacks(logging.Handler):
    """Collects log records that carry a traceback (a client error must leave none)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or "Traceback" in record.getMessage():
            self.records.append(record)


TRACEBACKS = Tracebacks()


@pytest.fixture(scope="module")
def tracebacks():
    handler = TRACEBACKS
    logging.getLogger().addHandler(handler)
    yield handler
    logging.getLogger().removeHandler(handler)


@pytest.fixture(scope="module")
def channels(services):
    opened = {"cp": grpc.insecure_channel(services.cp_address), "dp": grpc.insecure_channel(services.dp_address)}
    yield opened
    for ch in opened.values():
        ch.close()


def _identity(b: bytes) -> bytes:
    return b


def _call(channel: grpc.Channel, path: str, streaming: bool, payloads: list[bytes], metadata) -> tuple:
    """(status code, details) of one call with already-serialized payloads."""
    TRACEBACKS.records.clear()
    try:
        if streaming:
            call = channel.stream_stream(path, request_serializer=_identity, response_deserializer=_identity)
            for _ in call(iter(payloads), metadata=metadata, timeout=15):
                pass
        else:
            channel.unary_unary(path, request_serializer=_identity, response_deserializer=_identity)(
                payloads[0], metadata=metadata, timeout=15)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def _check(code, details: str, what: str, tracebacks: Tracebacks) -> None:
    assert code in DOCUMENTED, f"{what}: {code} {details!r}"
    if code != grpc.StatusCode.OK:
        assert details and details != "internal error" and "Traceback" not in details, f"{what}: {details!r}"
        assert "Exception" not in details and "Error'>" not in details, f"{what}: {details!r}"
    logged, tracebacks.records = tracebacks.records, []
    assert not logged, f"{what}: traceback logged: {logged[0].getMessage()}"


def _credentials(services, service: str) -> st.SearchStrategy:
    if service == "kvmesh.v1.DataPlane":
        peer = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=60).map(
            lambda g: (("authorization", f"Bearer {services.peer_key}"), ("kvmesh-grant", g)))
        return st.one_of(st.just((("authorization", f"Bearer {services.node_key}"),)), peer)
    return st.sampled_from([(("authorization", f"Bearer {services.admin_key}"),),
                            (("authorization", f"Bearer {services.node_key}"),)])


@pytest.mark.parametrize("service,method", METHODS, ids=[f"{s.split('.')[-1]}.{m.name}" for s, m in METHODS])
@FUZZ
@given(data=st.data())
def test_schema_requests_get_documented_statuses(services, channels, tracebacks, service, method, data):
    requests = st.one_of(message(method.input_type, HINTS), message(method.input_type, HINTS, plausible=True))
    payloads = data.draw(st.lists(requests, min_size=1, max_size=3) if method.client_streaming
                         else requests.map(lambda m: [m]))
    metadata = data.draw(_credentials(services, service))
    channel = channels["dp" if service == "kvmesh.v1.DataPlane" else "cp"]
    code, details = _call(channel, f"/{service}/{method.name}", method.server_streaming,
                          [p.SerializeToString() for p in payloads], metadata)
    _check(code, details, f"{method.full_name}({payloads})", tracebacks)


@pytest.mark.parametrize("service,method", METHODS, ids=[f"{s.split('.')[-1]}.{m.name}" for s, m in METHODS])
@FUZZ
@given(data=st.data())
def test_undecodable_payloads_are_invalid_argument(services, channels, tracebacks, service, method, data):
    payload = data.draw(st.binary(min_size=1, max_size=64))
    metadata = data.draw(_credentials(services, service))
    channel = channels["dp" if service == "kvmesh.v1.DataPlane" else "cp"]
    code, details = _call(channel, f"/{service}/{method.name}", method.server_streaming, [payload], metadata)
    _check(code, details, f"{method.full_name}({payload!r})", tracebacks)


@pytest.mark.parametrize("service,method", METHODS, ids=[f"{s.split('.')[-1]}.{m.name}" for s, m in METHODS])
def test_a_truncated_message_names_its_type(services, channels, tracebacks, service, method):
    """Negative control of the decoders: field 1 claims 127 bytes and the payload ends."""
    metadata = (("authorization", f"Bearer {services.node_key if 'Data' in service else services.admin_key}"),)
    channel = channels["dp" if service == "kvmesh.v1.DataPlane" else "cp"]
    code, details = _call(channel, f"/{service}/{method.name}", method.server_streaming, [b"\x0a\x7f\x01"], metadata)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert method.input_type.full_name in details, details
    _check(code, details, method.full_name, tracebacks)


def test_health_stays_serving(services, channels):
    for name, ch in channels.items():
        health = health_pb2_grpc.HealthStub(ch)
        services_to_check = [""] + ([*SERVICES][:2] if name == "cp" else ["kvmesh.v1.DataPlane"])
        for svc in services_to_check:
            status = health.Check(health_pb2.HealthCheckRequest(service=svc), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING, (name, svc)
    ping = channels["dp"].unary_unary("/kvmesh.v1.DataPlane/Ping", request_serializer=_identity,
                                      response_deserializer=_identity)
    ping(common_pb2.PingRequest().SerializeToString(),
         metadata=(("authorization", f"Bearer {services.node_key}"),), timeout=10)


def _pull(services, channels, grant: bytes, address: str = "127.0.0.1:1"):
    request = data_plane_pb2.PullRequest(
        namespace=common_pb2.Namespace(tenant=TENANT, model="m", weight_version="v1",
                                       cache_config=common_pb2.CacheConfig(block_size=32)),
        block_hashes=[bytes(32)], source_node_id="fuzz-peer", source_address=address, timeout_ms=300, grant=grant)
    return _call(channels["dp"], "/kvmesh.v1.DataPlane/Pull", False, [request.SerializeToString()],
                 (("authorization", f"Bearer {services.node_key}"),))


@pytest.mark.parametrize("grant", [b"\xff\xfe", b"abc\ndef", b"tok\x00en", "é".encode()],
                         ids=["non-utf8", "newline", "nul", "non-ascii"])
def test_a_malformed_grant_is_invalid_argument(services, channels, tracebacks, grant):
    code, details = _pull(services, channels, grant)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "grant" in details, (code, details)
    _check(code, details, "Pull", tracebacks)


def test_a_well_formed_grant_reaches_the_source(services, channels, tracebacks):
    """Positive control: a printable grant passes validation; the unreachable source makes the pull a MISS."""
    code, details = _pull(services, channels, b"eyJ0.c2ln")
    assert code == grpc.StatusCode.OK, (code, details)
    _check(code, details, "Pull", tracebacks)


def test_garbage_agent_metadata_is_invalid_argument(services, channels, tracebacks):
    request = data_plane_pb2.ExchangeAgentMetadataRequest(node_id="fuzz-peer", agent_metadata=b"\x00garbage",
                                                          block_bytes=BLOCK_BYTES)
    code, details = _call(channels["dp"], "/kvmesh.v1.DataPlane/ExchangeAgentMetadata", False,
                          [request.SerializeToString()], (("authorization", f"Bearer {services.node_key}"),))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "agent_metadata" in details, (code, details)
    _check(code, details, "ExchangeAgentMetadata", tracebacks)
