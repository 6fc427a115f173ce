"""Mutual TLS for the local fleet (``kvmesh up``, ``kvmesh demo``): a CA of its own and one certificate per party.

Everything lives in ``<workdir>/tls`` (a 0700 directory, every file 0600):

| files | what | used by |
|---|---|---|
| ``ca.crt``, ``ca.key`` | the fleet's private CA (kvmesh/pki.py) | every party trusts ``ca.crt``; the key signs |
| ``control-plane.crt/.key`` | server certificate for the name ``control-plane`` (what the fleet's clients check), 127.0.0.1 and localhost | the control plane |
| ``<node>.crt/.key`` | server certificate for the name ``<node>`` alone (what its peers and its engine check), also its client certificate | data plane ``<node>``: serves, calls the control plane and peers |
| ``engine-<node>.crt/.key`` | client certificate | the engine attached to ``<node>`` (its connector) |
| ``admin.crt/.key`` | client certificate | ``kvmesh admin``, schedulers and routers |

Every server requires a client certificate signed by the CA (mutual TLS), so a client without one, or with one
from another CA, is refused before any RPC; the API keys still say who the caller is (a certificate only says it
belongs to this fleet). On a restart in the same workdir the CA and each certificate are kept while current (signed
by this CA, naming what they should, valid for over ``pki.RENEW_DAYS`` days, key matching): only what is missing or
stale is made.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvmesh import pki
from kvmesh.channels import ClientTLS

CONTROL_PLANE = "control-plane"
ADMIN = "admin"


def server_subject(name: str) -> pki.Subject:
    """A server of the fleet, named by its role: a data plane by its node id alone, which its clients check, so no
    other certificate of the CA answers as it at its address (a port freed by a restart). The control plane's also
    names 127.0.0.1 and localhost: a client dialling the fleet's loopback addresses without naming whom it expects
    (``kvmesh admin`` without ``--tls-server-name``, a raw channel) can only be answered by the control plane's, never
    by a node's (whose key a compromised node holds: it would get the admin's and schedulers' keys)."""
    if name == CONTROL_PLANE:
        return pki.Subject(name, True, (name, "localhost"), ("127.0.0.1",))
    return pki.Subject(name, True, (name,))


def engine_name(node: str) -> str:
    return f"engine-{node}"


def _write(path: Path, text: str) -> None:
    """``text`` into a fresh 0600 file, renamed over ``path`` (never a half-written key or certificate)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.rename(path)


@dataclass(frozen=True)
class FleetTLS:
    """The fleet's TLS files under ``directory``; :meth:`ensure` makes whatever is missing."""

    directory: Path

    @classmethod
    def ensure(cls, directory: Path, nodes: list[str]) -> "FleetTLS":
        """The CA and the certificates of the control plane, ``nodes``, their engines and the admin: kept when
        current, else made."""
        tls = cls(Path(directory))
        tls.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(tls.directory, 0o700)
        ca = tls._authority()
        subjects = [server_subject(CONTROL_PLANE), pki.Subject(ADMIN, False)]
        for node in nodes:  # a node's name is its node id: its peers check it (peer_tls_name)
            subjects += [server_subject(node), pki.Subject(engine_name(node), False)]
        for subject in subjects:
            tls._leaf(ca, subject)
        return tls

    def _authority(self) -> pki.Authority:
        try:
            ca = pki.load_authority(self.ca_file.read_bytes(), (self.directory / "ca.key").read_bytes())
        except OSError:
            ca = None
        if ca is None:
            ca = pki.new_authority("kvmesh local fleet CA")
            _write(self.directory / "ca.key", pki.pem_key(ca.key))
            _write(self.ca_file, pki.pem_cert(ca.cert))
        return ca

    def _leaf(self, ca: pki.Authority, subject: pki.Subject) -> None:
        cert_path, key_path = Path(self.cert_file(subject.name)), Path(self.key_file(subject.name))
        try:
            if pki.is_current(cert_path.read_bytes(), key_path.read_bytes(), ca, subject):
                return
        except OSError:
            pass
        cert, key = pki.issue(ca, subject)
        _write(key_path, pki.pem_key(key))
        _write(cert_path, pki.pem_cert(cert))

    # ---- paths ----

    @property
    def ca_file(self) -> Path:
        return self.directory / "ca.crt"

    def cert_file(self, name: str) -> str:
        return str(self.directory / f"{name}.crt")

    def key_file(self, name: str) -> str:
        return str(self.directory / f"{name}.key")

    # ---- how each party is configured ----

    def client(self, name: str = ADMIN, server: str | None = None) -> ClientTLS:
        """A client presenting ``name``'s certificate (kvmesh.channels), checking the server's certificate names
        ``server``: by default an engine's (``engine-<node>``) its own data plane ``<node>``, else what the address
        does (on loopback only the control plane's certificate names it: give a data plane's node id as
        ``server`` to reach it; :meth:`control_plane_client` for the control plane)."""
        if server is None and name.startswith("engine-"):
            server = name.removeprefix("engine-")
        return ClientTLS(str(self.ca_file), self.cert_file(name), self.key_file(name), server)

    def control_plane_client(self, name: str = ADMIN) -> ClientTLS:
        """A client of the control plane presenting ``name``'s certificate, checking that the server's names the
        control plane (no other certificate of the CA answers as it)."""
        return ClientTLS(str(self.ca_file), self.cert_file(name), self.key_file(name), CONTROL_PLANE)

    def control_plane_flags(self) -> list[str]:
        return ["--tls-cert-file", self.cert_file(CONTROL_PLANE), "--tls-key-file", self.key_file(CONTROL_PLANE),
                "--tls-client-ca-file", str(self.ca_file)]

    def data_plane_flags(self, node: str) -> list[str]:
        """Serve with ``node``'s certificate, require clients' certificates, and present it to the control plane
        and peers (verified against the CA)."""
        return ["--tls-cert-file", self.cert_file(node), "--tls-key-file", self.key_file(node),
                "--tls-client-ca-file", str(self.ca_file), "--tls-ca-file", str(self.ca_file),
                "--tls-server-name", CONTROL_PLANE]

    def connector_settings(self, node: str) -> dict[str, str]:
        """``kv_connector_extra_config`` TLS keys for the engine attached to ``node``."""
        name = engine_name(node)
        return {"tls_ca_file": str(self.ca_file), "tls_cert_file": self.cert_file(name),
                "tls_key_file": self.key_file(name), "data_plane_tls_name": node,
                "control_plane_tls_name": CONTROL_PLANE}

    def admin_flags(self) -> list[str]:
        """``kvmesh admin`` flags (before the command)."""
        return ["--tls-ca-file", str(self.ca_file), "--tls-cert-file", self.cert_file(ADMIN),
                "--tls-key-file", self.key_file(ADMIN), "--tls-server-name", CONTROL_PLANE]

    def describe(self, nodes: list[str]) -> dict:
        """The CA and certificate paths (``kvmesh up --json``)."""
        pair = lambda name: {"cert_file": self.cert_file(name), "key_file": self.key_file(name)}  # noqa: E731
        return {"ca_file": str(self.ca_file), "control_plane_name": CONTROL_PLANE,
                "admin": pair(ADMIN), "control_plane": pair(CONTROL_PLANE),
                "data_planes": {node: pair(node) for node in nodes},
                "engines": {node: pair(engine_name(node)) for node in nodes}}
