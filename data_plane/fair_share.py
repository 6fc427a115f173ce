"""Fair share of a tier's slots between tenants: which blocks a tenant's reservation may evict.

A tenant may evict its own blocks, and another tenant's only while that tenant holds more than an
equal share of the slots (slots / tenants holding blocks, the asking one counted); below its share, it takes
those before its own. So no tenant's
traffic (its engine's saves, its pulls, the prefetches its scheduler orders) crowds another out of
its share of a node; a tenant alone has the whole tier. Used by the CPU tier (data_plane.tier) and
the disk tier (data_plane.disk), over whatever order their eviction policy gives.
"""

from __future__ import annotations

import collections
from typing import Iterator, Protocol, TypeVar

from kvmesh.namespace import Namespace


class Held(Protocol):
    namespace: Namespace


B = TypeVar("B", bound=Held)


def evictable_by(candidates: Iterator[B], tenant: str, held: collections.Counter[str], slots: int) -> Iterator[B]:
    """The ``candidates`` (in the policy's order) that ``tenant`` may evict, given the slots each tenant
    ``held`` holds now out of ``slots``: all of them when no other tenant holds any."""
    others = sum(1 for t, n in held.items() if n > 0 and t != tenant)
    if not others:
        return candidates
    return _fair(candidates, tenant, held, slots // (others + 1))


LOOKAHEAD = 1024  # own blocks passed over, at most, looking for another tenant's over its share


def _fair(candidates: Iterator[B], tenant: str, held: collections.Counter[str], share: int) -> Iterator[B]:
    """While ``tenant`` holds less than its share, the others' blocks over theirs go before its own (each one it
    takes is a slot it grows by), whatever the policy's order, within the first LOOKAHEAD of its own; then the
    policy's order. Found in review: a policy that puts some blocks last (cost_aware's protected prefixes, which
    any request may ask for) kept a tenant over its share for good, the newcomer evicting only its own blocks."""
    taken = collections.Counter[str]()  # taken in this pass, not yet subtracted from ``held``
    room = share - held[tenant]
    deferred: list[B] = []  # its own, met while it may still grow at the others' expense
    for block in candidates:
        owner = block.namespace.tenant
        if owner == tenant:
            if room > 0 and len(deferred) < LOOKAHEAD:
                deferred.append(block)
            else:
                yield from deferred
                deferred.clear()
                room = 0  # past the lookahead: the policy's order (a scan of the whole tier per reservation was
                yield block  # 8-83 ms on 65,536 slots)
        elif held[owner] - taken[owner] > share:
            taken[owner] += 1
            room -= 1
            yield block
            if room <= 0 and deferred:
                yield from deferred
                deferred.clear()
    yield from deferred
