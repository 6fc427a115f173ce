"""The pull-vs-recompute cost model: measured figures in, milliseconds out.

Every term of docs/scheduling.md's formula is one method here, so the router
and the docs name the same things. Figures nobody reported fall back to the
``route_*`` defaults (:class:`RoutingSettings`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from control_plane.routing.config import RoutingSettings
from control_plane.routing.types import Candidate, Estimate


@dataclass(frozen=True, slots=True)
class Figures:
    """Reported figures, as read from the stats store at one moment."""

    link_bytes_per_s: dict[tuple[str, str], float] = field(default_factory=dict)  # (source, dest) node ids
    prefill_tokens_per_s: dict[str, float] = field(default_factory=dict)         # engine id


def break_even_tokens(kv_bytes_per_token: int, prefill_tokens_per_s: float, link_bytes_per_s: float,
                      promotion_bytes_per_s: float, lookup_ms: float) -> int | None:
    """The fewest tokens a pull must bring to beat prefilling them on an idle engine (lookup + bytes over the link
    + promotion < prefill): the threshold rule's ``min_cached_token_delta`` sized for one model and link. None when
    no pull ever pays (a token crosses the link slower than it prefills)."""
    per_token_s = kv_bytes_per_token * (1 / link_bytes_per_s + 1 / promotion_bytes_per_s)
    gain_ms = 1000.0 * (1 / prefill_tokens_per_s - per_token_s)
    if gain_ms <= 0:
        return None
    return max(1, math.ceil(lookup_ms / gain_ms))


class CostModel:
    """Converts tokens into time for one request (one model's KV bytes per token)."""

    def __init__(self, figures: Figures, settings: RoutingSettings, kv_bytes_per_token: int,
                 pull_wait_s: Callable[[str, str, float, float], float] = lambda source, dest, after_s, s: 0.0,
                 ) -> None:
        """``pull_wait_s(source, dest, after_s, seconds)``: how long a pull of ``seconds`` on the wire starting
        ``after_s`` from now queues behind the pulls routed before it (the ledger)."""
        self._figures = figures
        self._s = settings
        self.kv_bytes_per_token = kv_bytes_per_token
        self._pull_wait_s = pull_wait_s

    def prefill_tokens_per_s(self, engine_id: str) -> float:
        return self._figures.prefill_tokens_per_s.get(engine_id, self._s.route_prefill_tokens_per_s)

    def link_bytes_per_s(self, source_node: str, dest_node: str) -> float:
        return self._figures.link_bytes_per_s.get((source_node, dest_node), self._s.route_link_bytes_per_s)

    def queue_ms(self, c: Candidate) -> float:
        """Time until the engine starts this request: its backlog of prompt tokens at its throughput."""
        return 1000.0 * c.running_tokens / self.prefill_tokens_per_s(c.engine_id)

    def prefill_ms(self, engine_id: str, tokens: int) -> float:
        return 1000.0 * tokens / self.prefill_tokens_per_s(engine_id)

    def promotion_ms(self, tokens: int) -> float:
        return 1000.0 * tokens * self.kv_bytes_per_token / self._s.route_promotion_bytes_per_s

    def wire_ms(self, source_node: str, dest_node: str, tokens: int) -> float:
        """Bytes over the link's measured bandwidth (a pull alone on the link)."""
        return 1000.0 * tokens * self.kv_bytes_per_token / self.link_bytes_per_s(source_node, dest_node)

    def transfer_ms(self, source_node: str, dest_node: str, tokens: int, after_ms: float = 0.0) -> float:
        """Waiting behind the pulls already routed over either NIC, then the bytes on the wire (the pull starts
        ``after_ms`` from now, when the engine reaches the request)."""
        wire_ms = self.wire_ms(source_node, dest_node, tokens)
        return 1000.0 * self._pull_wait_s(source_node, dest_node, after_ms / 1000.0, wire_ms / 1000.0) + wire_ms

    def recompute(self, c: Candidate, prompt: int, local: int, local_gpu: int) -> Estimate:
        """Run on ``c`` with what its own tiers hold: promote the non-GPU part, prefill the rest."""
        return Estimate(queue_ms=self.queue_ms(c), promotion_ms=self.promotion_ms(local - local_gpu),
                        prefill_ms=self.prefill_ms(c.engine_id, prompt - local))

    def pull(self, c: Candidate, prompt: int, local: int, local_gpu: int, source_node: str,
             source_tokens: int) -> Estimate:
        """Run on ``c`` after pulling what the source holds beyond ``local`` into its CPU tier."""
        queue_ms = self.queue_ms(c)
        return Estimate(
            queue_ms=queue_ms,
            lookup_ms=self._s.route_lookup_ms,
            transfer_ms=self.transfer_ms(source_node, c.node_id, source_tokens - local, queue_ms),
            promotion_ms=self.promotion_ms(source_tokens - local_gpu),
            prefill_ms=self.prefill_ms(c.engine_id, prompt - source_tokens),
        )
