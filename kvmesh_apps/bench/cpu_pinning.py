"""Pinning processes to CPUs (Linux): every thread of a process tree, or a child started on given CPUs.

``os.sched_setaffinity(pid, ...)`` moves one thread only, so a running process is pinned thread by
thread (``/proc/PID/task``); threads and children it starts later inherit the mask of the thread that
starts them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children of any of its threads), depth first."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:  # the thread or the process ended meanwhile
            continue
        for child in map(int, children):
            found += [child, *descendants(child)]
    return found


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of process ``pid`` on ``cpus`` (threads that end meanwhile are skipped)."""
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (ProcessLookupError, FileNotFoundError):
            continue


@contextmanager
def spawning_on(cpus: set[int]) -> Iterator[None]:
    """Processes this thread starts inside the block begin on ``cpus`` (they inherit its mask)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
