"""The compose init step: every secret of the deployment, generated on first start, one volume per consumer.

    python init_secrets.py --acl-template /etc/kvmesh/users.acl --nodes dp1,dp2 \
        --tls-servers control-plane,dp1,dp2 --tls-clients engine1,engine2,admin

Runs as root in the ``secrets-init`` one-shot service (docker-compose.yml) with these volumes mounted:

| path | volume | written here | mounted afterwards into |
|---|---|---|---|
| /secrets/admin | admin-secrets | ``admin.key`` (bootstrap admin API key) | control-plane, keys-init, admin |
| /secrets/control-plane | cp-secrets | ``redis-password``, ``redis-acl-password`` (its ACL-only user), ``grant-key.pem`` (Ed25519, signs pull grants), ``tenant-secret`` (tenant Redis passwords derive from it) | control-plane |
| /secrets/redis | redis-secrets | ``users.acl`` (password hashes only), ``healthcheck-password`` | redis |
| /secrets/nodes/<node> | <node>-secrets | nothing: the directory, owned by the kvmesh user; ``keys-init`` issues the node key into it | that node's data plane and engine |
| /secrets/ca | ca-secrets | ``ca.key``, ``ca.crt``: the deployment's private CA (ECDSA P-256) | nothing else |
| /secrets/tls/<name> | <name>-tls | ``tls.key``, ``tls.crt`` (signed by the CA), ``ca.crt`` | that one service |

TLS: each name in ``--tls-servers`` gets a server certificate for the DNS name ``<name>`` (its compose service name)
that also serves as its client certificate (data planes call the control plane and each other); each name in
``--tls-clients`` a client certificate only (engines' connectors, the admin CLI). A certificate is kept while the
CA signed it, it names what it should and it is valid for more than ``RENEW_DAYS`` (kvmesh/pki.py, shared with
``kvmesh up``); otherwise it is issued again (a new CA, when the old one is gone or expiring, re-issues every
certificate).

Nothing is a default: each password and key is random. A file that exists is kept, so a second ``up`` keeps the
credentials Redis (with its AOF volume) already knows; ``docker compose down -v`` starts over. The ACL template's
``#@NAME`` placeholders become the SHA-256 of a fresh password for user NAME (Redis stores and compares hashes).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import sys
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvmesh import pki
from tenancy.api_keys import new_key

KVMESH_UID = 10001  # the image's kvmesh user (docker/Dockerfile)
REDIS_UID = 999  # the redis user of both Redis images (docker/redis/Dockerfile)
# Redis ACL user -> (file its password is written to, under the root, and the uid owning that file).
REDIS_PASSWORDS = {
    "kvmesh-cp": ("control-plane/redis-password", KVMESH_UID),
    "kvmesh-acl": ("control-plane/redis-acl-password", KVMESH_UID),
    "healthcheck": ("redis/healthcheck-password", REDIS_UID),
}


def _write(path: Path, text: str, uid: int, mode: int = 0o400) -> None:
    """Write a secret file readable by ``uid`` alone (created with its mode, never world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chown(path.parent, uid, uid)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chown(tmp, uid, uid)
    os.chmod(tmp, mode)
    tmp.rename(path)
    print(f"secrets-init: wrote {path}")


def _ensure(path: Path, make, uid: int, mode: int = 0o400) -> None:
    if path.exists():
        print(f"secrets-init: kept {path}")
        return
    _write(path, make(), uid, mode)


def _grant_key() -> str:
    return pki.pem_key(Ed25519PrivateKey.generate())


def _ca(directory: Path) -> pki.Authority:
    """The deployment's CA: kept while valid, else a new one (every certificate it signed is then issued again)."""
    try:
        ca = pki.load_authority((directory / "ca.crt").read_bytes(), (directory / "ca.key").read_bytes())
    except OSError:
        ca = None
    if ca is not None:
        print(f"secrets-init: kept {directory / 'ca.crt'}")
        return ca
    ca = pki.new_authority("kvmesh deployment CA")
    _write(directory / "ca.key", pki.pem_key(ca.key), 0)
    _write(directory / "ca.crt", pki.pem_cert(ca.cert), 0, 0o444)
    return ca


def _issue(directory: Path, name: str, ca: pki.Authority, server: bool) -> None:
    """``directory``/tls.crt + tls.key for ``name`` (server: DNS name ``name``, also valid as a client) and the CA's
    certificate, owned by the kvmesh user (every TLS consumer runs as it)."""
    ca_path = directory / "ca.crt"
    if not ca_path.exists() or ca_path.read_text() != pki.pem_cert(ca.cert):
        _write(ca_path, pki.pem_cert(ca.cert), KVMESH_UID, 0o444)
    subject = pki.Subject(name, server, dns_names=(name,) if server else ())
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    if (cert_path.exists() and key_path.exists()
            and pki.is_current(cert_path.read_bytes(), key_path.read_bytes(), ca, subject)):
        print(f"secrets-init: kept {cert_path}")
        return
    cert, key = pki.issue(ca, subject)
    _write(key_path, pki.pem_key(key), KVMESH_UID)
    _write(cert_path, pki.pem_cert(cert), KVMESH_UID, 0o444)


def _names(text: str) -> list[str]:
    return [name for name in text.split(",") if name]


def _render_acl(root: Path, template: str) -> str:
    """The ACL file with each ``#@NAME`` replaced by the hash of a new password, written to its consumer's file."""
    lines = []
    for line in template.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue  # Redis ACL files have no comments
        for user, (path, uid) in REDIS_PASSWORDS.items():
            if f"#@{user}" in line:
                password = secrets.token_urlsafe(32)
                _write(root / path, password + "\n", uid)
                line = line.replace(f"#@{user}", "#" + hashlib.sha256(password.encode()).hexdigest())
        if "#@" in line:
            raise SystemExit(f"secrets-init: no password file for the placeholder in {line!r}")
        lines.append(line)
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--acl-template", type=Path, required=True)
    parser.add_argument("--nodes", required=True, help="comma-separated node ids")
    parser.add_argument("--tls-servers", default="", help="comma-separated service names: a server certificate "
                        "(DNS name = the service name, usable as a client certificate too) each")
    parser.add_argument("--tls-clients", default="", help="comma-separated names: a client certificate each")
    parser.add_argument("--root", type=Path, default=Path("/secrets"), help="where the volumes are mounted")
    args = parser.parse_args(argv)
    root = args.root
    os.umask(0o077)
    _ensure(root / "admin/admin.key", lambda: new_key()[1] + "\n", KVMESH_UID)
    _ensure(root / "control-plane/grant-key.pem", _grant_key, KVMESH_UID, 0o600)
    _ensure(root / "control-plane/tenant-secret", lambda: secrets.token_urlsafe(32) + "\n", KVMESH_UID)
    # The ACL file is Redis's to rewrite (ACL SAVE keeps the per-tenant users): writable by Redis alone.
    _ensure(root / "redis/users.acl", lambda: _render_acl(root, args.acl_template.read_text()), REDIS_UID, 0o600)
    for node in filter(None, args.nodes.split(",")):
        directory = root / "nodes" / node
        directory.mkdir(parents=True, exist_ok=True)
        os.chown(directory, KVMESH_UID, KVMESH_UID)
        os.chmod(directory, 0o700)
    servers, clients = _names(args.tls_servers), _names(args.tls_clients)
    if set(servers) & set(clients):
        raise SystemExit("secrets-init: a name is both a TLS server and a TLS client")
    if servers or clients:
        ca = _ca(root / "ca")
        for name in servers + clients:
            _issue(root / "tls" / name, name, ca, server=name in servers)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
