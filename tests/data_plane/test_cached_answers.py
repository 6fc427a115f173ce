"""auth.Answers on a controllable clock: fresh answers are served as is, stale ones at once while one
background fetch revalidates, a failed fetch is not retried (nor waited for) within the refresh period,
concurrent callers share one fetch, a refusal is cached like an answer. The real-process version with a
SIGSTOPped control plane is test_hung_control_plane.py."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.errors import PermissionDenied, Unavailable

from data_plane.auth import Answers


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ControlPlane:
    """Answers, hangs (until released) or refuses, and counts the calls it got."""

    def __init__(self) -> None:
        self.calls = 0
        self.mode = "answer"
        self.value = 7
        self.release = asyncio.Event()

    async def fetch(self, key: str, timeout_s: float) -> int:
        self.calls += 1
        if self.mode == "hang":
            await self.release.wait()
        if self.mode == "refuse":
            raise PermissionDenied("not for this node")
        if self.mode == "down":
            raise Unavailable("connection refused")
        return self.value


def answers(cp: ControlPlane, clock: Clock, timeout_s: float = 0.05) -> Answers:
    return Answers(cp.fetch, timeout_s=timeout_s, refresh_s=10.0, clock=clock,
                   is_fresh=lambda _v, age: age < 10.0, is_usable=lambda _v: True)


async def test_fresh_then_stale_while_revalidate():
    cp, clock = ControlPlane(), Clock()
    cache = answers(cp, clock, timeout_s=1.0)
    assert await cache.get("t", 1.0) == 7 and await cache.get("t", 1.0) == 7 and cp.calls == 1
    clock.now += 11  # stale
    cp.mode, cp.value = "hang", 8
    assert await cache.get("t", 1.0) == 7  # served at once, revalidating in the background
    await asyncio.sleep(0)
    assert await cache.get("t", 1.0) == 7
    await asyncio.sleep(0)
    assert cp.calls == 2  # one revalidation in flight, not two
    cp.release.set()
    await asyncio.sleep(0.01)
    assert await cache.get("t", 1.0) == 8


async def test_a_hung_control_plane_costs_one_bounded_wait_per_refresh_period():
    cp, clock = ControlPlane(), Clock()
    cp.mode = "hang"
    cache = answers(cp, clock, timeout_s=0.05)
    # concurrent first callers share one fetch; each waits at most the timeout
    results = await asyncio.gather(*(cache.get("t", 1.0) for _ in range(5)), return_exceptions=True)
    assert all(isinstance(r, Unavailable) for r in results) and cp.calls == 1
    await asyncio.sleep(0.1)  # the fetch gave up (timeout): remembered as a failure
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    for _ in range(20):
        with pytest.raises(Unavailable):
            await cache.get("t", 1.0)
    assert cp.calls == 1 and loop.time() - t0 < 0.04  # no call, no wait within the refresh period
    clock.now += 11
    cp.mode = "answer"
    cp.release.set()
    assert await cache.get("t", 1.0) == 7 and cp.calls == 2  # the next period tries again


async def test_failure_keeps_the_last_answer_and_a_refusal_is_an_answer():
    cp, clock = ControlPlane(), Clock()
    cache = answers(cp, clock)
    assert await cache.get("t", 1.0) == 7
    clock.now += 11
    cp.mode = "down"
    assert await cache.get("t", 1.0) == 7
    await asyncio.sleep(0.01)
    assert await cache.get("t", 1.0) == 7 and cp.calls == 2  # backing off: no new call
    cp.mode = "refuse"
    with pytest.raises(PermissionDenied):
        await cache.get("other", 1.0)
    with pytest.raises(PermissionDenied):
        await cache.get("other", 1.0)
    assert cp.calls == 3


async def test_refresh_fetches_a_fresh_key_again_but_respects_the_back_off():
    """What the data plane's epoch sweep uses: a tenant's answer is fetched again every period, fresh or not."""
    cp, clock = ControlPlane(), Clock()
    cache = answers(cp, clock, timeout_s=1.0)
    assert await cache.get("t", 1.0) == 7
    cp.value = 8
    await cache.refresh("t", 1.0)
    assert cp.calls == 2 and await cache.get("t", 1.0) == 8  # negative control: get alone would still say 7
    cp.mode = "down"
    await cache.refresh("t", 1.0)
    await cache.refresh("t", 1.0)  # within the back-off: no call
    assert cp.calls == 3 and await cache.get("t", 1.0) == 8  # the last answer stays (fail open)
    cache.forget(lambda key: key == "t")
    cp.mode = "answer"
    assert await cache.get("t", 1.0) == 8 and cp.calls == 4  # forgotten: fetched again
