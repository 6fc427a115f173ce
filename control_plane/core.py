"""The control-plane core: validation and policy over a :class:`BlockMap`.

Plain Python, no gRPC: the servicer converts protos to the types in
``control_plane.model`` and calls this; tests and other front ends can too.
"""

from __future__ import annotations

import asyncio
import logging

from kvmesh.errors import InvalidArgument
from kvmesh.hashing import Extras
from kvmesh.namespace import Namespace

from control_plane.block_map import BlockMap
from control_plane.config import ControlPlaneConfig
from control_plane.model import (
    Ack, EventBatch, NodeInfo, NodeStatus, PrefixMatch, Registration, validate_node_id,
)

log = logging.getLogger(__name__)


class ControlPlane:
    def __init__(self, block_map: BlockMap, config: ControlPlaneConfig) -> None:
        self.block_map = block_map
        self.config = config
        self._gc_task: asyncio.Task | None = None

    # -- nodes -----------------------------------------------------------------

    async def register_node(self, node: NodeInfo) -> Registration:
        return await self.block_map.register_node(node.validate())

    async def heartbeat(self, node_id: str, incarnation: int) -> int:
        validate_node_id(node_id)
        return await self.block_map.heartbeat(node_id, incarnation)

    async def deregister_node(self, node_id: str, incarnation: int) -> None:
        validate_node_id(node_id)
        await self.block_map.deregister_node(node_id, incarnation)

    async def list_nodes(self) -> list[NodeStatus]:
        return await self.block_map.list_nodes()

    # -- events and lookups ---------------------------------------------------

    async def apply_batch(self, batch: EventBatch) -> Ack:
        return await self.block_map.apply_batch(batch.validate(self.config.max_batch_blocks))

    async def lookup_prefix(
        self,
        ns: Namespace,
        block_hashes: list[bytes],
        token_ids: list[int],
        extras: Extras,
        tiers: int,
    ) -> PrefixMatch:
        if block_hashes and token_ids:
            raise InvalidArgument("give block_hashes or token_ids, not both")
        cfg = ns.cache_config
        if token_ids:
            if len(token_ids) // cfg.block_size > self.config.max_lookup_blocks:
                raise InvalidArgument(
                    f"{len(token_ids)} tokens make more than {self.config.max_lookup_blocks} blocks"
                )
            block_hashes = cfg.hasher().block_hashes(token_ids, cfg.block_size, extras)
        if len(block_hashes) > self.config.max_lookup_blocks:
            raise InvalidArgument(f"{len(block_hashes)} block hashes; the limit is {self.config.max_lookup_blocks}")
        digest = cfg.hash_algo.digest_size
        if any(len(h) != digest for h in block_hashes):
            i = next(i for i, h in enumerate(block_hashes) if len(h) != digest)
            raise InvalidArgument(
                f"block_hashes[{i}] has {len(block_hashes[i])} bytes; {cfg.hash_algo.value} hashes are {digest}"
            )
        match = await self.block_map.lookup_prefix(ns, block_hashes, tiers)
        if token_ids:
            match = PrefixMatch(match.blocks_queried, match.holders, block_hashes)
        return match

    # -- background --------------------------------------------------------------

    def start_background(self) -> None:
        if self._gc_task is None:
            self._gc_task = asyncio.create_task(self._gc_loop(), name="kvmesh-cp-gc")

    async def _gc_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.gc_interval_s)
            try:
                freed = await self.block_map.collect_garbage()
                if freed:
                    log.info("swept %d fenced node slots", freed)
            except Exception:  # noqa: BLE001 - the loop must survive a Redis outage
                log.warning("garbage collection failed; will retry", exc_info=True)

    async def close(self) -> None:
        if self._gc_task is not None:
            self._gc_task.cancel()
            try:
                await self._gc_task
            except asyncio.CancelledError:
                pass
        await self.block_map.close()
