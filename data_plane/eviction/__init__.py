"""Eviction policies: the contract (:mod:`.base`), LRU, ARC, cost-aware, and the registry."""

from data_plane.eviction.base import BlockInfo, EvictionPolicy
from data_plane.eviction.registry import ENTRY_POINT_GROUP, PolicyRegistry

__all__ = ["BlockInfo", "EvictionPolicy", "ENTRY_POINT_GROUP", "PolicyRegistry"]
