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
CA signed it, it names what it should and it is valid for more than ``RENEW_DAYS``; otherwise it is issued again
(a new CA, when the old one is gone or expiring, re-issues every certificate).

Nothing is a default: each password and key is random. A file that exists is kept, so a second ``up`` keeps the
credentials Redis (with its AOF volume) already knows; ``docker compose down -v`` starts over. The ACL template's
``#@NAME`` placeholders become the SHA-256 of a fresh password for user NAME (Redis stores and compares hashes).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import secrets
import sys
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

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
    key = Ed25519PrivateKey.generate()
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


CA_DAYS = 3650
LEAF_DAYS = 825
RENEW_DAYS = 30  # a certificate valid for fewer days than this is issued again


def _pem_key(key) -> str:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def _pem_cert(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _fresh(cert: x509.Certificate) -> bool:
    return cert.not_valid_after_utc - _now() > datetime.timedelta(days=RENEW_DAYS)


def _ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The deployment's CA: kept while valid, else a new one (every certificate it signed is then issued again)."""
    try:
        cert = x509.load_pem_x509_certificate((directory / "ca.crt").read_bytes())
        key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), None)
        if _fresh(cert) and cert.public_key() == key.public_key():
            print(f"secrets-init: kept {directory / 'ca.crt'}")
            return cert, key
    except (OSError, ValueError):
        pass
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvmesh deployment CA {secrets.token_hex(4)}")])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(_now() - datetime.timedelta(minutes=5))
            .not_valid_after(_now() + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256()))
    _write(directory / "ca.key", _pem_key(key), 0)
    _write(directory / "ca.crt", _pem_cert(cert), 0, 0o444)
    return cert, key


def _current(path: Path, ca: x509.Certificate, name: str, server: bool) -> bool:
    """Whether the certificate at ``path`` is signed by ``ca``, names ``name`` (as a server: its DNS SAN) and is
    fresh."""
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        cert.verify_directly_issued_by(ca)
    except (OSError, ValueError, TypeError, InvalidSignature):
        return False
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName)
    except x509.ExtensionNotFound:
        sans = []
    return _fresh(cert) and cert.subject.rfc4514_string() == f"CN={name}" and sans == ([name] if server else [])


def _issue(directory: Path, name: str, ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], server: bool) -> None:
    """``directory``/tls.crt + tls.key for ``name`` (server: also valid as a client) and the CA's certificate, owned
    by the kvmesh user (every TLS consumer runs as it)."""
    ca_cert, ca_key = ca
    ca_path = directory / "ca.crt"
    if not ca_path.exists() or ca_path.read_text() != _pem_cert(ca_cert):
        _write(ca_path, _pem_cert(ca_cert), KVMESH_UID, 0o444)
    if _current(directory / "tls.crt", ca_cert, name, server) and (directory / "tls.key").exists():
        print(f"secrets-init: kept {directory / 'tls.crt'}")
        return
    key = ec.generate_private_key(ec.SECP256R1())
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if server else [
        ExtendedKeyUsageOID.CLIENT_AUTH]
    builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(_now() - datetime.timedelta(minutes=5))
               .not_valid_after(_now() + datetime.timedelta(days=LEAF_DAYS))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                            crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
    _write(directory / "tls.key", _pem_key(key), KVMESH_UID)
    _write(directory / "tls.crt", _pem_cert(builder.sign(ca_key, hashes.SHA256())), KVMESH_UID, 0o444)


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
