"""``kvmesh admin``: tenant administration from the command line (its usage is :data:`USAGE`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from pathlib import Path

from google.protobuf.json_format import MessageToDict

from kvmesh.channels import ClientTLS, channel
from kvmesh.command_line import Parser, UsageError, host_port, non_negative_int
from kvmesh.v1 import tenant_admin_pb2 as pb, tenant_admin_pb2_grpc as pb_grpc

from tenancy import api_keys

USAGE = """\
commands:
  kvmesh admin new-key                        print a fresh bootstrap admin key
  kvmesh admin [--control-plane HOST:PORT] [--key K | --key-file F] COMMAND ...
    tenants create ID [--name N] [policy flags] | list | get ID | delete ID | policy ID [policy flags]
    keys issue --role admin|scheduler|node [--tenant T] [--node N] [--pool P] [--description D]
               [--secret-out FILE]
    keys list [--tenant T] | rotate KEY_ID | revoke KEY_ID
    redis rotate ID
    audit [--limit N]
Policy flags: --allowed-node N (repeat), --allowed-pool P, --shared-with T ("*" = everyone),
--max-index-entries N, --max-cpu-tier-bytes-per-node N, --max-namespaces N.
The control plane is HOST:PORT (default $KVMESH_CONTROL_PLANE, else 127.0.0.1:50051, the control plane's default).
The key comes from --key, else --key-file (a file holding it), else $KVMESH_ADMIN_KEY (the key itself, not a
file). Output is JSON. Errors are one line on stderr.
TLS: --tls-ca-file (the CA of the control plane's certificate; unset: plaintext), --tls-cert-file and
--tls-key-file (this client's certificate, for a control plane that requires mutual TLS), --tls-server-name (the
name to check instead of the host in --control-plane); each defaults to $KVMESH_ADMIN_TLS_CA_FILE,
$KVMESH_ADMIN_TLS_CERT_FILE, $KVMESH_ADMIN_TLS_KEY_FILE, $KVMESH_ADMIN_TLS_SERVER_NAME.
"""

ROLES = {"admin": pb.ROLE_ADMIN, "scheduler": pb.ROLE_SCHEDULER, "node": pb.ROLE_NODE}


def _policy_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allowed-node", action="append", default=[])
    p.add_argument("--allowed-pool", action="append", default=[])
    p.add_argument("--shared-with", action="append", default=[])
    p.add_argument("--max-index-entries", type=non_negative_int, default=0)
    p.add_argument("--max-cpu-tier-bytes-per-node", type=non_negative_int, default=0)
    p.add_argument("--max-namespaces", type=non_negative_int, default=0)


def _policy(a) -> pb.TenantPolicy:
    return pb.TenantPolicy(allowed_nodes=a.allowed_node, allowed_pools=a.allowed_pool, shared_with=a.shared_with,
                           max_index_entries=a.max_index_entries,
                           max_cpu_tier_bytes_per_node=a.max_cpu_tier_bytes_per_node,
                           max_namespaces=a.max_namespaces)


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvmesh admin", description="tenant administration: tenants, keys, policies, audit",
                    formatter_class=argparse.RawDescriptionHelpFormatter, epilog=USAGE)
    parser.add_argument("--control-plane", type=host_port,
                        default=os.environ.get("KVMESH_CONTROL_PLANE") or "127.0.0.1:50051",
                        help="HOST:PORT of the control plane (default: $KVMESH_CONTROL_PLANE, else 127.0.0.1:50051)")
    parser.add_argument("--key", help="an admin API key (prefer --key-file: nothing secret on a command line)")
    parser.add_argument("--key-file", help="file holding the admin API key (with neither --key nor --key-file: "
                        "the key itself from $KVMESH_ADMIN_KEY)")
    for name in ("ca-file", "cert-file", "key-file", "server-name"):
        env = "KVMESH_ADMIN_TLS_" + name.upper().replace("-", "_")
        parser.add_argument(f"--tls-{name}", default=os.environ.get(env) or None, help=f"default: ${env}")
    groups = parser.add_subparsers(dest="group", metavar="COMMAND", required=True)
    groups.add_parser("new-key", help="print a fresh bootstrap admin key")
    tenants = groups.add_parser("tenants", help="create, list, get, delete a tenant; set its policy")
    tenants = tenants.add_subparsers(dest="command", required=True)
    create = tenants.add_parser("create")
    create.add_argument("tenant_id")
    create.add_argument("--name", default="")
    _policy_flags(create)
    tenants.add_parser("list")
    for name in ("get", "delete"):
        tenants.add_parser(name).add_argument("tenant_id")
    policy = tenants.add_parser("policy")
    policy.add_argument("tenant_id")
    _policy_flags(policy)
    keys = groups.add_parser("keys", help="issue, list, rotate, revoke API keys")
    keys = keys.add_subparsers(dest="command", required=True)
    issue = keys.add_parser("issue")
    issue.add_argument("--role", choices=sorted(ROLES), required=True)
    issue.add_argument("--tenant", default="")
    issue.add_argument("--node", default="")
    issue.add_argument("--pool", default="")
    issue.add_argument("--description", default="")
    issue.add_argument("--secret-out", help="also write the secret alone to this file (mode 600)")
    keys.add_parser("list").add_argument("--tenant", default="")
    for name in ("rotate", "revoke"):
        keys.add_parser(name).add_argument("key_id")
    redis = groups.add_parser("redis", help="rotate a tenant's Redis credentials")
    redis = redis.add_subparsers(dest="command", required=True)
    redis.add_parser("rotate").add_argument("tenant_id")
    audit = groups.add_parser("audit", help="the newest audit entries")
    audit.add_argument("--limit", type=non_negative_int, default=100, help="how many (0: 100)")
    return parser


def _tls(a) -> ClientTLS | None:
    if not a.tls_ca_file:
        if a.tls_cert_file or a.tls_key_file or a.tls_server_name:
            raise UsageError("TLS settings without --tls-ca-file; give the CA of the control plane's certificate")
        return None
    return ClientTLS(a.tls_ca_file, a.tls_cert_file, a.tls_key_file, a.tls_server_name)


async def _call(a, key: str):
    async with channel(a.control_plane, key, _tls(a)) as ch:
        stub = pb_grpc.TenantAdminStub(ch)
        match (a.group, getattr(a, "command", None)):
            case ("tenants", "create"):
                return await stub.CreateTenant(pb.CreateTenantRequest(tenant_id=a.tenant_id, display_name=a.name,
                                                                      policy=_policy(a)))
            case ("tenants", "list"):
                return await stub.ListTenants(pb.ListTenantsRequest())
            case ("tenants", "get"):
                return await stub.GetTenant(pb.GetTenantRequest(tenant_id=a.tenant_id))
            case ("tenants", "delete"):
                return await stub.DeleteTenant(pb.DeleteTenantRequest(tenant_id=a.tenant_id))
            case ("tenants", "policy"):
                return await stub.SetPolicy(pb.SetPolicyRequest(tenant_id=a.tenant_id, policy=_policy(a)))
            case ("keys", "issue"):
                return await stub.IssueKey(pb.IssueKeyRequest(role=ROLES[a.role], tenant_id=a.tenant,
                                                              node_id=a.node, pool=a.pool,
                                                              description=a.description))
            case ("keys", "list"):
                return await stub.ListKeys(pb.ListKeysRequest(tenant_id=a.tenant))
            case ("keys", "rotate"):
                return await stub.RotateKey(pb.RotateKeyRequest(key_id=a.key_id))
            case ("keys", "revoke"):
                return await stub.RevokeKey(pb.RevokeKeyRequest(key_id=a.key_id))
            case ("redis", "rotate"):
                return await stub.RotateRedisCredentials(pb.RotateRedisCredentialsRequest(tenant_id=a.tenant_id))
            case ("audit", _):
                return await stub.ListAudit(pb.ListAuditRequest(limit=a.limit))
    raise AssertionError(f"unhandled command {a.group} {a.command}")


def _secret_out(path: str) -> tuple[int, str]:
    """A new file (mode 0600) beside ``--secret-out``, made before a key is issued, so that a path that cannot be
    written fails the command before a key exists whose secret nobody saw; renamed over the path once written."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"--secret-out {path} is a directory; name a file")
    try:
        return tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    except OSError as exc:
        raise UsageError(f"--secret-out {path}: cannot write in {target.parent} ({exc.strerror}); name a file in "
                         "a directory you may write") from None


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    if a.group == "new-key":
        print(api_keys.new_key()[1])
        return 0
    key = api_keys.key_from_setting(a.key, a.key_file) or api_keys.key_from_setting(
        os.environ.get("KVMESH_ADMIN_KEY"), None)
    if not key:
        raise UsageError("no API key; give --key-file FILE (or --key, or set $KVMESH_ADMIN_KEY)")
    _tls(a)  # settings checked before anything is sent
    fd, staged = _secret_out(a.secret_out) if getattr(a, "secret_out", None) else (None, "")
    try:
        reply = asyncio.run(_call(a, key))
        if fd is not None:
            with os.fdopen(fd, "w") as out:
                fd = None
                out.write(reply.secret + "\n")
            os.replace(staged, a.secret_out)
    except BaseException:
        if fd is not None:
            os.close(fd)
        if staged:
            Path(staged).unlink(missing_ok=True)
        raise
    print(json.dumps(MessageToDict(reply, preserving_proto_field_name=True), indent=2))
    return 0
