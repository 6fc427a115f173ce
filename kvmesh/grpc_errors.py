"""One decorator that maps domain errors to gRPC status codes.

Every servicer method is wrapped with :func:`grpc_errors`. A domain error
becomes its status code with the error's message; a Redis connection failure
becomes UNAVAILABLE; anything else is logged and becomes INTERNAL without
leaking internals to the caller.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable

import grpc
import redis.exceptions

from kvmesh import errors
from kvmesh.redis_client import unavailable

log = logging.getLogger(__name__)

STATUS_BY_ERROR: dict[type[errors.KvmeshError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a caller sees for ``exc``."""
    for cls in type(exc).__mro__:
        if cls in STATUS_BY_ERROR:
            return STATUS_BY_ERROR[cls], str(exc)
    if unavailable(exc):
        return grpc.StatusCode.UNAVAILABLE, f"block map store unavailable: {exc}"
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return grpc.StatusCode.PERMISSION_DENIED, "block map store denied access"
    return grpc.StatusCode.INTERNAL, "internal error"


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, name: str) -> None:
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("unhandled error in %s", name)
    await context.abort(code, message)


def grpc_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an async (unary or streaming) servicer method."""
    name = method.__qualname__
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - mapped, and logged when internal
                await _abort(context, exc, name)

        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped, and logged when internal
            await _abort(context, exc, name)

    return unary_wrapper
