"""What every kvmesh command shares: a parser that raises, checked value types, and the one place an error
becomes the one line a user reads.

Every command (``kvmesh <subcommand>``, ``python -m data_plane.server``, ``python -m control_plane.server``) runs
its ``main`` through :func:`run_command`. Whatever stops it (bad input, a file it cannot read, a port in use, an
unreachable Redis or service, a domain error from :mod:`kvmesh.errors`) is printed as one line on stderr::

    kvmesh <subcommand>: error: <what>; <how to fix>

and the command exits 2 for bad input (flags, settings, files named by them) or 1 for a runtime failure; never a
traceback (``KVMESH_TRACEBACK=1`` adds one, for a bug report).
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

import grpc
import redis.exceptions

from kvmesh import addresses, errors

BAD_INPUT = 2
RUNTIME = 1
INTERRUPTED = 130


class UsageError(ValueError):
    """A bad command-line argument or setting; ``prog``: the (sub)command whose ``--help`` lists what it takes."""

    def __init__(self, message: str, prog: str | None = None) -> None:
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise :class:`UsageError` (argparse's own prints the usage and exits);
    subparsers it makes are Parsers too."""

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        raise UsageError(self._unknown_flag_before_command(message) or message, self.prog)

    def _unknown_flag_before_command(self, message: str) -> str:
        """argparse takes the value of a flag it does not know, given before a subcommand, for the subcommand
        (``kvmesh admin --admin-key K tenants list``: "invalid choice: 'K'"); the flag is what to name."""
        argv = getattr(self, "_argv", [])
        for i, arg in enumerate(argv[1:], 1):
            flag = argv[i - 1]
            if f"invalid choice: {arg!r}" in message and flag.startswith("-") and \
                    flag.split("=")[0] not in self._option_string_actions:
                return f"unrecognized argument {flag} (before {arg!r})"
        return ""


def _checked(cast: type, ok: Callable[[float], bool], words: str) -> Callable[[str], float]:
    def check(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {words}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {words}, got {text!r}")
        return value
    return check


positive_int = _checked(int, lambda v: v > 0, "a positive integer")
non_negative_int = _checked(int, lambda v: v >= 0, "an integer >= 0")
positive_float = _checked(float, lambda v: math.isfinite(v) and v > 0, "a positive number")
non_negative_float = _checked(float, lambda v: math.isfinite(v) and v >= 0, "a number >= 0")


def subset(known: list[str]) -> Callable[[str], list[str]]:
    """A comma-separated subset of ``known``, in the order given; refused when it names an unknown one or none."""
    def check(text: str) -> list[str]:
        out = [n for n in text.split(",") if n]
        unknown = [n for n in out if n not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))} (known: {', '.join(known)})")
        if not out:
            raise argparse.ArgumentTypeError("names none")
        return out
    return check


def host_port(text: str) -> str:
    """``host:port`` or ``[v6]:port`` with a port in 1..65535 (a bare host would make gRPC dial port 443)."""
    found = addresses.problem(text)
    if found is not None:
        raise argparse.ArgumentTypeError(f"must be host:port ({found}), got {text!r}")
    return text


_RPC_FIX = {
    grpc.StatusCode.UNAVAILABLE: "check that the service runs at that address and that its TLS settings match",
    grpc.StatusCode.DEADLINE_EXCEEDED: "check that the service runs at that address and is not overloaded",
    grpc.StatusCode.UNAUTHENTICATED: "check the API key given (--key, --key-file or the *_API_KEY settings)",
    grpc.StatusCode.PERMISSION_DENIED: "use a key whose role and tenant may do this",
    grpc.StatusCode.INVALID_ARGUMENT: "fix the value named",
    grpc.StatusCode.NOT_FOUND: "check the id (the matching list command shows what exists)",
    grpc.StatusCode.ALREADY_EXISTS: "pick another id, or use the existing one",
}
_BAD_INPUT_CODES = {grpc.StatusCode.INVALID_ARGUMENT}


def _rpc(exc: grpc.RpcError) -> tuple[str, int]:
    code, details = exc.code(), (exc.details() or "").replace("\n", " ")
    fix = _RPC_FIX.get(code, "see the service's log")
    return f"{code.name}: {details}; {fix}", BAD_INPUT if code in _BAD_INPUT_CODES else RUNTIME


def _os(exc: OSError) -> tuple[str, int]:
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
        return f"cannot listen: {reason}; pick another port (or address) or stop what holds it", RUNTIME
    if exc.filename is not None and exc.errno in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR,
                                                  errno.ENOTDIR, errno.ELOOP, errno.EROFS):
        return (f"cannot use {exc.filename}: {reason}; check the path, and that this user may read (or write) it",
                BAD_INPUT)
    return f"{reason}; check the file or address named by the flags", RUNTIME


_REDIS_URL = "the Redis URL setting (redis_url: --redis-url / KVMESH_CP_REDIS_URL)"


def _redis_url_mismatch(exc: Exception) -> tuple[str, int] | None:
    """A Redis URL that names the wrong kind of server, or a database it lacks: what redis-py raises for it when
    the first command connects (the URL's form is checked before, in kvmesh.redis_client.connect); None for
    another error of the same type (a kvmesh bug: reported as one)."""
    text = " ".join(str(exc).split())
    if isinstance(exc, redis.exceptions.ResponseError) and "DB index is out of range" in text:
        return (f"the Redis server has no such database ({text}); in {_REDIS_URL} select /0, or a database "
                "below the server's `databases` setting", BAD_INPUT)
    if not isinstance(exc, redis.exceptions.RedisClusterException):
        return None
    if "Cluster mode is not enabled" in text:
        return (f"the Redis server is not a Redis Cluster ({text}); in {_REDIS_URL} give redis://host:port/0 for "
                "a single server, or redis+cluster:// with the nodes of a cluster", BAD_INPUT)
    if "requires at least one node" in text or "must be 0 or None in cluster mode" in text:
        return (f"the Redis Cluster URL is incomplete ({text.split('. ')[0]}); in {_REDIS_URL} give "
                "redis+cluster://host:port[,host:port...] (database 0 only)", BAD_INPUT)
    if "cannot be connected" in text:
        return f"no Redis Cluster node answered ({text}); start the cluster, or fix {_REDIS_URL}", RUNTIME
    return None


def describe(exc: BaseException) -> tuple[str, int]:
    """The line (without the program name) and the exit status for an error that stopped a command."""
    if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        return describe(exc.exceptions[0])
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", INTERRUPTED
    if isinstance(exc, UsageError):
        return str(exc), BAD_INPUT
    if isinstance(exc, errors.KvmeshError):  # domain errors name the fix themselves
        return str(exc), BAD_INPUT if isinstance(exc, errors.InvalidArgument) else RUNTIME
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return _rpc(exc)
    if isinstance(exc, redis.exceptions.AuthenticationError):
        return f"Redis refused the credentials ({exc}); check the Redis user and password settings", RUNTIME
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return f"Redis denied a command ({exc}); give the Redis user the rules docs/configuration.md lists", RUNTIME
    if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
        return f"Redis unreachable ({exc}); start Redis, or fix the Redis URL setting", RUNTIME
    if isinstance(exc, (redis.exceptions.RedisClusterException, redis.exceptions.ResponseError)):
        found = _redis_url_mismatch(exc)
        if found is not None:
            return found
    if isinstance(exc, OSError):
        return _os(exc)
    if isinstance(exc, ValueError):  # start-up checks of settings and files
        return str(exc), BAD_INPUT
    return (f"internal error ({type(exc).__name__}: {exc}); rerun with KVMESH_TRACEBACK=1 and report the "
            "traceback", RUNTIME)


def report(prog: str, exc: BaseException) -> int:
    """Prints ``exc`` as one line on stderr; returns the exit status."""
    line, status = describe(exc)
    if status == BAD_INPUT and "; " not in line:  # argparse's messages (and terse checks) say what, not how
        line += f"; `{getattr(exc, 'prog', None) or prog} --help` lists the flags and the values they take"
    if os.environ.get("KVMESH_TRACEBACK") and not isinstance(exc, KeyboardInterrupt):
        traceback.print_exception(exc, file=sys.stderr)
    print(f"{prog}: error: {' '.join(line.split())}", file=sys.stderr, flush=True)
    return status


def run_command(prog: str, main: Callable[[list[str]], int | None], argv: list[str]) -> int:
    """Runs a command's ``main``; any error that stops it becomes one line (:func:`report`)."""
    try:
        return int(main(argv) or 0)
    except SystemExit as exc:  # an explicit exit keeps its status; a message in it is reported as one line
        if isinstance(exc.code, str):
            return report(prog, UsageError(exc.code))
        return int(exc.code or 0)
    except BaseException as exc:  # noqa: BLE001 - the one place a command's failure is reported
        return report(prog, exc)
