"""Builds a service's command line from its typed settings class.

Each field of a pydantic-settings class becomes ``--field-name`` with the
field's description as help; flags override ``<PREFIX>_FIELD`` environment
variables, which override defaults. Invalid values exit with a clear message.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Awaitable, Callable, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

S = TypeVar("S", bound=BaseSettings)


def parse_settings(cls: type[S], argv: list[str], prog: str) -> S:
    parser = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip())
    for name, field in cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_ = f"{field.description or ''} (default: {field.default!r})"
        if field.annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            parser.add_argument(flag, dest=name, default=None, help=help_)
    args = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    try:
        return cls(**args)
    except ValidationError as exc:  # field and reason only: an input value may be a secret
        reasons = "\n".join(f"  {'.'.join(map(str, e['loc'])) or '(settings)'}: {e['msg']}"
                            for e in exc.errors(include_input=False, include_url=False))
        print(f"{prog}: invalid configuration:\n{reasons}", file=sys.stderr)
        raise SystemExit(2) from None


def service_main(cls: type[S], argv: list[str], prog: str, run: Callable[[S], Awaitable[None]],
                 check: Callable[[S], object] | None = None) -> int:
    """A service's ``main``: logging, settings from flags and env, a start-up ``check`` whose
    ValueError/OSError exits 2 with its message, then ``run`` until it returns."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = parse_settings(cls, argv, prog)
    if check is not None:
        try:
            check(config)
        except (ValueError, OSError) as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 2
    asyncio.run(run(config))
    return 0
