"""Route-time prefetch, the control plane's half: the signed order for the chosen engine's data plane.

With a PULL decision, ``Route`` adds a :class:`PrefetchOrder`: the chosen engine's node, its registered data-plane
address, the leading block hashes the source holds, and a ticket (``tenancy.grants.PrefetchTicket``) signed with the
grant key. The caller (``SchedulerClient``) hands it to that data plane's ``Prefetch``, which checks the ticket and
starts the pull at once under the node's own grant (data_plane.prefetch). The control plane holds no node key and
calls no data plane; what it vouches for, it checked first:

* the caller may read the tenant (the decision saw the block map under the caller's rights: no rights, no source);
* the tenant's policy allows the destination node to hold its blocks (a scheduler key of tenant B cannot send a
  prefetch to a node B's policy excludes), and the node is registered and live;
* the ticket names the destination, the tenant and namespace, the source, and the blocks (by digest): a data plane
  refuses it for any other node, namespace or prompt, and after ``route_prefetch_ttl_ms``;
* a node's key gets orders for its own node only: it may route a tenant's prompts (it may read the tenant), but an
  order for another node would let one node's key make its peers pull (their links, their tiers) at will. The
  decision and its source are the same; the chosen engine's own ask pulls the blocks.
"""

from __future__ import annotations

import contextlib
import time
from typing import AsyncContextManager, Awaitable, Callable

from kvmesh.namespace import Namespace
from tenancy.grants import GrantSigner, PrefetchTicket, prefetch_blocks_digest

from control_plane.model import NodeStatus
from control_plane.routing.types import KvSource, PrefetchOrder, RouteRequest


async def prompt_block_hashes(request: RouteRequest, blocks: int,
                              turn: AsyncContextManager = contextlib.nullcontext()) -> list[bytes]:
    """The prompt's first ``blocks`` full-block hashes, as the lookup computed them (token ids hashed like
    LookupPrefix does: only those blocks' tokens, the loop handed back between turns, in the caller's ``turn``)."""
    if request.block_hashes:
        return list(request.block_hashes[:blocks])
    cfg = request.namespace.cache_config
    return await cfg.hasher().block_hashes_in_turns(list(request.token_ids[:blocks * cfg.block_size]),
                                                    cfg.block_size, request.extras, turn)


async def prefetch_order(request: RouteRequest, engine_id: str, source: KvSource, *,
                         nodes: Callable[[], Awaitable[list[NodeStatus]]],
                         node_allowed: Callable[[str], Awaitable[bool]], signer: GrantSigner,
                         ttl_ms: int, caller_node: str | None = None,
                         hashing_turn: AsyncContextManager = contextlib.nullcontext()) -> PrefetchOrder | None:
    """The order for ``engine_id``'s node to pull ``source``'s leading blocks now; None when the request opted
    out, the node is not live, the tenant's policy does not allow it, or the caller is another node
    (``caller_node``: the node id of a node's key, None for a scheduler's or an admin's). ``hashing_turn``: the
    caller's turn to hash token ids (hashing.CallerTurns)."""
    if not request.prefetch:
        return None
    destination = next(c.node_id for c in request.candidates if c.engine_id == engine_id)
    if destination == source.node_id or caller_node not in (None, destination):
        return None
    if not await node_allowed(destination):
        return None
    address = next((n.node.data_plane_address for n in await nodes() if n.node.node_id == destination and n.live), "")
    if not address:
        return None
    ns: Namespace = request.namespace
    hashes = await prompt_block_hashes(request, source.cached_tokens // ns.cache_config.block_size, hashing_turn)
    if not hashes:
        return None
    ticket = PrefetchTicket(ns.tenant, ns.fingerprint, destination, source.node_id, source.address,
                            prefetch_blocks_digest(hashes), source.route_token, int(time.time() * 1000) + ttl_ms)
    return PrefetchOrder(destination, address, signer.sign(ticket).decode(), tuple(hashes))
