"""Fair share of a tier's slots between tenants: which blocks a tenant's reservation may evict.

A tenant may evict its own blocks, and another tenant's only while that tenant holds more than an
equal share of the slots (slots / tenants holding blocks, the asking one counted). So no tenant's
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


def _fair(candidates: Iterator[B], tenant: str, held: collections.Counter[str], share: int) -> Iterator[B]:
    taken = collections.Counter[str]()  # taken in this pass, not yet subtracted from ``held``
    for block in candidates:
        owner = block.namespace.tenant
        if owner == tenant or held[owner] - taken[owner] > share:
            taken[owner] += 1
            yield block
