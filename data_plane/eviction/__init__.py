"""Eviction policies: the contract (:mod:`.base`), LRU, ARC, cost-aware, and the registry."""

from data_plane.eviction.base import BlockInfo, EvictionPolicy, block_info
from data_plane.eviction.registry import ENTRY_POINT_GROUP, PolicyRegistry

__all__ = ["BlockInfo", "EvictionPolicy", "block_info", "ENTRY_POINT_GROUP", "PolicyRegistry"]
