"""Command-line input of the apps (``kvmesh up``, ``bench replay``, ``bench sim-to-real``): bad input is one line
``PROG: error: reason`` on stderr and exit status 2, never a traceback.

The parser, the checked value types and the one-line report are :mod:`kvmesh.command_line`'s (every command
shares them); :func:`fail` reports an error a command caught itself, exactly as an uncaught one is reported.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvmesh.command_line import (Parser, UsageError, non_negative_float, non_negative_int, positive_float,  # noqa: F401
                                 positive_int, report)


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


def fail(prog: str, exc: Exception | str) -> int:
    return report(prog, UsageError(exc) if isinstance(exc, str) else exc)
