"""vLLM engine connector for kvmesh.

``engine_connector.connector.KvmeshConnector`` is the ``KVConnectorBase_V1`` implementation
vLLM loads out of tree; ``engine_connector.block_store`` holds the storage contract it uses.
This package module imports nothing so that ``block_store`` stays usable without vLLM.
"""
