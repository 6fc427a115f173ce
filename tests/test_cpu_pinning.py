"""kvmesh_apps.bench.cpu_pinning on real child processes: a child started on one CPU, a running tree moved."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvmesh_apps.bench.cpu_pinning import descendants, pin_process, spawning_on

CPUS = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 CPUs to tell two pinnings apart")

# A child that starts a thread and a grandchild, then waits.
TREE = "import subprocess, threading, time; threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); " \
       "subprocess.Popen(['sleep', '30']); print('up', flush=True); time.sleep(30)"


def _affinities(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]


def test_a_child_starts_on_the_cpus_given_and_a_running_tree_moves_thread_by_thread() -> None:
    before = os.sched_getaffinity(0)
    with spawning_on({CPUS[0]}):
        child = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    try:
        assert os.sched_getaffinity(0) == before  # this thread got its mask back
        assert child.stdout.readline().strip() == "up"
        tree = [child.pid, *descendants(child.pid)]
        assert len(tree) == 2 and len(_affinities(child.pid)) >= 2
        assert all(mask == {CPUS[0]} for pid in tree for mask in _affinities(pid))  # inherited at start
        for pid in tree:
            pin_process(pid, {CPUS[1]})
        assert all(mask == {CPUS[1]} for pid in tree for mask in _affinities(pid))  # every thread moved
    finally:
        for pid in descendants(child.pid):
            os.kill(pid, 9)
        child.kill()
        child.wait()
