"""Eviction policies by name: the built-ins plus any installed package's.

An external package adds a policy without touching kvmesh by declaring an
entry point in the ``kvmesh.eviction_policies`` group whose object is a
callable ``(capacity: int) -> EvictionPolicy`` (usually the class)::

    [project.entry-points."kvmesh.eviction_policies"]
    popularity = "my_pkg.policies:PopularityPolicy"

and the node is started with ``--eviction-policy popularity``.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Callable

from kvmesh.errors import InvalidArgument

from data_plane.eviction.arc import ArcPolicy
from data_plane.eviction.base import EvictionPolicy
from data_plane.eviction.cost_aware import CostAwarePolicy
from data_plane.eviction.lru import LruPolicy

ENTRY_POINT_GROUP = "kvmesh.eviction_policies"

PolicyFactory = Callable[[int], EvictionPolicy]

BUILTIN: dict[str, PolicyFactory] = {"lru": LruPolicy, "arc": ArcPolicy, "cost_aware": CostAwarePolicy}


class PolicyRegistry:
    """Built-ins, then explicit registrations, then entry points (loaded on first use)."""

    def __init__(self, group: str = ENTRY_POINT_GROUP) -> None:
        self._group = group
        self._factories: dict[str, PolicyFactory] = dict(BUILTIN)

    def register(self, name: str, factory: PolicyFactory) -> None:
        if name in self._factories:
            raise InvalidArgument(f"eviction policy {name!r} is already registered")
        self._factories[name] = factory

    def names(self) -> list[str]:
        return sorted(set(self._factories) | {ep.name for ep in entry_points(group=self._group)})

    def create(self, name: str, capacity: int) -> EvictionPolicy:
        factory = self._factories.get(name)
        if factory is None:
            found = [ep for ep in entry_points(group=self._group) if ep.name == name]
            if not found:
                raise InvalidArgument(f"unknown eviction policy {name!r}; available: {', '.join(self.names())}")
            factory = self._factories[name] = found[0].load()
        policy = factory(capacity)
        if not isinstance(policy, EvictionPolicy):
            raise InvalidArgument(f"eviction policy {name!r} built a {type(policy).__name__}, not an EvictionPolicy")
        return policy
