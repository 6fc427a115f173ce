"""``KvmeshConnector``: vLLM 0.32 KV connector (V1 API) over the node's kvmesh data plane.

Enable it out of tree (or through the ``kvmesh`` vLLM plugin, which registers the name)::

    KVTransferConfig(
        kv_connector="KvmeshConnector",
        kv_connector_module_path="engine_connector.connector",
        kv_role="kv_both",                       # kv_consumer: load only; kv_producer: save only
        kv_load_failure_policy="recompute",      # vLLM's default "fail" errors the request instead
        kv_connector_extra_config={
            "data_plane_address": "127.0.0.1:7100",   # this node's data plane
            "api_key_file": "/etc/kvmesh/node.key",   # the node's API key
            "control_plane_address": "cp:50051",      # optional: auto_source, source resolution
            "tenant": "acme", "weight_version": "rev1",
            "auto_source": True,
        },
    )

vLLM builds one instance per role: the scheduler role (in the engine core, delegating to
:class:`SchedulerSide`: lookups, pulls, pins) and the worker role (next to the KV cache,
delegating to :class:`WorkerSide`: memory copies, saves). Each has its own :class:`NodeLink`.
Per-request options arrive in ``request.kv_transfer_params`` (see :mod:`engine_connector.params`);
a per-request report comes back on ``RequestOutput.kv_transfer_params["kvmesh"]``.

Only single-KV-cache-group models (plain full attention) are supported: the hybrid
allocator must be off, which vLLM arranges for connectors without ``SupportsHMA``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvmesh import tracing

from engine_connector.block_shape import EngineBlocks, engine_block_nbytes
from engine_connector.config import ConnectorConfig
from engine_connector.metadata import KvmeshConnectorMetadata
from engine_connector.node_link import NodeLink
from engine_connector.scheduler_side import SchedulerSide
from engine_connector.stats import ConnectorStats, KvmeshPromMetrics
from engine_connector.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler prints it in the engine's log


class KvmeshConnector(KVConnectorBase_V1):
    """Loads prompt prefixes from this node's tier or a peer's, and saves full blocks to the node's tier."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tracing.configure("kvmesh-engine-connector")
        config = ConnectorConfig.from_extra_config(self._kv_transfer_config.kv_connector_extra_config or {})
        ns = config.namespace(vllm_config)
        if role == KVConnectorRole.SCHEDULER:  # what a scheduler's lookups must name (SchedulerClient.namespace_for)
            c = ns.cache_config
            log.info("KvmeshConnector: blocks of namespace %s (tenant %s, model %r, weight_version %r, block_size "
                     "%d, kv_dtype %s, parallel_layout %s, hash_algo %s, hash_seed %s)", ns.fingerprint, ns.tenant,
                     ns.model, ns.weight_version, c.block_size, c.kv_dtype, c.parallel_layout, c.hash_algo.value,
                     "from PYTHONHASHSEED" if c.hash_seed else "vLLM's default")
        self._link = NodeLink(config.data_plane_address, config.key(), config.control_plane_address,
                              config.rpc_timeout_s, config.tls(config.data_plane_tls_name),
                              config.tls(config.control_plane_tls_name))
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        try:
            tier = self._link.describe_tier()
            blocks = EngineBlocks.of(vllm_config)
            if kv_cache_config is not None:
                blocks.check(config.data_plane_address, tier.block_bytes, engine_block_nbytes(kv_cache_config),
                             tier.block_tokens)
            if role == KVConnectorRole.SCHEDULER:
                self._scheduler = SchedulerSide(
                    self._link, ns, config, vllm_config.cache_config.block_size,
                    can_load=self._kv_transfer_config.is_kv_consumer,
                    can_save=self._kv_transfer_config.is_kv_producer,
                )
            else:
                self._worker = WorkerSide(self._link, ns, blocks, misplace_one_block=config.misplace_one_block)
        except BaseException:
            self._link.close()
            raise

    @property
    def requires_kv_delivery(self) -> bool:
        # A dropped save is only a future cache miss.
        return False

    # ---- worker role ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        # The copies of requests waiting for their KV (vLLM runs no forward for them this step).
        self._worker_side().load(self._step_meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loaded requests are not in this step's forward; nothing to wait for.
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata", **kwargs: Any
    ) -> None:
        # Whole blocks are saved in wait_for_save, once every layer is written.
        return

    def wait_for_save(self) -> None:
        self._worker_side().save(self._step_meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self._worker_side().take_finished_loads() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().take_failed_block_ids()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        self._link.close()

    # ---- scheduler role ----

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler_side().bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        # None: the lookup (and pull) still runs in the background, ask again. A hit loads
        # asynchronously: the worker copies it in a later step and reports it in get_finished.
        tokens = self._scheduler_side().num_new_matched_tokens(request, num_computed_tokens)
        return tokens, bool(tokens)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict[CacheHitSource, int]:
        if num_external_tokens == 0:
            return {}
        local, peer = self._scheduler_side().hit_sources(request)
        if local + peer != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return {source: n for source, n in ((CacheHitSource.HOST, local), (CacheHitSource.P2P, peer)) if n}

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self._scheduler_side().after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler_side().build_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self._scheduler_side().on_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # True while the worker may still be copying into the request's blocks (an aborted load).
        return self._scheduler_side().finished(request)

    # ---- metrics (vLLM's connector-stats API) ----

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._scheduler.stats.take() if self._scheduler is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return ConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> "KVConnectorPromMetrics | None":
        return KvmeshPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- helpers ----

    def _step_meta(self) -> KvmeshConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvmeshConnectorMetadata)
        return meta

    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError(f"scheduler-side method called on the {self.role.name} connector")
        return self._scheduler

    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError(f"worker-side method called on the {self.role.name} connector")
        return self._worker
