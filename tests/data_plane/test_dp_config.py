"""The node's typed configuration refuses what would silently break a fleet."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvmesh.errors import InvalidArgument

from data_plane.config import DataPlaneConfig
from data_plane.types import Locality, Medium, TierFilter


def cfg(**kw) -> DataPlaneConfig:
    return DataPlaneConfig(**{"node_id": "n1", "capacity_bytes": 1 << 20, "block_bytes": 1 << 16, **kw})


def test_defaults_advertise_the_listen_address_with_the_bound_port():
    c = cfg(listen="127.0.0.1:0")
    assert c.num_slots == 16 and c.advertised(4242) == "127.0.0.1:4242"
    assert cfg(listen="0.0.0.0:7000", advertise_address="10.1.2.3").advertised(7000) == "10.1.2.3:7000"
    assert cfg(listen="0.0.0.0:7000", advertise_address="node1.example:9000").advertised(7000) == "node1.example:9000"


@pytest.mark.parametrize("kw, message", [
    (dict(listen="0.0.0.0:7000"), "not an address peers can reach"),
    (dict(listen="[::]:7000"), "not an address peers can reach"),
    (dict(listen="0.0.0.0:7000", advertise_address="0.0.0.0"), "not an address peers can reach"),
    (dict(listen="10.0.0.5:7000", advertise_address="224.0.0.1"), "not an address peers can reach"),
    (dict(listen="0.0.0.0:7000", advertise_address="127.0.0.1"), "loopback"),
    (dict(capacity_bytes=100), "holds no block"),
    (dict(lease_ms=10, max_lease_ms=5), "lease_ms must not exceed"),
    (dict(node_id="a/b"), "node_id"),
    (dict(node_id="a b"), "is not valid"),  # the tier file is named after it, and the control plane refuses it
    (dict(disk_dir="/tmp/x"), "disk_capacity_bytes"),
    (dict(node_id="rack:7", tls_ca_file="/ca.crt"), "cannot be a certificate's DNS name"),
])
def test_refuses(kw, message):
    with pytest.raises(ValidationError, match=message):
        cfg(**kw)


def test_a_peer_certificate_must_name_the_node_id_dialled_unless_told_otherwise():
    tls = dict(tls_ca_file="/ca.crt", tls_cert_file="/n1.crt", tls_key_file="/n1.key", tls_server_name="cp.internal")
    c = cfg(**tls)
    assert c.client_tls().server_name == "cp.internal"  # the control plane's name, as set
    assert c.peer_tls("dp2").server_name == "dp2" and c.peer_tls("dp2").cert_file == "/n1.crt"
    assert cfg(**tls, peer_tls_name="address").peer_tls("dp2").server_name == "cp.internal"
    assert cfg(node_id="rack:7", peer_tls_name="address", tls_ca_file="/ca.crt").peer_tls("x").server_name is None
    assert cfg(node_id="rack:7").peer_tls("dp2") is None  # plaintext: nothing to check


def test_env_prefix(monkeypatch):
    monkeypatch.setenv("KVMESH_DP_CAPACITY_BYTES", "2MiB")
    monkeypatch.setenv("KVMESH_DP_EVICTION_POLICY", "arc")
    c = DataPlaneConfig(node_id="n1", block_bytes=1 << 16)
    assert c.num_slots == 32 and c.eviction_policy == "arc"


def test_tier_filter_parses_kv_load_tiers():
    f = TierFilter.parse("disk:local, cpu:peer")
    assert f.media(Locality.LOCAL) == {Medium.CPU, Medium.DISK}  # the CPU tier is always allowed
    assert f.media(Locality.PEER) == {Medium.CPU}
    assert TierFilter.parse("").media(Locality.PEER) == frozenset()
    assert TierFilter.everything().allows(Medium.DISK, Locality.PEER)
    with pytest.raises(InvalidArgument, match="MEDIUM:LOCALITY"):
        TierFilter.parse("gpu:local")
