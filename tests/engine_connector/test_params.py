"""kv_transfer_params parsing, the connector's extra config and the vLLM plugin (no engine, no fleet)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from data_plane.types import Medium
from engine_connector.config import ConnectorConfig
from engine_connector.params import InvalidTransferParams, TransferParams

SOURCE = {"kv_request_id": "r", "remote_host": "10.0.0.5", "remote_port": 7100}


def test_no_params_load_and_save_everything() -> None:
    params = TransferParams.parse(None)
    assert params.load and params.save and params.source is None
    assert params.peer_media == {Medium.CPU, Medium.DISK}


def test_remote_kv_source_and_prefiller_name_a_peer() -> None:
    for key in ("remote_kv_source", "remote_prefiller"):
        source = TransferParams.parse({key: {**SOURCE, "remote_node_id": "dp7"}}).source
        assert (source.kind, source.address, source.node_id) == (key, "10.0.0.5:7100", "dp7")


def test_prefiller_plus_kv_source_is_contradictory() -> None:
    with pytest.raises(InvalidTransferParams, match="contradictory"):
        TransferParams.parse({"remote_prefiller": SOURCE, "remote_kv_source": SOURCE})


def test_decoder_plus_kv_source_is_allowed_and_forces_saving() -> None:
    params = TransferParams.parse({"remote_decoder": {"kv_request_id": "d"}, "remote_kv_source": SOURCE,
                                   "kvmesh": {"save": False}})
    assert params.source is not None and params.decoder == {"kv_request_id": "d"} and params.save


@pytest.mark.parametrize("bad", [
    {"remote_kv_source": {"remote_host": "h", "remote_port": "x"}},
    {"remote_kv_source": {"remote_host": "", "remote_port": 1}},
    {"remote_kv_source": "h:1"},
    {"kv_load_tiers": "tape:local"},
    {"kvmesh": {"max_offload_tokens": -1}},
    {"remote_decoder": "yes"},
])
def test_malformed_params_are_rejected(bad) -> None:
    with pytest.raises(InvalidTransferParams):
        TransferParams.parse(bad)


def test_load_tiers_restrict_local_media_and_peers() -> None:
    params = TransferParams.parse({"kv_load_tiers": ["cpu:local"]})
    assert params.local_media == {Medium.CPU} and params.peer_media == frozenset()
    params = TransferParams.parse({"kv_load_tiers": "cpu:local,disk:local,cpu:peer"})
    assert params.local_media == {Medium.CPU, Medium.DISK} and params.peer_media == {Medium.CPU}


def test_extra_config_is_checked_when_the_engine_starts(tmp_path) -> None:
    with pytest.raises(ValueError, match="data_plane_address"):
        ConnectorConfig.from_extra_config({})
    with pytest.raises(ValueError, match="unknown"):
        ConnectorConfig.from_extra_config({"data_plane_address": "h:1", "store_path": "/dev/shm/x"})
    with pytest.raises(ValueError, match="auto_source needs control_plane_address"):
        ConnectorConfig.from_extra_config({"data_plane_address": "h:1", "auto_source": True})
    with pytest.raises(ValueError, match="API key"):
        ConnectorConfig.from_extra_config({"data_plane_address": "h:1"}).key()
    (tmp_path / "k").write_text("kvm_abc_def\n")
    config = ConnectorConfig.from_extra_config({"data_plane_address": "h:1", "api_key_file": str(tmp_path / "k"),
                                                "auto_source": "true", "control_plane_address": "cp:1",
                                                "pull_timeout_ms": "250"})
    assert config.key() == "kvm_abc_def" and config.auto_source and config.pull_timeout_ms == 250


def test_namespace_comes_from_vllm_config(monkeypatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=32, cache_dtype="auto", prefix_caching_hash_algo="sha256_cbor"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(served_model_name="m", model="/models/m", dtype="torch.float32"))
    ns = ConnectorConfig(data_plane_address="h:1", tenant="acme").namespace(vllm_config)
    assert (ns.tenant, ns.model, ns.cache_config.block_size, ns.cache_config.kv_dtype) == ("acme", "m", 32, "float32")
    assert ns.cache_config.hash_seed == "42" and ns.cache_config.parallel_layout == "tp1-pp1"


def test_the_vllm_plugin_registers_the_connector_by_name() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from engine_connector.plugin import register

    register()
    register()  # vLLM may run plugins more than once per process
    config = SimpleNamespace(kv_connector="KvmeshConnector", kv_connector_module_path=None)
    assert KVConnectorFactory.get_connector_class(config).__name__ == "KvmeshConnector"
