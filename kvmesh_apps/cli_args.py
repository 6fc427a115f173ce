"""Command-line input of the apps (``kvmesh up``, ``bench replay``, ``bench sim-to-real``): bad input is one line
``PROG: reason`` on stderr and exit status 2, never a traceback.

:class:`Parser` raises :class:`UsageError` instead of printing usage and exiting, so that a command's ``main``
reports it exactly as it reports a :class:`~kvmesh_apps.replay.trace.TraceError` (:func:`fail`).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import NoReturn


class UsageError(ValueError):
    """A bad command-line argument."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:   # argparse's own prints the usage and exits
        raise UsageError(message)


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


def fail(prog: str, exc: Exception | str) -> int:
    print(f"{prog}: {exc}", file=sys.stderr)
    return 2
