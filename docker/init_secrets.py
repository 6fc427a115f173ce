"""The compose init step: every secret of the deployment, generated on first start, one volume per consumer.

    python init_secrets.py --acl-template /etc/kvmesh/users.acl --nodes dp1,dp2

Runs as root in the ``secrets-init`` one-shot service (docker-compose.yml) with these volumes mounted:

| path | volume | written here | mounted afterwards into |
|---|---|---|---|
| /secrets/admin | admin-secrets | ``admin.key`` (bootstrap admin API key) | control-plane, keys-init, admin |
| /secrets/control-plane | cp-secrets | ``redis-password``, ``redis-acl-password`` (its ACL-only user), ``grant-key.pem`` (Ed25519, signs pull grants), ``tenant-secret`` (tenant Redis passwords derive from it) | control-plane |
| /secrets/redis | redis-secrets | ``users.acl`` (password hashes only), ``healthcheck-password`` | redis |
| /secrets/nodes/<node> | <node>-secrets | nothing: the directory, owned by the kvmesh user; ``keys-init`` issues the node key into it | that node's data plane and engine |

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

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
