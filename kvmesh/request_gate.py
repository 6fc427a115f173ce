"""Every kvmesh request is read on demand, charged to its caller, then decoded (:class:`RequestGate`).

gRPC reads a unary request before any handler runs, so a call refused for its caller (no key, too many calls)
had its message read, and one refused for its content had it decoded: with one node's key, 32 concurrent 55 MiB
lookups grew the control plane by 5.8 GiB and 256 concurrent 13 MiB ones by 8.5 GiB (measured on a `kvmesh up`
fleet), enough to bring down the host. Here each handler is served as a request-streaming one (the same on the
wire: a unary request is a stream of one message), so nothing is read until the gate has admitted the call and
set aside room for its message in its caller's share (:class:`InFlightLimit`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import traceback
from dataclasses import dataclass
from typing import Callable

import grpc
from google.protobuf import descriptor_pool

# How long a unary call may wait for room in its caller's share before it is refused, and how long its request
# message may then take to arrive (a sender that stalls mid-message holds that room no longer than this).
REQUEST_WAIT_S = 10.0
REQUEST_READ_S = 10.0


@dataclass(frozen=True, slots=True)
class _Undecodable:
    """What decoding hands on when a payload is not a valid message of the RPC's type."""

    message: str


def _tolerant(deserializer):
    """``deserializer``, answering :class:`_Undecodable` instead of raising (gRPC would answer UNKNOWN)."""
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    type_name = descriptor.full_name if descriptor is not None else "the request type"

    def decode(raw: bytes):
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - any decoding failure is the caller's malformed payload
            return _Undecodable(f"request is not a valid {type_name} ({exc.__class__.__name__}: "
                                f"{str(exc).split(': ')[-1] or 'malformed'})")

    return decode


@functools.lru_cache(maxsize=None)
def client_streaming(method: str) -> bool:
    """Whether ``method`` ("/kvmesh.v1.ControlPlane/StreamEvents") takes a stream of requests, as its proto
    declares. The gate serves every handler as request-streaming, so the handler's kind no longer tells;
    interceptors that treat request streams differently (a key checked again before each message) ask here."""
    try:
        found = descriptor_pool.Default().FindMethodByName(method.lstrip("/").replace("/", "."))
    except KeyError:
        return False
    return found.client_streaming


CallOwner = Callable[[grpc.aio.ServicerContext], "str | None"]


@dataclass(eq=False)
class _Call:
    owner: str | None
    held: int = 0  # bytes of its caller's share this call holds now


def _mib(size: int) -> str:
    return f"{size / 2**20:g} MiB"


class InFlightLimit:
    """What one caller (``owner(context)``: its authenticated key; None for calls nobody is charged for, read
    when the handler starts, after the authenticating interceptor's wrapper set the caller) may have in flight:

    * ``calls`` calls (a stream counts until it ends); the next answers RESOURCE_EXHAUSTED at once;
    * ``request_bytes`` of requests being read or served. A unary call sets aside ``max_request_bytes`` (the
      largest request the server accepts) before its message is read, waiting up to :data:`REQUEST_WAIT_S`
      behind the caller's earlier calls (then RESOURCE_EXHAUSTED), and keeps its message's size until it ends;
      a request stream holds ``max_request_bytes`` for its whole life (one message at a time is read), and one
      that finds no room is refused at once. A caller holding nothing always has room for one call.

    So one caller's requests take at most ``request_bytes`` of raw messages (plus what decoding them costs)
    however many calls it makes, and refused calls are never read. Threading: one event loop."""

    def __init__(self, calls: int, owner: CallOwner, request_bytes: int, max_request_bytes: int) -> None:
        self.max_request_bytes = max_request_bytes
        self._calls = calls
        self._request_bytes = request_bytes
        self._owner = owner
        self._in_flight: dict[str, int] = {}
        self._held: dict[str, int] = {}
        self._waiting: dict[str, collections.deque[tuple[asyncio.Future, _Call]]] = {}

    async def enter(self, context, stream: bool) -> _Call:
        call = _Call(self._owner(context))
        owner = call.owner
        if owner is None:
            return call
        count = self._in_flight.get(owner, 0)
        if count >= self._calls:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the calling key already has {count} calls in flight here, the most one key "
                                f"may have (max_calls_in_flight_per_key); retry once some have ended")
        if stream and not self._fits(owner):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the calling key's requests being read or served here hold "
                                f"{_mib(self._held.get(owner, 0))} of the {_mib(self._request_bytes)} one key may "
                                f"hold (max_request_bytes_in_flight_per_key), and a request stream holds "
                                f"{_mib(self.max_request_bytes)} (max_request_bytes) while open: close one of the "
                                "key's streams, give each client its own key, or raise "
                                "max_request_bytes_in_flight_per_key")
        self._in_flight[owner] = count + 1
        if stream:
            self._charge(call, self.max_request_bytes)
        return call

    async def reserve(self, call: _Call, context) -> None:
        """Room for one request message of ``call`` (a unary call, before its message is read)."""
        owner = call.owner
        if owner is None:
            return
        if self._fits(owner) and not self._waiting.get(owner):
            self._charge(call, self.max_request_bytes)
            return
        granted = asyncio.get_running_loop().create_future()
        queue = self._waiting.setdefault(owner, collections.deque())
        queue.append((granted, call))
        remaining = context.time_remaining()
        wait_s = REQUEST_WAIT_S if remaining is None else max(0.0, min(REQUEST_WAIT_S, remaining))
        try:
            await asyncio.wait_for(asyncio.shield(granted), wait_s)
        except asyncio.TimeoutError:
            pass
        finally:
            if not granted.done():
                granted.cancel()  # dropped from the queue by the next wake
        if not call.held:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                self._no_room(owner, wait_s))

    def shrink(self, call: _Call, size: int) -> None:
        """``call``'s message arrived: it keeps only its size."""
        if call.owner is not None and size < call.held:
            self._give_back(call, call.held - size)

    def leave(self, call: _Call) -> None:
        owner = call.owner
        if owner is None:
            return
        if call.held:
            self._give_back(call, call.held)
        left = self._in_flight[owner] - 1
        if left:
            self._in_flight[owner] = left
        else:
            del self._in_flight[owner]

    def _fits(self, owner: str) -> bool:
        held = self._held.get(owner, 0)
        return not held or held + self.max_request_bytes <= self._request_bytes

    def _no_room(self, owner: str, wait_s: float) -> str:
        return (f"the calling key's requests being read or served here hold {_mib(self._held.get(owner, 0))} of "
                f"the {_mib(self._request_bytes)} one key may hold (max_request_bytes_in_flight_per_key), each call "
                f"setting aside {_mib(self.max_request_bytes)} (max_request_bytes) while its request is read, and "
                f"no room was free for {wait_s:g} s; retry once some calls have ended")

    def _charge(self, call: _Call, size: int) -> None:
        self._held[call.owner] = self._held.get(call.owner, 0) + size
        call.held += size

    def _give_back(self, call: _Call, size: int) -> None:
        owner = call.owner
        call.held -= size
        left = self._held[owner] - size
        if left:
            self._held[owner] = left
        else:
            del self._held[owner]
        self._wake(owner)

    def _wake(self, owner: str) -> None:
        """Grants waiting calls room, oldest first, while it lasts."""
        queue = self._waiting.get(owner)
        while queue:
            granted, call = queue[0]
            if granted.done():  # gave up waiting
                queue.popleft()
                continue
            if not self._fits(owner):
                return
            queue.popleft()
            self._charge(call, self.max_request_bytes)
            granted.set_result(None)
        self._waiting.pop(owner, None)


class _Unlimited(InFlightLimit):
    def __init__(self, max_request_bytes: int) -> None:
        super().__init__(0, lambda context: None, 0, max_request_bytes)


class RequestGate(grpc.aio.ServerInterceptor):
    """The innermost interceptor: every kvmesh request is read only once its call is admitted
    (:class:`InFlightLimit`), then decoded. A call the interceptors outside refuse (authentication) or the limit
    refuses never has its message read. Undecodable payloads answer INVALID_ARGUMENT naming the expected type,
    instead of gRPC's UNKNOWN with an exception class name and a logged traceback. Wrapped handlers are built
    once per method (nothing in them depends on the call)."""

    def __init__(self, limit: InFlightLimit | None, max_request_bytes: int) -> None:
        self._limit = limit or _Unlimited(max_request_bytes)
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}
        self.health_watches = HealthWatches()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        found = self._wrapped.get(details.method)
        if found is not None and found[0] is handler:
            return found[1]
        if not details.method.startswith("/kvmesh."):  # health and reflection: grpc's own, asked without a key
            wrapped = _own_service(handler, self.health_watches if details.method == HEALTH_WATCH else None)
            self._wrapped[details.method] = (handler, wrapped)
            return wrapped
        decode = _tolerant(handler.request_deserializer)
        many = handler.request_streaming
        if handler.response_streaming:
            behavior = handler.stream_stream if many else handler.unary_stream
            wrapped = grpc.stream_stream_rpc_method_handler(
                self._stream_response(behavior, decode, many), response_serializer=handler.response_serializer)
        else:
            behavior = handler.stream_unary if many else handler.unary_unary
            wrapped = grpc.stream_unary_rpc_method_handler(
                self._unary_response(behavior, decode, many), response_serializer=handler.response_serializer)
        self._wrapped[details.method] = (handler, wrapped)
        return wrapped

    async def _read_one(self, requests, call: _Call, decode, context):
        await self._limit.reserve(call, context)
        try:
            raw = await asyncio.wait_for(_first(requests), REQUEST_READ_S)
        except asyncio.TimeoutError:
            raw = None
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"the request message did not arrive within {REQUEST_READ_S:g} s of the call")
        if raw is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request message")
        self._limit.shrink(call, len(raw))
        return await _decoded(decode(raw), context)

    @staticmethod
    async def _each(requests, decode, context):
        async for raw in requests:
            yield await _decoded(decode(raw), context)

    async def _request(self, many: bool, requests, call: _Call, decode, context):
        """What the registered handler takes: the request (read now), or the stream of them (read on demand)."""
        return self._each(requests, decode, context) if many else await self._read_one(requests, call, decode, context)

    def _unary_response(self, behavior, decode, many: bool):
        async def unary(requests, context):
            call = await self._limit.enter(context, stream=many)
            try:
                return await behavior(await self._request(many, requests, call, decode, context), context)
            except BaseException as exc:
                _drop_locals(exc)
                raise
            finally:
                self._limit.leave(call)
                await _close(requests)

        return unary

    def _stream_response(self, behavior, decode, many: bool):
        async def stream(requests, context):
            call = await self._limit.enter(context, stream=many)
            try:
                async for item in behavior(await self._request(many, requests, call, decode, context), context):
                    yield item
            except BaseException as exc:
                _drop_locals(exc)
                raise
            finally:
                self._limit.leave(call)
                await _close(requests)

        return stream


HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
MAX_HEALTH_WATCHES = 64


class HealthWatches:
    """Health.Watch streams (asked without a key; each holds a stream and the servicer keeps a condition per
    service name it is asked about): at most :data:`MAX_HEALTH_WATCHES` open, only for the services the server
    serves (``services``, filled as it starts)."""

    def __init__(self) -> None:
        self.services: set[str] = set()
        self.open = 0

    async def enter(self, request, context) -> None:
        if request.service not in self.services:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no service {request.service[:100]!r} here")
        if self.open >= MAX_HEALTH_WATCHES:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_HEALTH_WATCHES} health watches are "
                                "open here; ask Health.Check instead")
        self.open += 1


def _own_service(handler: grpc.RpcMethodHandler, watches: HealthWatches | None) -> grpc.RpcMethodHandler:
    """A handler of grpc's own services (health, reflection) whose undecodable request answers INVALID_ARGUMENT
    naming the expected type, not UNKNOWN with a traceback logged per call (``watches``: Health.Watch's bound)."""
    kwargs = dict(request_deserializer=_tolerant(handler.request_deserializer),
                  response_serializer=handler.response_serializer)
    if handler.request_streaming:  # reflection: a stream both ways
        async def each(requests, context):
            async for request in requests:
                yield await _decoded(request, context)

        async def stream(requests, context):
            async for item in handler.stream_stream(each(requests, context), context):
                yield item
        return grpc.stream_stream_rpc_method_handler(stream, **kwargs)
    if handler.response_streaming:  # Health.Watch: writes with context.write
        async def watch(request, context):
            request = await _decoded(request, context)
            await watches.enter(request, context)
            try:
                await handler.unary_stream(request, context)
            finally:
                watches.open -= 1
        return grpc.unary_stream_rpc_method_handler(watch, **kwargs)

    async def unary(request, context):
        return await handler.unary_unary(await _decoded(request, context), context)
    return grpc.unary_unary_rpc_method_handler(unary, **kwargs)


def _drop_locals(exc: BaseException) -> None:
    """Clears the locals of the finished frames ``exc`` (and the exceptions it chains) went through. A refusal
    raised from a handler leaves its request referenced from those frames, and the exception sits in a
    reference cycle that only the garbage collector frees: measured, 64 concurrent 13 MiB lookups refused
    for their content grew the control plane by 3.1 GiB, 1.0 GiB with the collector run every 50 ms. The
    traceback still names every frame and line."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


async def _first(requests):
    messages = requests.__aiter__()
    try:
        return await messages.__anext__()
    except StopAsyncIteration:
        return None
    finally:
        await _close(messages)


async def _close(requests) -> None:
    """Ends gRPC's request generator: suspended, its frame keeps the last message it read (a stream's whole last
    batch) alive for as long as anything refers to the handler's frames, e.g. a refusal's traceback."""
    with contextlib.suppress(RuntimeError):  # already running (a read being cancelled): it ends with the call
        await requests.__aiter__().aclose()


async def _decoded(request, context):
    if isinstance(request, _Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
    return request
