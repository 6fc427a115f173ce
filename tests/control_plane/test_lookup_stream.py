"""LookupPrefixStream and LookupPrefixBatches on a real server and a real Redis: the unary lookup's answers, in
request order, on one stream; a failed lookup ends the stream with its status; packed_block_hashes answers as
block_hashes and its bad forms are INVALID_ARGUMENT; the scheduler client's shared stream."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvmesh.hashing import BlockHasher, Extras
from kvmesh.namespace import Namespace
from kvmesh.v1 import common_pb2, control_plane_pb2 as pb

from control_plane.model import Medium
from control_plane.scheduler_client import SchedulerClient
from tests.control_plane.test_service import hashes, ns_pb, register, stored_batch

TOKENS = list(range(5000, 5000 + 32 * 12))


async def publish_fleet(stub) -> list[bytes]:
    """Three nodes holding different prefixes of one prompt on different tiers; returns its block hashes."""
    hs = BlockHasher().block_hashes(TOKENS, 32, Extras())
    for i, (n, medium) in enumerate([(12, common_pb2.MEDIUM_CPU), (7, common_pb2.MEDIUM_GPU),
                                     (3, common_pb2.MEDIUM_DISK)]):
        node_id = f"node-{i}"
        inc = await register(stub, node_id, f"127.0.0.1:{7001 + i}")
        ack = await stub.PublishEvents(stored_batch(node_id, inc, 1, hs[:n], medium=medium))
        assert ack.status == pb.ACK_STATUS_APPLIED
    return hs


def queries(hs: list[bytes]) -> list[pb.LookupPrefixRequest]:
    """Lookups whose answers differ: by hashes and by tokens, cut at each length, per tier, salted, absent."""
    out = [pb.LookupPrefixRequest(namespace=ns_pb(), block_hashes=hs[:n]) for n in (1, 3, 5, 7, 9, 12)]
    out += [pb.LookupPrefixRequest(namespace=ns_pb(), token_ids=TOKENS[:32 * n + 5]) for n in (2, 6, 11)]
    out += [pb.LookupPrefixRequest(namespace=ns_pb(), block_hashes=hs, media=[m])
            for m in (common_pb2.MEDIUM_GPU, common_pb2.MEDIUM_CPU, common_pb2.MEDIUM_DISK)]
    out += [pb.LookupPrefixRequest(namespace=ns_pb(), token_ids=TOKENS, extras=common_pb2.HashExtras(cache_salt="s")),
            pb.LookupPrefixRequest(namespace=ns_pb(), block_hashes=hashes(4, "absent"))]
    return out


async def stream_answers(stub, requests) -> list[pb.LookupPrefixResponse]:
    async def send():
        for r in requests:
            yield r

    return [reply async for reply in stub.LookupPrefixStream(send())]


async def test_stream_answers_are_the_unary_answers_in_request_order(cp_stub):
    hs = await publish_fleet(cp_stub)
    requests = queries(hs) * 4  # more than the server's window: several lookups in flight at once
    unary = [await cp_stub.LookupPrefix(r) for r in requests]
    assert len({a.SerializeToString(deterministic=True) for a in unary}) >= 10  # the answers tell requests apart
    streamed = await stream_answers(cp_stub, requests)
    assert streamed == unary
    # negative control: the same answers in another order are caught
    assert await stream_answers(cp_stub, requests[::-1]) != unary


async def test_a_failed_lookup_ends_the_stream_with_its_status_after_the_earlier_answers(cp_stub):
    hs = await publish_fleet(cp_stub)
    good = pb.LookupPrefixRequest(namespace=ns_pb(), block_hashes=hs)
    cases = [
        (pb.LookupPrefixRequest(block_hashes=hs), "namespace is required"),
        (pb.LookupPrefixRequest(namespace=ns_pb(), block_hashes=hashes(3000)), "the limit is 2048"),
        (pb.LookupPrefixRequest(namespace=ns_pb(), media=[7]), "unknown medium 7"),
        (pb.LookupPrefixRequest(namespace=ns_pb(), block_hashes=[b"short"]), "has 5 bytes"),
    ]
    for bad, text in cases:
        # nothing is written after the bad request: a grpc.aio write that races the server's end of the stream
        # turns the client's status into INTERNAL (the scheduler client's test covers that case)
        queue: asyncio.Queue = asyncio.Queue()

        async def requests():
            while (request := await queue.get()) is not None:
                yield request

        call = cp_stub.LookupPrefixStream(requests())
        for request in (good, good, bad):
            queue.put_nowait(request)
        assert (await call.read()).holders[0].leading_blocks == 12  # positive control: answered before the error
        assert (await call.read()).holders[0].leading_blocks == 12
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in info.value.details()
        queue.put_nowait(None)


async def test_the_scheduler_client_pipelines_lookups_on_one_stream(control_plane, cp_stub, admin_key):
    hs = await publish_fleet(cp_stub)
    ns = Namespace.from_proto(ns_pb())
    async with SchedulerClient(f"127.0.0.1:{control_plane.port}", ns, api_key=admin_key) as client:
        cut = [3, 12, 7, 1, 9] * 20
        matches = await asyncio.gather(*(client.lookup_prefix(block_hashes=hs[:n]) for n in cut))
        assert [m.blocks_queried for m in matches] == cut
        for n, m in zip(cut, matches):
            unary = await cp_stub.LookupPrefix(pb.LookupPrefixRequest(namespace=ns_pb(), block_hashes=hs[:n]))
            assert [(h.node_id, h.data_plane_address, h.leading_blocks) for h in m.holders] == [
                (h.node_id, h.data_plane_address, h.leading_blocks) for h in unary.holders]
        by_tokens = await client.lookup_prefix(token_ids=TOKENS, media=[Medium.GPU])
        assert by_tokens.block_hashes == hs and [(h.node_id, h.per_tier) for h in by_tokens.holders] == [
            ("node-1", {Medium.GPU: 7})]
        # a refused lookup raises its status; the lookups in flight behind it are answered all the same. Many
        # rounds: the race between the client's writes and the server's end of the stream must never show
        for _ in range(100):
            results = await asyncio.gather(client.lookup_prefix(block_hashes=hs),
                                           client.lookup_prefix(block_hashes=hashes(3000)),
                                           *(client.lookup_prefix(block_hashes=hs[:n]) for n in (5, 6)),
                                           return_exceptions=True)
            assert results[0].longest == 12
            assert isinstance(results[1], grpc.aio.AioRpcError)
            assert results[1].code() == grpc.StatusCode.INVALID_ARGUMENT, results[1].details()
            assert "the limit is 2048" in results[1].details()
            assert [r.longest for r in results[2:]] == [5, 6]
        assert (await client.lookup_prefix(block_hashes=hs[:4])).longest == 4


def packed(request: pb.LookupPrefixRequest) -> pb.LookupPrefixRequest:
    """The same lookup with its hashes in packed_block_hashes."""
    out = pb.LookupPrefixRequest()
    out.CopyFrom(request)
    if request.block_hashes:
        del out.block_hashes[:]
        out.packed_block_hashes = b"".join(request.block_hashes)
    return out


async def test_packed_hashes_answer_as_the_repeated_field(cp_stub):
    hs = await publish_fleet(cp_stub)
    requests = queries(hs)
    for request in requests:
        assert await cp_stub.LookupPrefix(packed(request)) == await cp_stub.LookupPrefix(request)
    assert sum(bool(r.packed_block_hashes) for r in map(packed, requests)) >= 8  # the packed form was exercised
    assert (await cp_stub.LookupPrefix(packed(requests[5]))).holders[0].leading_blocks == 12  # positive control


@pytest.mark.parametrize("fields, text", [
    (dict(packed_block_hashes=b"x" * 33), "packed_block_hashes has 33 bytes, not a multiple of the 32-byte"),
    (dict(packed_block_hashes=b"x" * 31), "packed_block_hashes has 31 bytes, not a multiple of the 32-byte"),
    (dict(packed_block_hashes=b"x" * 64, block_hashes=[b"y" * 32]), "give block_hashes or packed_block_hashes, not both"),
    (dict(packed_block_hashes=b"x" * 64, token_ids=list(range(64))), "or token_ids, not both"),
    (dict(packed_block_hashes=b"x" * 32 * 2049), "2049 block hashes; the limit is 2048"),
])
async def test_a_bad_packed_lookup_is_invalid_argument_with_one_clear_message(cp_stub, fields, text):
    hs = await publish_fleet(cp_stub)
    good = pb.LookupPrefixRequest(namespace=ns_pb(), packed_block_hashes=b"".join(hs))
    assert (await cp_stub.LookupPrefix(good)).holders[0].leading_blocks == 12  # positive control
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cp_stub.LookupPrefix(pb.LookupPrefixRequest(namespace=ns_pb(), **fields))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert text in info.value.details() and "\n" not in info.value.details()


async def batch_answers(stub, batches) -> list[list[pb.LookupPrefixResponse]]:
    async def send():
        for batch in batches:
            yield pb.LookupPrefixBatch(lookups=batch)

    return [list(reply.answers) async for reply in stub.LookupPrefixBatches(send())]


async def test_batched_answers_are_the_unary_answers_in_request_order(cp_stub):
    hs = await publish_fleet(cp_stub)
    requests = queries(hs) + [packed(r) for r in queries(hs)]
    unary = [await cp_stub.LookupPrefix(r) for r in requests]
    sizes = [1, 3, 7, len(requests) - 11] * 20  # more batches than the server's window: several in flight
    batches, i = [], 0
    for size in sizes:
        batches.append([requests[(i + k) % len(requests)] for k in range(size)])
        i += size
    answers = await batch_answers(cp_stub, batches)
    assert [len(a) for a in answers] == sizes
    assert [a for batch in answers for a in batch] == [unary[k % len(requests)] for k in range(i)]
    # negative control: a batch's answers in another order are caught
    assert await batch_answers(cp_stub, [batches[3][::-1]]) != [answers[3]]


@pytest.mark.parametrize("size, text", [(0, "a batch of 0 lookups; send 1 to 256"),
                                        (257, "a batch of 257 lookups; send 1 to 256")])
async def test_an_empty_or_oversized_batch_ends_the_stream_after_the_earlier_answers(cp_stub, size, text):
    hs = await publish_fleet(cp_stub)
    good = pb.LookupPrefixRequest(namespace=ns_pb(), packed_block_hashes=b"".join(hs))
    queue: asyncio.Queue = asyncio.Queue()

    async def requests():
        while (request := await queue.get()) is not None:
            yield request

    call = cp_stub.LookupPrefixBatches(requests())
    for lookups in ([good] * 2, [good] * 256, [good] * size):
        queue.put_nowait(pb.LookupPrefixBatch(lookups=lookups))
    assert [a.holders[0].leading_blocks for a in (await call.read()).answers] == [12, 12]  # positive control
    assert len((await call.read()).answers) == 256  # the limit itself is allowed
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in info.value.details()
    queue.put_nowait(None)


async def test_a_failed_lookup_in_a_batch_ends_the_stream_after_the_earlier_batches(cp_stub):
    hs = await publish_fleet(cp_stub)
    good = pb.LookupPrefixRequest(namespace=ns_pb(), packed_block_hashes=b"".join(hs))
    bad = pb.LookupPrefixRequest(namespace=ns_pb(), packed_block_hashes=b"short")
    queue: asyncio.Queue = asyncio.Queue()

    async def requests():
        while (request := await queue.get()) is not None:
            yield request

    call = cp_stub.LookupPrefixBatches(requests())
    for lookups in ([good], [good, good], [good, bad, good]):
        queue.put_nowait(pb.LookupPrefixBatch(lookups=lookups))
    assert len((await call.read()).answers) == 1  # positive control: the batches before are answered
    assert len((await call.read()).answers) == 2
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()  # the failed batch is not answered in part
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "packed_block_hashes has 5 bytes" in info.value.details()
    queue.put_nowait(None)


async def test_a_stream_works_on_no_more_messages_at_once_than_its_charge(cp_stub, control_plane, monkeypatch):
    """Found in review: a lookup stream worked on up to lookup_stream_window (32) messages at once, and read one
    more, while the request gate charges a stream for one max_request_bytes: 33 x 16 MiB per stream, ~8 GiB for
    one key's 16 streams, against the 256 MiB documented. Messages are now worked on within max_request_bytes of
    them (one larger message alone). Control: every batch is answered, in order, once the lookups go on."""
    core = control_plane.core
    monkeypatch.setattr(core, "config", core.config.model_copy(update={"max_request_bytes": 2**20}))
    going, at_once, peak = asyncio.Event(), 0, 0
    lookup_prefix = core.lookup_prefix

    async def held(*args, **kwargs):
        nonlocal at_once, peak
        at_once += 1
        peak = max(peak, at_once)
        await going.wait()
        at_once -= 1
        return await lookup_prefix(*args, **kwargs)

    monkeypatch.setattr(core, "lookup_prefix", held)
    batch = [pb.LookupPrefixRequest(namespace=ns_pb(), block_hashes=hashes(2048, f"b{i}")) for i in range(5)]
    assert 300_000 < pb.LookupPrefixBatch(lookups=batch).ByteSize() < 2**20 // 3  # three fit in the charge

    async def send():
        for _ in range(20):
            yield pb.LookupPrefixBatch(lookups=batch)

    replies = cp_stub.LookupPrefixBatches(send())
    for _ in range(300):  # the server reads and starts what it will (flow control paces ~1 MB on a busy host)
        if peak >= 3:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # and nothing more than that
    assert peak == 3, f"{peak} messages of ~330 KB worked on at once within a 1 MiB charge"
    going.set()
    assert len([reply async for reply in replies]) == 20
