"""Builds a service's command line from its typed settings class.

Each field of a pydantic-settings class becomes ``--field-name`` with the
field's description as help; flags override ``<PREFIX>_FIELD`` environment
variables, which override defaults. Invalid values stop the service with one
line (:mod:`kvmesh.command_line`), naming the fields but never their values.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import logging
import os
import re
import sys
from typing import Awaitable, Callable, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from kvmesh.command_line import Parser, UsageError

S = TypeVar("S", bound=BaseSettings)


def _default(field) -> str:
    """The default as help shows it (a factory's, e.g. the host name, computed now)."""
    value = field.get_default(call_default_factory=True)
    return "none" if value is None else repr(value)


def parse_settings(cls: type[S], argv: list[str], prog: str) -> S:
    """The settings from flags, environment and defaults; :class:`UsageError` when a value is invalid."""
    parser = Parser(prog=prog, description=(cls.__doc__ or "").strip())
    for name, field in cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_ = f"{field.description or ''} (default: {_default(field)})"
        if field.annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            parser.add_argument(flag, dest=name, default=None, help=help_)
    args = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    _refuse_unknown_environment(cls, prog)
    try:
        return cls(**args)
    except ValidationError as exc:  # field and reason only: an input value may be a secret
        prefix = cls.model_config.get("env_prefix", "")
        reasons = ", ".join(_reason(e, prefix) for e in exc.errors(include_input=False, include_url=False))
        raise UsageError(f"invalid configuration: {reasons}; fix the flag or environment variable named") from None


# Names with a service's prefix that are not its settings: docker-compose.yml's published port, read by compose,
# and the variables Kubernetes (and Docker links) give every pod for a Service named kvmesh-cp or kvmesh-dp.
NOT_SETTINGS = re.compile(r"(PORT|SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?|NAME)")


def _refuse_unknown_environment(cls: type[BaseSettings], prog: str) -> None:
    """A variable with the settings' prefix that names no setting but nearly one stops the start: pydantic-settings
    ignores it, and a misspelled one (KVMESH_CP_TLS_CLIENT_CA for ..._FILE) left mutual TLS off without a word.
    One that resembles no setting is said in one line on stderr and ignored (it may be another tool's)."""
    prefix = cls.model_config.get("env_prefix", "").upper()
    if not prefix:
        return
    known = {prefix + name.upper() for name in cls.model_fields}
    for name in sorted(os.environ):
        upper = name.upper()
        if not upper.startswith(prefix) or upper in known or NOT_SETTINGS.fullmatch(upper[len(prefix):]):
            continue
        close = difflib.get_close_matches(upper, sorted(known), n=1, cutoff=0.8)
        if close:
            raise UsageError(f"{name} in the environment names no setting; did you mean {close[0]}? (or unset it)")
        print(f"{prog}: warning: {name} in the environment names no setting (ignored); `{prog} --help` lists the "
              f"settings ({prefix}<SETTING>)", file=sys.stderr, flush=True)


def _reason(error: dict, prefix: str) -> str:
    field = ".".join(map(str, error["loc"]))
    where = f"{field} (--{field.replace('_', '-')} / {prefix}{field.upper()})" if field else "settings"
    return f"{where}: {error['msg']}"


def service_main(cls: type[S], argv: list[str], prog: str, run: Callable[[S], Awaitable[None]],
                 check: Callable[[S], object] | None = None) -> int:
    """A service's ``main``: settings from flags and env, a start-up ``check`` (its errors, as every other
    that stops the service, become one line in :func:`kvmesh.command_line.run_command`), logging, then ``run``
    until it returns."""
    config = parse_settings(cls, argv, prog)
    if check is not None:
        check(config)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(run(config))
    return 0
