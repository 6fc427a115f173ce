"""The ``route_*`` settings of the control plane (part of ``ControlPlaneConfig``, env ``KVMESH_CP_ROUTE_*``).

The defaults are the figures the cost model uses until engines and data planes
report measured ones (``ReportStats``); they describe a mid-size model on one
GPU with a 2 GB/s peer link, and are deliberately conservative about pulls.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class RoutingSettings(BaseModel):
    route_default_policy: str = Field(
        "cost-aware", pattern=r"^(affinity|load-aware|token-aware|cost-aware)$",
        description="policy of a Route request that names none: affinity, load-aware, token-aware, cost-aware")
    route_min_cached_token_delta: int = Field(
        512, ge=0, description="affinity/load/token-aware: a KV source must lead the engine by this many tokens")
    route_kv_bytes_per_token: int = Field(
        131_072, ge=1, description="KV bytes per token when a Route request gives none (Llama-3-8B bf16: 131072)")
    route_prefill_tokens_per_s: float = Field(
        10_000.0, gt=0, description="an engine's prefill throughput until it reports one")
    route_link_bytes_per_s: float = Field(
        2e9, gt=0, description="pull bandwidth of a peer link until the puller reports one")
    route_promotion_bytes_per_s: float = Field(
        20e9, gt=0, description="CPU-tier to GPU copy bandwidth (promotion of a hit)")
    route_lookup_ms: float = Field(1.0, ge=0, description="a pull's lookup round trip to the source")
    route_speculative_ttl_ms: int = Field(
        2000, ge=0, description="a routed prefix counts as held by the chosen engine this long (0: off)")
    route_tier_weight_cpu: float = Field(
        0.8, ge=0, le=1, description="affinity/sources: a token held only in a CPU tier scores this (GPU: 1)")
    route_tier_weight_disk: float = Field(
        0.5, ge=0, le=1, description="affinity/sources: a token held only on disk scores this (GPU: 1)")
    route_work_weight: float = Field(
        1.0, ge=0, description="cost-aware: an option's prefill time counts this many times the mean waiting "
                               "requests per candidate on top of its TTFT (0: the request's TTFT alone)")
    route_work_waiting_cap: float = Field(
        4.0, ge=0, description="cost-aware: the mean waiting requests the work weight multiplies are counted up to "
                               "this many (a saturated fleet's queues do not make prefill time count without bound)")
    route_affinity_spill_waiting: int = Field(
        4, ge=1, description="affinity with P2P: leave a holder this many waiting requests busier than the "
                            "least loaded engine, and pull from it")
    route_stats_ewma_alpha: float = Field(
        0.3, gt=0, le=1, description="weight of a new sample in the reported figures' moving average")
    route_stats_refresh_ms: int = Field(
        1000, ge=0, description="how long a replica reuses the reported figures it read from Redis")
    route_stats_max_per_node: int = Field(
        256, ge=1, description="most engines of one node, and links into one node, the reported figures keep (of "
                               "16,384 each): a node naming made-up engines takes its own share, not other nodes'")
    route_prefetch: bool = Field(
        True, description="route-time prefetch: a PULL decision carries a signed order for the chosen engine's data "
                          "plane to start that pull at once (docs/scheduling.md#prefetch-at-route-time); off: never")
    route_prefetch_ttl_ms: int = Field(
        5000, ge=100, description="how long a prefetch order's ticket is valid (a data plane refuses it after)")
