"""vLLM engine connector for kvmesh.

``engine_connector.connector.KvmeshConnector`` is the ``KVConnectorBase_V1`` implementation
vLLM loads (out of tree, or registered by the ``kvmesh`` vLLM plugin, :mod:`.plugin`). Reading
order: ``params`` (per-request options) -> ``config`` (extra config, namespace) -> ``node_link``
(RPCs to the node) -> ``scheduler_side`` (find, pull, pin, plan) -> ``metadata`` (what crosses to
the worker) -> ``worker_side`` + ``kv_layout`` (memory copies) -> ``connector`` (vLLM's hooks).
docs/engine_connector.md has the sequence diagram and the failure policy.
"""
