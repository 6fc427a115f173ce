"""The local fleet's CA and certificates (kvmesh_apps.fleet_tls): made in the workdir with 0600 files, the servers'
valid for the loopback addresses they listen on (a node's also for its node id); a restart in the same workdir keeps
what is current and makes only what is missing or stale."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from kvmesh_apps.fleet_tls import FleetTLS


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def _cert(directory: Path, name: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate((directory / f"{name}.crt").read_bytes())


def test_made_for_every_party_with_owner_only_files(tmp_path):
    tls = FleetTLS.ensure(tmp_path / "tls", ["dp1", "dp2"])
    files = set(_snapshot(tls.directory))
    names = ["ca", "control-plane", "admin", "dp1", "dp2", "engine-dp1", "engine-dp2"]
    assert files == {f"{n}.{ext}" for n in names for ext in ("crt", "key")}
    assert stat.S_IMODE(tls.directory.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in tls.directory.iterdir())
    ca = _cert(tls.directory, "ca")
    for name in names[1:]:
        _cert(tls.directory, name).verify_directly_issued_by(ca)
    # A node's certificate names its node id alone (no address: whatever name a client checks, or none, it cannot
    # answer as the control plane or another node); the control plane's names itself and the loopback it serves on.
    loopback = [ipaddress.ip_address("127.0.0.1")]
    for server, dns_names, ips in (("control-plane", ["control-plane", "localhost"], loopback),
                                   ("dp1", ["dp1"], []), ("dp2", ["dp2"], [])):
        cert = _cert(tls.directory, server)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.DNSName) == dns_names  # and its own name, which clients check
        assert sans.get_values_for_type(x509.IPAddress) == ips
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    client = _cert(tls.directory, "engine-dp1")
    assert list(client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.CLIENT_AUTH]


def test_a_restart_keeps_what_is_current_and_makes_only_what_is_missing(tmp_path):
    directory = tmp_path / "tls"
    FleetTLS.ensure(directory, ["dp1", "dp2"])
    first = _snapshot(directory)
    FleetTLS.ensure(directory, ["dp1", "dp2"])
    assert _snapshot(directory) == first  # nothing re-made

    (directory / "dp2.crt").unlink()  # a lost certificate: that pair alone is issued again
    (directory / "engine-dp1.key").write_bytes(first["admin.key"])  # a key that is not its certificate's
    FleetTLS.ensure(directory, ["dp1", "dp2", "dp3"])  # and a new node
    after = _snapshot(directory)
    remade = {name for name in first if after[name] != first[name]}
    assert remade == {"dp2.crt", "dp2.key", "engine-dp1.crt", "engine-dp1.key"}
    assert {"dp3.crt", "dp3.key", "engine-dp3.crt", "engine-dp3.key"} <= set(after)
    _cert(directory, "dp2").verify_directly_issued_by(_cert(directory, "ca"))

    (directory / "ca.key").unlink()  # the CA lost: a new one, and every certificate it must sign again
    FleetTLS.ensure(directory, ["dp1", "dp2", "dp3"])
    final = _snapshot(directory)
    assert all(final[name] != after[name] for name in after)
    ca = _cert(directory, "ca")
    for name in ("control-plane", "admin", "dp1", "engine-dp3"):
        _cert(directory, name).verify_directly_issued_by(ca)
