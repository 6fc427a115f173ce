"""One key's requests take a bounded share of a server's memory (found by probing a `kvmesh up` fleet with one
node's key: 32 concurrent 55 MiB lookups grew the control plane by 5.8 GiB, 256 concurrent 13 MiB ones by 8.5 GiB;
tests/security/blackbox_probe.py, ``probe_request_memory``, measures it on a whole fleet).

Every request is read only once its call is admitted (kvmesh.request_gate): a call sets aside
``max_request_bytes`` of its key's ``max_request_bytes_in_flight_per_key`` before its message is read, a request
stream holds that much for its whole life, and a call that finds no room waits behind the key's earlier calls,
then is refused; a larger message is refused by gRPC as it arrives. Real control plane (in this process), real
Valkey. Each refusal has its positive control: another key is served meanwhile, and the key itself once room is
free.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvmesh import request_gate
from kvmesh.channels import channel
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh.v1 import control_plane_pb2 as pb

MIB = 2**20
BLOCK = bytes(range(32))


def ns(tenant: str) -> Namespace:
    return Namespace(tenant, "m", "r", CacheConfig(block_size=32))


def lookup(tenant: str) -> pb.LookupPrefixRequest:
    return pb.LookupPrefixRequest(namespace=ns(tenant).to_proto(), block_hashes=[BLOCK])


@pytest.fixture
def cp_config(redis_server, key_prefix, admin_key):
    from control_plane.config import ControlPlaneConfig

    # Room for two requests per key: two open request streams fill it.
    return ControlPlaneConfig(listen="127.0.0.1:0", redis_url=redis_server.url, key_prefix=key_prefix,
                              lease_ms=60_000, admin_key=admin_key, policy_ttl_s=0, max_request_bytes=MIB,
                              max_request_bytes_in_flight_per_key=2 * MIB)


@pytest.fixture
def short_wait(monkeypatch):
    monkeypatch.setattr(request_gate, "REQUEST_WAIT_S", 0.5)


async def keys(fleet):
    await fleet.tenant("a")
    await fleet.tenant("b")
    _, a_key = await fleet.key("scheduler", tenant_id="a")
    _, b_key = await fleet.key("scheduler", tenant_id="b")
    return fleet.cp(a_key), fleet.cp(b_key)


async def test_open_request_streams_take_their_share_and_a_call_past_it_waits_then_is_refused(fleet, short_wait):
    a, b = await keys(fleet)
    streams = [a.LookupPrefixStream() for _ in range(2)]
    for stream in streams:  # each answers, so each is admitted and holds 1 MiB of a's 2 MiB
        await stream.write(lookup("a"))
        assert (await stream.read()).holders is not None
    third = a.LookupPrefixStream()
    await third.write(lookup("a"))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await third.read()
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_request_bytes_in_flight_per_key" in refused.value.details()
    assert "\n" not in refused.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as waited:
        await a.LookupPrefix(lookup("a"), timeout=10)
    assert waited.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "no room was free for 0.5 s" in waited.value.details(), waited.value.details()
    # Positive controls: another key is served meanwhile; a's call once one of its streams ends.
    await b.LookupPrefix(lookup("b"), timeout=10)
    waiting = asyncio.ensure_future(a.LookupPrefix(lookup("a"), timeout=10))
    await asyncio.sleep(0.1)
    assert not waiting.done()  # it waits for room rather than being refused at once
    await streams[0].done_writing()
    async for _ in streams[0]:
        pass
    await asyncio.wait_for(waiting, 5)
    streams[1].cancel()


async def test_a_request_larger_than_max_request_bytes_is_refused_as_it_arrives(fleet):
    a, _ = await keys(fleet)
    big = pb.LookupPrefixRequest(namespace=ns("a").to_proto(), block_hashes=[bytes(32)] * 40_000)  # ~1.3 MiB
    assert big.ByteSize() > MIB
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await a.LookupPrefix(big, timeout=10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in refused.value.details()
    # Control: the same request cut under the limit is read, and refused for its content in one line.
    under = pb.LookupPrefixRequest(namespace=ns("a").to_proto(), block_hashes=[bytes(32)] * 30_000)
    assert (await a.LookupPrefix(under, timeout=10)).holders is not None


async def test_a_call_waiting_for_room_is_served_in_turn_and_no_room_leaks(fleet):
    """Many concurrent small calls of one key (a router): none is refused, and afterwards the key's whole share
    is free again (two streams are admitted)."""
    a, _ = await keys(fleet)
    answers = await asyncio.gather(*(a.LookupPrefix(lookup("a"), timeout=30) for _ in range(64)))
    assert len(answers) == 64
    streams = [a.LookupPrefixStream() for _ in range(2)]
    for stream in streams:
        await stream.write(lookup("a"))
        await stream.read()
        stream.cancel()


async def test_a_sender_that_stalls_before_its_message_holds_its_room_for_a_bounded_time(fleet, monkeypatch,
                                                                                          caplog):
    """A caller opens a unary call and sends nothing (what a sender stalled mid-message looks like to the
    handler): the call is answered DEADLINE_EXCEEDED once REQUEST_READ_S has passed, and its room is free again.
    A call that ends without any message answers INVALID_ARGUMENT."""
    monkeypatch.setattr(request_gate, "REQUEST_READ_S", 0.5)
    await fleet.tenant("a")
    _, a_key = await fleet.key("scheduler", tenant_id="a")
    async with channel(fleet.address, a_key) as ch:
        # The unary method called as a request stream: the client decides when (and whether) a message goes.
        as_stream = ch.stream_unary("/kvmesh.v1.ControlPlane/LookupPrefix",
                                    request_serializer=pb.LookupPrefixRequest.SerializeToString,
                                    response_deserializer=pb.LookupPrefixResponse.FromString)
        stalled = as_stream()
        with pytest.raises(grpc.aio.AioRpcError) as timed_out:
            await asyncio.wait_for(stalled, 10)
        assert timed_out.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "did not arrive within 0.5 s" in timed_out.value.details()
        empty = as_stream()
        await empty.done_writing()
        with pytest.raises(grpc.aio.AioRpcError) as no_message:
            await empty
        assert no_message.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert no_message.value.details() == "the call carried no request message"
        # Control: the same call with its message is served, and so are two streams (the key's whole share).
        sent = as_stream()
        await sent.write(lookup("a"))
        await sent.done_writing()
        assert (await sent).holders is not None
    a = fleet.cp(a_key)
    streams = [a.LookupPrefixStream() for _ in range(2)]
    for stream in streams:
        await stream.write(lookup("a"))
        await stream.read()
        stream.cancel()
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text[-2000:]
