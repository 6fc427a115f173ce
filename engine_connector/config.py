"""The connector's configuration (``kv_connector_extra_config``) and the namespace it derives.

Everything a block's identity depends on comes from vLLM's own configuration (block size,
KV dtype, parallel layout, hash algorithm, ``PYTHONHASHSEED``) plus three names the operator
gives (tenant, model, weight version); a misconfiguration fails when the engine starts, never
per request.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from kvmesh.channels import ClientTLS
from kvmesh.namespace import ENGINE_KV_LAYOUT, Namespace, engine_namespace
from tenancy import api_keys

if TYPE_CHECKING:
    from vllm.config import VllmConfig

KV_LAYOUT = ENGINE_KV_LAYOUT  # the byte layout of a block in a data-plane slot (kv_layout.py)


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` keys (all strings/numbers, JSON-friendly).

    ``data_plane_address``: host:port of this node's data plane (required).
    ``api_key`` / ``api_key_file``: the node's API key (the data plane's local API and the
    control plane need it). ``control_plane_address``: for ``auto_source`` and for resolving a
    ``remote_kv_source`` given without ``remote_node_id``. ``tenant``, ``model``,
    ``weight_version``: the namespace (``model`` defaults to vLLM's served model name).
    ``auto_source``: with no ``remote_kv_source`` on a request, ask the control plane which
    peer holds the longest prefix and pull from it when it holds more than this node.
    ``pull_timeout_ms``: bound of one pull (the scheduler waits at most this long).
    ``min_pull_blocks``: pull only when the peer would add at least this many blocks.
    ``max_offload_tokens``: default per-request cap of saved tokens (0: none).
    ``max_lookup_blocks``: most blocks one request looks up and loads (the data plane refuses more than its
    ``max_hashes_per_request``, 4,096 by default): a longer prompt looks up its leading blocks.
    ``lease_ms``: how long acquired blocks stay pinned for the worker's copy.
    ``rpc_timeout_s``: deadline of every other RPC.
    ``tls_ca_file``: CA of the data plane's and control plane's certificates (TLS on both links; unset:
    plaintext); ``tls_cert_file`` / ``tls_key_file``: this engine's certificate for mutual TLS;
    ``tls_server_name``: name to check instead of the host in the address; ``data_plane_tls_name`` /
    ``control_plane_tls_name``: the same for one link (``kvmesh up`` sets them: the node id, ``control-plane``,
    so no other certificate of the fleet's CA answers as these servers).
    ``misplace_one_block``: a negative-control hook for correctness checks, never for serving:
    the worker writes one loaded block per request from the wrong slot (worker_side.py).
    """

    data_plane_address: str
    api_key: str = ""
    api_key_file: str = ""
    control_plane_address: str = ""
    tenant: str = "default"
    model: str = ""
    weight_version: str = ""
    auto_source: bool = False
    pull_timeout_ms: int = 5_000
    min_pull_blocks: int = 1
    max_offload_tokens: int = 0
    max_lookup_blocks: int = 4096
    lease_ms: int = 30_000
    rpc_timeout_s: float = 5.0
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_server_name: str = ""
    data_plane_tls_name: str = ""
    control_plane_tls_name: str = ""
    misplace_one_block: bool = False

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> "ConnectorConfig":
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"KvmeshConnector: unknown kv_connector_extra_config keys {unknown}; "
                             f"known: {sorted(known)}")
        if not extra.get("data_plane_address"):
            raise ValueError("KvmeshConnector needs kv_connector_extra_config['data_plane_address']")
        values: dict[str, Any] = {}
        for name, value in extra.items():
            kind = known[name].type
            if kind == "bool":
                values[name] = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
            elif kind == "int":
                values[name] = int(value)
            elif kind == "float":
                values[name] = float(value)
            else:
                values[name] = str(value)
        config = cls(**values)
        if config.auto_source and not config.control_plane_address:
            raise ValueError("KvmeshConnector: auto_source needs control_plane_address")
        if min(config.pull_timeout_ms, config.lease_ms, config.rpc_timeout_s, config.max_lookup_blocks) <= 0:
            raise ValueError("KvmeshConnector: pull_timeout_ms, lease_ms, rpc_timeout_s and max_lookup_blocks must "
                             "be positive")
        return config

    def tls(self, server_name: str = "") -> ClientTLS | None:
        """TLS for the engine's links, checking ``server_name`` (else ``tls_server_name``, else the address's
        host) in the server's certificate (None: plaintext)."""
        if not self.tls_ca_file:
            return None
        return ClientTLS(self.tls_ca_file, self.tls_cert_file or None, self.tls_key_file or None,
                         server_name or self.tls_server_name or None)

    def key(self) -> str:
        """The node's API key (``api_key``, else the contents of ``api_key_file``)."""
        key = api_keys.key_from_setting(self.api_key, self.api_key_file)
        if key:
            return key
        raise ValueError("KvmeshConnector needs the node's API key: set api_key or api_key_file in "
                         "kv_connector_extra_config")

    def namespace(self, vllm_config: "VllmConfig") -> Namespace:
        """The namespace of this engine's blocks, from vLLM's configuration."""
        cache = vllm_config.cache_config
        parallel = vllm_config.parallel_config
        model = self.model or vllm_config.model_config.served_model_name or vllm_config.model_config.model
        if isinstance(model, (list, tuple)):
            model = model[0]
        dtype = cache.cache_dtype if cache.cache_dtype != "auto" else str(vllm_config.model_config.dtype)
        # vLLM seeds NONE_HASH with PYTHONHASHSEED when set (kvmesh.hashing).
        return engine_namespace(str(model), block_size=cache.block_size, kv_dtype=dtype, tenant=self.tenant,
                                weight_version=self.weight_version,
                                tensor_parallel_size=parallel.tensor_parallel_size,
                                pipeline_parallel_size=parallel.pipeline_parallel_size,
                                hash_algo=cache.prefix_caching_hash_algo,
                                hash_seed=os.environ.get("PYTHONHASHSEED", ""))
