"""The ``kvmesh`` vLLM plugin (entry point ``vllm.general_plugins``): registers ``KvmeshConnector``.

With kvmesh installed, ``--kv-transfer-config '{"kv_connector": "KvmeshConnector", ...}'`` finds the
connector without ``kv_connector_module_path``. vLLM runs general plugins in every process it starts.
"""

from __future__ import annotations

CONNECTOR_NAME = "KvmeshConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "engine_connector.connector", CONNECTOR_NAME)
