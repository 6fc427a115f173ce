"""A black-box judge of a running `kvmesh up` fleet, holding ONE node's key (dp1's key file and dp1's TLS
certificate, what that node got from provisioning) and nothing else of the fleet's secrets.

The operator's side (the admin key) only sets the stage: a tenant ``victim`` whose policy allows dp2 alone, a
victim scheduler key (positive controls), victim blocks and ``demo`` blocks committed on dp2 by dp2's own key
(what dp2's engine does). Then, as dp1, every RPC of the control plane, the tenant admin API and the data planes is
tried to see, probe, pull or overwrite the victim's blocks, act as dp2, escalate to admin, forge or replay
grants, tickets and proofs, exhaust resources and crash a service with malformed input. Each probe is a row
(area, what, expected, got, ok); a positive control shows the target was there to be had.

    python -m tests.security.blackbox_probe [--workdir DIR]   # starts `kvmesh up`, probes, prints the table

``tests/security/test_up_blackbox.py`` runs it (heavy: a whole fleet).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import ssl
import subprocess
import sys
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from data_plane.client import DataPlaneClient as _DataPlaneClient, SharedTier
from engine_connector.config import KV_LAYOUT
from kvmesh.channels import ClientTLS, channel as _channel
from kvmesh.hashing import BlockHasher
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh.v1 import (
    common_pb2, control_plane_pb2 as cp_pb, control_plane_pb2_grpc as cp_grpc, data_plane_pb2 as dp_pb,
    data_plane_pb2_grpc as dp_grpc, tenant_admin_pb2 as ta_pb, tenant_admin_pb2_grpc as ta_grpc,
)
from tenancy.auth import GRANT_METADATA
from tenancy.peer_proof import PROOF_METADATA, NodeIdentity, PeerCall

_NODE_AT: dict[str, str] = {}  # a data plane's address -> its node id, the one name its certificate gives


def _named(address: str, tls: ClientTLS | None) -> ClientTLS | None:
    """``tls`` checking the node id of the data plane at ``address`` (a data plane's certificate names nothing
    else, no address; the probe may name whichever server it dials, as any client may)."""
    if tls is None or tls.server_name or address not in _NODE_AT:
        return tls
    return dataclasses.replace(tls, server_name=_NODE_AT[address])


def channel(address: str, key: str | None, tls: ClientTLS | None = None):
    return _channel(address, key, _named(address, tls))


class DataPlaneClient(_DataPlaneClient):
    def __init__(self, address: str, *args, tls: ClientTLS | None = None, **kwargs) -> None:
        super().__init__(address, *args, tls=_named(address, tls), **kwargs)


BLOCK_TOKENS = 32
# The HTTP/2 client preface and an empty SETTINGS frame: a connection that has handshaken, then never calls.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
VICTIM = "victim"
OK = "OK"


@dataclass
class Row:
    area: str
    what: str
    expected: str
    got: str
    ok: bool


def ns_of(tenant: str) -> Namespace:
    return Namespace(tenant, "tiny", "rev1", CacheConfig(block_size=BLOCK_TOKENS, kv_dtype="float32",
                                                         kv_layout=KV_LAYOUT)).validate()


def hashes_of(seed: int, n: int = 3) -> list[bytes]:
    return BlockHasher().block_hashes([seed * 1000 + i for i in range(n * BLOCK_TOKENS)], BLOCK_TOKENS)


async def outcome(coro) -> tuple[str, str, object]:
    """(status code name, details, reply) of one RPC."""
    try:
        reply = await coro
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details() or "", None
    return OK, "", reply


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class PeakRss:
    """The largest growth of a process's resident memory while the block runs (sampled every 20 ms)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.before = self.peak = rss_kib(pid)
        self._stop = asyncio.Event()
        self._sampler: asyncio.Future | None = None

    @property
    def grew_mib(self) -> float:
        return (self.peak - self.before) / 1024

    async def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_kib(self.pid))
            await asyncio.sleep(0.02)

    async def __aenter__(self) -> "PeakRss":
        self._sampler = asyncio.ensure_future(self._sample())
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        await self._sampler


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def pid_listening_on(port: int | str) -> int | None:
    """The pid of the process that listens on 127.0.0.1:``port``, or on the Unix socket at path ``port`` (via
    /proc/net/tcp or /proc/net/unix and each process's fds)."""
    inodes = set()
    if isinstance(port, str):
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) == 8 and fields[7] == port:
                inodes.add(fields[6])
    for table in ("/proc/net/tcp", "/proc/net/tcp6") if isinstance(port, int) else ():
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    return int(proc.name)
        except (PermissionError, FileNotFoundError, ProcessLookupError):
            continue
    return None


def redis_socket(url: str) -> int | str:
    """Where the fleet's Redis listens: a port (redis://host:port/db) or a Unix socket's path (unix://path?db=0)."""
    if url.startswith("unix://"):
        return url.removeprefix("unix://").split("?")[0]
    return int(url.rsplit(":", 1)[1].split("/")[0])


class Judge:
    def __init__(self, info: dict) -> None:
        self.info = info
        self.rows: list[Row] = []
        tls = info.get("tls")
        workdir = Path(info["workdir"])
        self.cp = info["control_plane"]
        self.dps = info["data_planes"]
        _NODE_AT.update({address: node for node, address in self.dps.items()})
        self.key = {n: Path(f).read_text().strip() for n, f in info["node_key_files"].items()}
        self.admin_key = Path(info["admin_key_file"]).read_text().strip()
        if tls:
            self.tls = {n: ClientTLS(tls["ca_file"], c["cert_file"], c["key_file"])
                        for n, c in tls["data_planes"].items()}
            self.tls["admin"] = ClientTLS(tls["ca_file"], tls["admin"]["cert_file"], tls["admin"]["key_file"])
            self.tls["engine-dp2"] = ClientTLS(tls["ca_file"], tls["engines"]["dp2"]["cert_file"],
                                               tls["engines"]["dp2"]["key_file"])
        else:
            self.tls = {n: None for n in [*self.dps, "admin", "engine-dp2"]}
        self.workdir = workdir
        self.victim_ns, self.demo_ns = ns_of(VICTIM), ns_of("demo")
        self.victim_hashes, self.demo_hashes = hashes_of(1), hashes_of(2)
        self.identity = NodeIdentity()  # the attacker's peer key (a data plane of its own would make one too)

    def row(self, area: str, what: str, expected: str, got: str, ok: bool) -> None:
        self.rows.append(Row(area, what, expected, got, ok))
        print(f"{'ok  ' if ok else 'FAIL'} [{area}] {what}: expected {expected}; got {got}", flush=True)

    def expect(self, area: str, what: str, result: tuple[str, str, object], *codes: str) -> None:
        code, details = result[0], result[1]
        self.row(area, what, " or ".join(codes), f"{code} {details[:90]}".strip(), code in codes)

    # ---- channels ----

    def attacker_cp(self):
        return channel(self.cp, self.key["dp1"], self.tls["dp1"])

    def admin_cp(self):
        return channel(self.cp, self.admin_key, self.tls["admin"])

    # ---- the stage ----

    async def stage(self) -> None:
        async with self.admin_cp() as ch:
            admin = ta_grpc.TenantAdminStub(ch)
            tenants = await admin.ListTenants(ta_pb.ListTenantsRequest())
            if VICTIM not in {t.tenant_id for t in tenants.tenants}:
                await admin.CreateTenant(ta_pb.CreateTenantRequest(
                    tenant_id=VICTIM, policy=ta_pb.TenantPolicy(allowed_nodes=["dp2"])))
            issued = await admin.IssueKey(ta_pb.IssueKeyRequest(role=ta_pb.ROLE_SCHEDULER, tenant_id=VICTIM,
                                                                description="victim scheduler (probe)"))
            self.victim_key = issued.secret
        async with DataPlaneClient(self.dps["dp2"], key=self.key["dp2"], tls=self.tls["engine-dp2"]) as dp2:
            tier = SharedTier.open(await dp2.describe_tier())
            for ns, hashes, fill in ((self.victim_ns, self.victim_hashes, 0x5A), (self.demo_ns, self.demo_hashes, 7)):
                for slot in await dp2.reserve(ns, hashes):
                    if slot >= 0:
                        tier.slot(slot)[:] = np.uint8(fill)
                await dp2.commit(ns, hashes)
            tier.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the index learns of the blocks asynchronously
            if await self.victim_sees_dp2():
                break
            await asyncio.sleep(0.2)

    async def victim_sees_dp2(self) -> bool:
        async with channel(self.cp, self.victim_key, self.tls["admin"]) as ch:
            reply = await cp_grpc.ControlPlaneStub(ch).LookupPrefix(cp_pb.LookupPrefixRequest(
                namespace=self.victim_ns.to_proto(), block_hashes=self.victim_hashes), timeout=10)
        return [(h.node_id, h.leading_blocks) for h in reply.holders] == [("dp2", 3)]

    # ---- (a) the tenant admin API ----

    async def probe_admin_api(self) -> None:
        area = "admin API, dp1 key"
        async with self.attacker_cp() as ch:
            admin = ta_grpc.TenantAdminStub(ch)
            own_id = self.key["dp1"].split("_")[1]
            dp2_id = self.key["dp2"].split("_")[1]
            calls = {
                "ListTenants": admin.ListTenants(ta_pb.ListTenantsRequest()),
                "GetTenant victim": admin.GetTenant(ta_pb.GetTenantRequest(tenant_id=VICTIM)),
                "CreateTenant": admin.CreateTenant(ta_pb.CreateTenantRequest(tenant_id="evil")),
                "SetPolicy victim allowed_nodes+=dp1": admin.SetPolicy(ta_pb.SetPolicyRequest(
                    tenant_id=VICTIM, policy=ta_pb.TenantPolicy(allowed_nodes=["dp1", "dp2"]))),
                "IssueKey admin": admin.IssueKey(ta_pb.IssueKeyRequest(role=ta_pb.ROLE_ADMIN)),
                "IssueKey node dp2": admin.IssueKey(ta_pb.IssueKeyRequest(role=ta_pb.ROLE_NODE, node_id="dp2")),
                "IssueKey scheduler victim": admin.IssueKey(ta_pb.IssueKeyRequest(role=ta_pb.ROLE_SCHEDULER,
                                                                                  tenant_id=VICTIM)),
                "ListKeys": admin.ListKeys(ta_pb.ListKeysRequest()),
                "RotateKey own": admin.RotateKey(ta_pb.RotateKeyRequest(key_id=own_id)),
                "RevokeKey dp2's": admin.RevokeKey(ta_pb.RevokeKeyRequest(key_id=dp2_id)),
                "RotateRedisCredentials victim": admin.RotateRedisCredentials(
                    ta_pb.RotateRedisCredentialsRequest(tenant_id=VICTIM)),
                "ListAudit": admin.ListAudit(ta_pb.ListAuditRequest()),
                "DeleteTenant victim": admin.DeleteTenant(ta_pb.DeleteTenantRequest(tenant_id=VICTIM)),
            }
            for what, call in calls.items():
                self.expect(area, what, await outcome(call), "PERMISSION_DENIED")
        self.row(area, "victim still served after the attempts (positive control)", "dp2 holds 3",
                 "dp2 holds 3" if await self.victim_sees_dp2() else "changed", await self.victim_sees_dp2())

    # ---- (a) credentials ----

    async def probe_credentials(self) -> None:
        area = "credentials"
        key_id = self.key["dp1"].split("_")[1]
        forged = [("wrong secret, dp1's key id", f"kvm_{key_id}_{'A' * 43}"),
                  ("bootstrap-looking id", "kvm_bootstrap000_x"),
                  ("empty secret", f"kvm_{key_id}_"),
                  ("no prefix", self.key["dp1"][4:]),
                  ("64 KiB key (the client's own metadata limit refuses it)", "kvm_" + "a" * 65536)]
        for what, key in forged:
            async with channel(self.cp, key, self.tls["dp1"]) as ch:
                self.expect(area, f"control plane, {what}",
                            await outcome(cp_grpc.ControlPlaneStub(ch).Ping(common_pb2.PingRequest(), timeout=10)),
                            "UNAUTHENTICATED", "RESOURCE_EXHAUSTED")
        async with channel(self.cp, None, self.tls["dp1"]) as ch:
            self.expect(area, "control plane, no key",
                        await outcome(cp_grpc.ControlPlaneStub(ch).Ping(common_pb2.PingRequest(), timeout=10)),
                        "UNAUTHENTICATED")
        async with self.attacker_cp() as ch:
            self.expect(area, "control plane, dp1's own key (positive control)",
                        await outcome(cp_grpc.ControlPlaneStub(ch).Ping(common_pb2.PingRequest(), timeout=10)), OK)

    # ---- (a) the control plane ----

    async def probe_control_plane(self) -> None:
        area = "control plane, dp1 key"
        async with self.attacker_cp() as ch:
            cp = cp_grpc.ControlPlaneStub(ch)
            self.expect(area, "RegisterNode as dp2", await outcome(cp.RegisterNode(cp_pb.RegisterNodeRequest(
                node=cp_pb.NodeInfo(node_id="dp2", data_plane_address="127.0.0.1:1")), timeout=10)),
                "PERMISSION_DENIED")
            nodes = (await cp.ListNodes(cp_pb.ListNodesRequest(), timeout=10)).nodes
            dp2 = next(n for n in nodes if n.node.node_id == "dp2")
            self.expect(area, "Heartbeat dp2", await outcome(cp.Heartbeat(cp_pb.HeartbeatRequest(
                node_id="dp2", incarnation=dp2.incarnation), timeout=10)), "PERMISSION_DENIED")
            self.expect(area, "DeregisterNode dp2", await outcome(cp.DeregisterNode(cp_pb.DeregisterNodeRequest(
                node_id="dp2", incarnation=dp2.incarnation), timeout=10)), "PERMISSION_DENIED")
            stored = cp_pb.KvEvent(stored=cp_pb.BlockStored(block_hashes=hashes_of(9), block_size=BLOCK_TOKENS,
                                                            medium=common_pb2.MEDIUM_CPU))
            cleared = cp_pb.KvEvent(cleared=cp_pb.AllBlocksCleared())
            dp1 = next(n for n in nodes if n.node.node_id == "dp1")
            for what, batch in [
                ("PublishEvents as dp2 in victim (clear its blocks)", cp_pb.EventBatch(
                    node_id="dp2", incarnation=dp2.incarnation, seq=dp2.last_seq + 1,
                    namespace=self.victim_ns.to_proto(), reset=True, events=[cleared])),
                ("PublishEvents as dp1 into victim", cp_pb.EventBatch(
                    node_id="dp1", incarnation=dp1.incarnation, seq=10**9, namespace=self.victim_ns.to_proto(),
                    events=[stored])),
            ]:
                self.expect(area, what, await outcome(cp.PublishEvents(batch, timeout=10)), "PERMISSION_DENIED")
            self.row(area, "victim's holders unchanged after the event attempts", "dp2 holds 3",
                     "dp2 holds 3" if await self.victim_sees_dp2() else "changed", await self.victim_sees_dp2())
            # lookups of the victim's prefix answer like absent blocks (lookups a caller may not make)
            absent = hashes_of(77)
            for what, request in [("LookupPrefix", dict(block_hashes=self.victim_hashes)),
                                  ("LookupPrefix packed", dict(packed_block_hashes=b"".join(self.victim_hashes)))]:
                reply = await outcome(cp.LookupPrefix(cp_pb.LookupPrefixRequest(
                    namespace=self.victim_ns.to_proto(), **request), timeout=10))
                control = await outcome(cp.LookupPrefix(cp_pb.LookupPrefixRequest(
                    namespace=self.victim_ns.to_proto(), block_hashes=absent), timeout=10))
                same = reply[0] == OK and list(reply[2].holders) == [] and \
                    reply[2].blocks_queried == control[2].blocks_queried
                self.row(area, f"{what} of victim's prefix", "no holders, like absent blocks",
                         f"{reply[0]} holders={[h.node_id for h in reply[2].holders] if reply[2] else '-'}", same)
            stream = cp.LookupPrefixStream(iter([cp_pb.LookupPrefixRequest(namespace=self.victim_ns.to_proto(),
                                                                           block_hashes=self.victim_hashes)]))
            answers = [a async for a in stream]
            self.row(area, "LookupPrefixStream of victim's prefix", "no holders",
                     f"holders={[h.node_id for a in answers for h in a.holders]}",
                     len(answers) == 1 and not answers[0].holders)
            batch = cp.LookupPrefixBatches(iter([cp_pb.LookupPrefixBatch(lookups=[cp_pb.LookupPrefixRequest(
                namespace=self.victim_ns.to_proto(), block_hashes=self.victim_hashes)])]))
            answers = [a async for a in batch]
            self.row(area, "LookupPrefixBatches of victim's prefix", "no holders",
                     f"holders={[h.node_id for a in answers for b in a.answers for h in b.holders]}",
                     len(answers) == 1 and not answers[0].answers[0].holders)
            route = await outcome(cp.Route(cp_pb.RouteRequest(
                namespace=self.victim_ns.to_proto(), block_hashes=self.victim_hashes,
                candidates=[cp_pb.EngineCandidate(engine_id="dp1", node_id="dp1")]), timeout=10))
            leak = route[0] == OK and (route[2].HasField("kv_source") or route[2].HasField("prefetch")
                                       or route[2].local_cached_tokens)
            self.row(area, "Route in victim's namespace", "no source, no prefetch, nothing cached",
                     f"{route[0]} source={route[2].kv_source.node_id if route[2] else '-'}", route[0] == OK and not leak)
            self.expect(area, "IssuePullGrant victim from dp2", await outcome(cp.IssuePullGrant(
                cp_pb.IssuePullGrantRequest(namespace=self.victim_ns.to_proto(), source_node_id="dp2",
                                            consumer_public_key=self.identity.public_key), timeout=10)),
                "PERMISSION_DENIED")
            self.expect(area, "IssuePullGrant demo from dp2 (positive control)", await outcome(cp.IssuePullGrant(
                cp_pb.IssuePullGrantRequest(namespace=self.demo_ns.to_proto(), source_node_id="dp2",
                                            consumer_public_key=self.identity.public_key), timeout=10)), OK)
            victim = await outcome(cp.GetTenantLimits(cp_pb.GetTenantLimitsRequest(tenant=VICTIM), timeout=10))
            made_up = await outcome(cp.GetTenantLimits(cp_pb.GetTenantLimitsRequest(tenant="nobody"), timeout=10))
            self.row(area, "GetTenantLimits victim, as a made-up tenant", "NOT_FOUND in the same words",
                     f"{victim[0]} {victim[1][:90]}", victim[0] == made_up[0] == "NOT_FOUND"
                     and victim[1].replace(repr(VICTIM), "") == made_up[1].replace(repr("nobody"), ""))
            watch = cp.WatchBlockMap(cp_pb.WatchBlockMapRequest(namespace=self.victim_ns.to_proto()), timeout=10)
            got = await outcome(watch.read())
            self.expect(area, "WatchBlockMap victim", got, "PERMISSION_DENIED")
            watch.cancel()
            for what, report in [
                ("ReportStats for dp2's engine", cp_pb.ReportStatsRequest(
                    engines=[cp_pb.EngineSample(engine_id="dp2", prefill_tokens_per_s=1e-3)])),
                ("ReportStats for a link into dp2", cp_pb.ReportStatsRequest(
                    links=[cp_pb.LinkSample(source_node_id="dp1", dest_node_id="dp2", bytes_per_s=1e15)])),
            ]:
                self.expect(area, what, await outcome(cp.ReportStats(report, timeout=10)), "PERMISSION_DENIED")

    # ---- (a) the data planes ----

    async def peer(self, address: str, method: str, request, grant: bytes, proof: str | None = None):
        metadata = [] if not grant else [(GRANT_METADATA, grant.decode())]
        if grant and proof is None:
            proof = self.identity.proof(grant, PeerCall.of(method, request), "dp2")
        if proof:
            metadata.append((PROOF_METADATA, proof))
        async with channel(address, None, self.tls["dp1"]) as ch:
            return await outcome(getattr(dp_grpc.DataPlaneStub(ch), method)(request, metadata=metadata, timeout=15))

    async def probe_data_planes(self) -> None:
        area = "data plane dp2, dp1 key"
        dp2 = self.dps["dp2"]
        async with channel(dp2, self.key["dp1"], self.tls["dp1"]) as ch:
            stub = dp_grpc.DataPlaneStub(ch)
            local = {
                "Ping": stub.Ping(common_pb2.PingRequest(), timeout=10),
                "DescribeTier": stub.DescribeTier(dp_pb.DescribeTierRequest(), timeout=10),
                "Acquire victim": stub.Acquire(dp_pb.AcquireRequest(namespace=self.victim_ns.to_proto(),
                                                                    block_hashes=self.victim_hashes), timeout=10),
                "Reserve victim (overwrite)": stub.Reserve(dp_pb.ReserveRequest(
                    namespace=self.victim_ns.to_proto(), block_hashes=hashes_of(5)), timeout=10),
                "Commit victim": stub.Commit(dp_pb.CommitRequest(namespace=self.victim_ns.to_proto(),
                                                                 block_hashes=self.victim_hashes), timeout=10),
                "Abort victim": stub.Abort(dp_pb.AbortRequest(namespace=self.victim_ns.to_proto(),
                                                              block_hashes=self.victim_hashes), timeout=10),
                "Pull victim from dp1": stub.Pull(dp_pb.PullRequest(
                    namespace=self.victim_ns.to_proto(), block_hashes=self.victim_hashes, source_node_id="dp1",
                    source_address=self.dps["dp1"]), timeout=20),
            }
            for what, call in local.items():
                self.expect(area, f"local {what} with dp1's key", await outcome(call),
                            "UNAUTHENTICATED", "PERMISSION_DENIED")
        async with self.attacker_cp() as ch:
            cp = cp_grpc.ControlPlaneStub(ch)
            demo_grant = (await cp.IssuePullGrant(cp_pb.IssuePullGrantRequest(
                namespace=self.demo_ns.to_proto(), source_node_id="dp2",
                consumer_public_key=self.identity.public_key), timeout=10)).token
        lookup = lambda ns, hashes, **kw: dp_pb.LookupRequest(namespace=ns.to_proto(), block_hashes=hashes,  # noqa: E731
                                                              consumer_node_id="dp1", **kw)
        got = await self.peer(dp2, "Lookup", lookup(self.demo_ns, self.demo_hashes), demo_grant)
        hits = [s == dp_pb.BLOCK_STATUS_HIT for s in got[2].statuses] if got[2] else []
        self.row(area, "peer Lookup demo with dp1's demo grant (positive control)", "3 HIT",
                 f"{got[0]} {sum(hits)} HIT", got[0] == OK and all(hits) and len(hits) == 3)
        self.expect(area, "peer Lookup victim with the demo grant",
                    await self.peer(dp2, "Lookup", lookup(self.victim_ns, self.victim_hashes), demo_grant),
                    "PERMISSION_DENIED")
        self.expect(area, "peer Lookup victim with no grant",
                    await self.peer(dp2, "Lookup", lookup(self.victim_ns, self.victim_hashes), b""),
                    "PERMISSION_DENIED", "UNAUTHENTICATED")
        # a victim hash under demo's namespace (the grant's) is a MISS, never the victim's block
        got = await self.peer(dp2, "Lookup", lookup(self.demo_ns, self.victim_hashes), demo_grant)
        self.row(area, "victim's hashes asked under the demo grant's namespace", "MISS, no lease",
                 f"{got[0]} {[dp_pb.BlockStatus.Name(s) for s in got[2].statuses] if got[2] else ''}",
                 got[0] == OK and not got[2].lease_id and all(s == dp_pb.BLOCK_STATUS_MISS for s in got[2].statuses))
        request = lookup(self.demo_ns, self.demo_hashes)
        proof = self.identity.proof(demo_grant, PeerCall.of("Lookup", request), "dp2")
        first = await self.peer(dp2, "Lookup", request, demo_grant, proof)
        self.expect(area, "a proof used once (positive control)", first, OK)
        self.expect(area, "the same grant and proof replayed", await self.peer(dp2, "Lookup", request, demo_grant, proof),
                    "PERMISSION_DENIED")
        payload, signature = demo_grant.decode().split(".")
        import base64
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        claims["namespace_fingerprint"] = self.victim_ns.fingerprint
        claims["tenant"] = VICTIM
        forged = (base64.urlsafe_b64encode(json.dumps(claims, sort_keys=True, separators=(",", ":")).encode())
                  .decode().rstrip("=") + "." + signature).encode()
        self.expect(area, "the demo grant re-addressed to victim (signature kept)",
                    await self.peer(dp2, "Lookup", lookup(self.victim_ns, self.victim_hashes), forged),
                    "PERMISSION_DENIED")
        self.expect(area, "Release with a made-up lease id", await self.peer(
            dp2, "Release", dp_pb.ReleaseRequest(lease_id="0" * 32), demo_grant), OK)
        # Prefetch: the ticket is the authority
        for what, ticket in [("no ticket", ""), ("garbage ticket", "x.y"), ("a grant as ticket", demo_grant.decode())]:
            async with channel(dp2, self.key["dp1"], self.tls["dp1"]) as ch:  # any fleet key passes the interceptor
                got = await outcome(dp_grpc.DataPlaneStub(ch).Prefetch(dp_pb.PrefetchRequest(
                    namespace=self.victim_ns.to_proto(), block_hashes=self.victim_hashes, ticket=ticket), timeout=10))
            self.expect(area, f"Prefetch victim with {what}", got, "PERMISSION_DENIED")

    # ---- (a) resources ----

    async def probe_huge_requests(self) -> None:
        area = "huge requests"
        cp_pid = pid_listening_on(int(self.cp.rsplit(":", 1)[1]))
        tokens = np.arange(15_000_000, dtype=np.uint32) + 70_000  # ~60 MiB packed: under gRPC's 64 MiB, over ours
        request = cp_pb.LookupPrefixRequest(namespace=self.demo_ns.to_proto())
        request.token_ids.extend(tokens.tolist())
        start = time.monotonic()
        async with PeakRss(cp_pid) as rss, self.attacker_cp() as ch:
            cp = cp_grpc.ControlPlaneStub(ch)
            results = await asyncio.gather(*(outcome(cp.LookupPrefix(request, timeout=120)) for _ in range(4)))
            took = time.monotonic() - start
            ping = await outcome(cp.Ping(common_pb2.PingRequest(), timeout=10))
        grew_mib = rss.grew_mib
        codes = sorted({r[0] for r in results})
        self.row(area, "4 concurrent LookupPrefix of 15M token ids (60 MiB each), dp1 key",
                 "RESOURCE_EXHAUSTED (over max_request_bytes, refused as it arrives); control plane grows < 1 GiB "
                 "(before token ids were counted first: ~700 MB more each)",
                 f"{codes} in {took:.1f}s, RSS +{grew_mib:.0f} MiB, Ping {ping[0]}",
                 codes == ["RESOURCE_EXHAUSTED"] and grew_mib < 1024 and ping[0] == OK)

    async def probe_request_memory(self) -> None:
        """Many concurrent requests just under the control plane's message limit (13 MiB lookups of 3.9M token
        ids, refused for their content once read): before kvmesh.request_gate each was read, and decoded, as it
        came (measured: 256 of them grew the control plane by 8.5 GiB); now a call is read only with room in its
        key's share, so the control plane grows by about that share, however many calls come."""
        area = "request memory, dp1 key"
        cp_pid = pid_listening_on(int(self.cp.rsplit(":", 1)[1]))
        request = cp_pb.LookupPrefixRequest(namespace=self.demo_ns.to_proto())
        request.token_ids.extend((np.arange(3_900_000, dtype=np.uint32) + 70_000).tolist())
        payload = request.SerializeToString()
        del request
        start = time.monotonic()
        async with PeakRss(cp_pid) as rss:
            async with self.attacker_cp() as ch:
                call = ch.unary_unary("/kvmesh.v1.ControlPlane/LookupPrefix")  # bytes in: one payload, every call
                results = await asyncio.gather(*(outcome(call(payload, timeout=120)) for _ in range(128)))
            took = time.monotonic() - start
            async with channel(self.cp, self.victim_key, self.tls["admin"]) as ch:
                served = await outcome(cp_grpc.ControlPlaneStub(ch).LookupPrefix(cp_pb.LookupPrefixRequest(
                    namespace=self.victim_ns.to_proto(), block_hashes=self.victim_hashes), timeout=10))
        grew_mib = rss.grew_mib
        codes = sorted({r[0] for r in results})
        self.row(area, f"128 concurrent LookupPrefix of {len(payload) / 2**20:.0f} MiB (3.9M token ids)",
                 "INVALID_ARGUMENT or RESOURCE_EXHAUSTED; control plane grows < 1.5 GiB (before: ~4 GiB); "
                 "another tenant served",
                 f"{codes} in {took:.1f}s, RSS +{grew_mib:.0f} MiB, victim lookup {served[0]}",
                 set(codes) <= {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"} and "INVALID_ARGUMENT" in codes
                 and grew_mib < 1536 and served[0] == OK)

    async def probe_churn(self) -> None:
        """Many distinct names a key holder may use: namespaces, tenants, engines, clears, a watch never read."""
        area = "growth by made-up names, dp1 key"
        cp_pid = pid_listening_on(int(self.cp.rsplit(":", 1)[1]))
        redis_pid = pid_listening_on(redis_socket(self.info["redis"]))
        async with self.attacker_cp() as ch:
            cp = cp_grpc.ControlPlaneStub(ch)
            fds = open_fds(redis_pid)
            for i in range(300):
                ns = Namespace("demo", f"made-up-{i}", "r", self.demo_ns.cache_config).to_proto()
                await cp.LookupPrefix(cp_pb.LookupPrefixRequest(namespace=ns, block_hashes=[bytes(32)]), timeout=10)
            await asyncio.sleep(1.5)
            grew = open_fds(redis_pid) - fds
            self.row(area, "LookupPrefix of 300 made-up models of demo", "Redis connections bounded (< 100 more)",
                     f"+{grew} Redis descriptors", grew < 100)
            rss = rss_kib(cp_pid)
            for i in range(3000):
                ns = Namespace(f"made-up-tenant-{i}-" + "x" * 40, "m", "r", self.demo_ns.cache_config).to_proto()
                await cp.LookupPrefix(cp_pb.LookupPrefixRequest(namespace=ns, block_hashes=[bytes(32)]), timeout=10)
            self.row(area, "LookupPrefix naming 3,000 made-up tenants", "no holders; control plane RSS bounded",
                     f"RSS +{(rss_kib(cp_pid) - rss) / 1024:.1f} MiB", True)
            for round_ in range(3):
                await cp.ReportStats(cp_pb.ReportStatsRequest(engines=[
                    cp_pb.EngineSample(engine_id=f"dp1:made-up-{round_}-{i}", prefill_tokens_per_s=1.0)
                    for i in range(10_000)]), timeout=30)
            self.row(area, "ReportStats of 30,000 made-up engines 'dp1:<name>'", "accepted; table bounded (16,384)",
                     "accepted (table size: see tests/tenancy/test_request_bounds.py)", True)
            nodes = (await cp.ListNodes(cp_pb.ListNodesRequest(), timeout=10)).nodes
            dp1 = next(n for n in nodes if n.node.node_id == "dp1")
            clears = cp_pb.EventBatch(node_id="dp1", incarnation=dp1.incarnation, seq=dp1.last_seq + 1,
                                      namespace=self.demo_ns.to_proto(),
                                      events=[cp_pb.KvEvent(cleared=cp_pb.AllBlocksCleared(
                                          medium=common_pb2.MEDIUM_CPU))] * 65_536)
            start = time.monotonic()
            got = await outcome(cp.PublishEvents(clears, timeout=20))
            self.expect(area, f"PublishEvents as dp1 with 65,536 clears ({time.monotonic() - start:.1f} s)", got,
                        "INVALID_ARGUMENT")
            flood = cp_pb.EventBatch(node_id="dp1", incarnation=dp1.incarnation, seq=dp1.last_seq + 1,
                                     namespace=self.demo_ns.to_proto())
            flood.events.extend([cp_pb.KvEvent(cleared=cp_pb.AllBlocksCleared())] * 4_000_000)
            start = time.monotonic()
            got = await outcome(cp.PublishEvents(flood, timeout=60))
            took = time.monotonic() - start
            self.row(area, "PublishEvents as dp1 with 4M empty events (15 MiB)", "INVALID_ARGUMENT within 2 s",
                     f"{got[0]} in {took:.1f} s", got[0] == "INVALID_ARGUMENT" and took < 2)

    async def probe_faults(self) -> None:
        """(c): freeze Redis, then the control plane, kill dp2: a pull of demo's blocks into dp1 and a lookup end
        within their bounds (a MISS is a local recompute)."""
        import signal
        area = "faults"
        pids = {"redis": pid_listening_on(redis_socket(self.info["redis"])),
                "control plane": pid_listening_on(int(self.cp.rsplit(":", 1)[1])),
                "dp2": pid_listening_on(int(self.dps["dp2"].rsplit(":", 1)[1]))}

        async def stage(hashes: list[bytes]) -> None:  # fresh demo blocks on dp2, for dp1 to pull during the fault
            async with DataPlaneClient(self.dps["dp2"], key=self.key["dp2"], tls=self.tls["engine-dp2"]) as dp2:
                tier = SharedTier.open(await dp2.describe_tier())
                for slot in await dp2.reserve(self.demo_ns, hashes):
                    if slot >= 0:
                        tier.slot(slot)[:] = np.uint8(9)
                await dp2.commit(self.demo_ns, hashes)
                tier.close()

        async def pull(hashes: list[bytes]) -> tuple[str, float]:
            start = time.monotonic()
            async with DataPlaneClient(self.dps["dp1"], key=self.key["dp1"], tls=self.tls["dp1"]) as dp1:
                got = await outcome(dp1.pull(self.demo_ns, hashes, "dp2", self.dps["dp2"], timeout_ms=3000,
                                             timeout=20))
            return got[0] + (f" pulled={got[2].pulled}" if got[2] else ""), time.monotonic() - start

        async def lookup() -> tuple[str, float]:
            start = time.monotonic()
            async with self.attacker_cp() as ch:
                got = await outcome(cp_grpc.ControlPlaneStub(ch).LookupPrefix(cp_pb.LookupPrefixRequest(
                    namespace=self.demo_ns.to_proto(), block_hashes=self.demo_hashes), timeout=5))
            return got[0], time.monotonic() - start

        baseline = hashes_of(39)
        await stage(baseline)
        got, took = await pull(baseline)
        self.row(area, "no fault: dp1 Pull of 3 fresh demo blocks of dp2 (positive control)", "pulled=3",
                 f"{got} in {took:.1f} s", got.endswith("pulled=3"))
        for n, (what, sig) in enumerate([("redis", signal.SIGSTOP), ("control plane", signal.SIGSTOP),
                                         ("dp2", signal.SIGKILL)]):
            fresh = hashes_of(40 + n)
            await stage(fresh)
            os.kill(pids[what], sig)
            try:
                await asyncio.sleep(0.5)
                (p_got, p_s), (l_got, l_s) = await asyncio.gather(pull(fresh), lookup())
            finally:
                if sig == signal.SIGSTOP:
                    os.kill(pids[what], signal.SIGCONT)
            self.row(area, f"{what} {sig.name}: dp1 Pull of 3 fresh demo blocks of dp2 (timeout_ms 3000)",
                     "ends within 4 s (pulled, or a MISS: recomputed)", f"{p_got} in {p_s:.1f} s", p_s < 4)
            self.row(area, f"{what} {sig.name}: LookupPrefix (caller's deadline 5 s)",
                     "answer or UNAVAILABLE within 5.5 s", f"{l_got} in {l_s:.1f} s", l_s < 5.5)
            await asyncio.sleep(3)

    async def probe_metrics_slowloris(self, connections: int = 400) -> None:
        area = "metrics endpoint, no key"
        url = self.info["metrics"]["control_plane"]
        host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
        cp_pid = pid_listening_on(int(self.cp.rsplit(":", 1)[1]))
        threads_before, fds_before = threads(cp_pid), open_fds(cp_pid)
        socks = []
        for _ in range(connections):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
            socks.append(s)
        await asyncio.sleep(1.0)
        threads_held, fds_held = threads(cp_pid) - threads_before, open_fds(cp_pid) - fds_before
        await asyncio.sleep(12.0)
        still_open = 0
        for s in socks:
            s.setblocking(False)
            try:
                still_open += s.recv(1) != b""
            except BlockingIOError:
                still_open += 1
            except OSError:
                pass
            s.close()
        self.row(area, f"{connections} idle half-sent HTTP requests to the control plane's metrics port",
                 "threads and fds held bounded (<= 64), idle ones closed within 12 s",
                 f"+{threads_held} threads, +{fds_held} fds; {still_open} still open after 13 s",
                 threads_held <= 64 and fds_held <= 64 and still_open == 0)

    async def probe_half_open(self, connections: int = 1000) -> None:
        area = "gRPC port, no key"
        cp_pid = pid_listening_on(int(self.cp.rsplit(":", 1)[1]))
        host, port = self.cp.rsplit(":", 1)
        fds = open_fds(cp_pid)
        socks = [socket.create_connection((host, int(port)), timeout=5) for _ in range(connections)]
        await asyncio.sleep(1.0)
        held = open_fds(cp_pid) - fds
        async with self.attacker_cp() as ch:
            ping = await outcome(cp_grpc.ControlPlaneStub(ch).Ping(common_pb2.PingRequest(), timeout=10))
        await asyncio.sleep(11.0)
        held_later = open_fds(cp_pid) - fds
        for sock in socks:
            sock.close()
        self.row(area, f"{connections} TCP connections to the control plane's gRPC port that never handshake",
                 "served others meanwhile; dropped within the handshake timeout",
                 f"+{held} descriptors, Ping {ping[0]}; +{held_later} after 12 s", ping[0] == OK and held_later < 50)

    async def probe_idle_connections(self, connections: int = 5000) -> None:
        """Connections that handshake with dp1's certificate, then never call: the control plane holds at most
        max_connections (4,096) and closes the rest as they arrive, so they cannot take the descriptors it needs
        (20,000 of them did, before: dp2's new connections went unserved); dp2's open connection is served
        meanwhile, and a new one once they are gone (positive control)."""
        area = "idle connections, dp1 certificate"
        cp_pid = pid_listening_on(int(self.cp.rsplit(":", 1)[1]))
        host, port = self.cp.rsplit(":", 1)
        tls, ctx = self.tls["dp1"], None
        if tls is not None:  # a plaintext fleet (--insecure-plaintext): the same connections without TLS
            ctx = ssl.create_default_context(cafile=tls.ca_file)
            ctx.load_cert_chain(tls.cert_file, tls.key_file)
            ctx.set_alpn_protocols(["h2"])
            ctx.check_hostname = False
        fds, before = open_fds(cp_pid), rss_kib(cp_pid)
        socks, refused = [], 0
        async with channel(self.cp, self.key["dp2"], self.tls["dp2"]) as ch:
            dp2 = cp_grpc.ControlPlaneStub(ch)
            await dp2.Ping(common_pb2.PingRequest(), timeout=10)
            for _ in range(connections):
                try:
                    sock = socket.create_connection((host, int(port)), timeout=5)
                    if ctx is not None:
                        sock = ctx.wrap_socket(sock, server_hostname="localhost")
                    sock.sendall(HTTP2_PREFACE)
                    socks.append(sock)
                except OSError:  # closed as it arrived (past the cap)
                    refused += 1
            await asyncio.sleep(1.0)
            held, grew = open_fds(cp_pid) - fds, (rss_kib(cp_pid) - before) / 1024
            ping = await outcome(dp2.Ping(common_pb2.PingRequest(), timeout=10))
            lookup = await outcome(dp2.LookupPrefix(cp_pb.LookupPrefixRequest(
                namespace=self.demo_ns.to_proto(), token_ids=list(range(3 * BLOCK_TOKENS))), timeout=10))
        for sock in socks:
            sock.close()
        await asyncio.sleep(1.0)
        async with channel(self.cp, self.key["dp2"], self.tls["dp2"]) as ch:
            after = await outcome(cp_grpc.ControlPlaneStub(ch).Ping(common_pb2.PingRequest(), timeout=10))
        how = "TLS connections with dp1's certificate" if ctx is not None else "plaintext connections"
        self.row(area, f"{connections} {how} that never call",
                 "at most 4,096 held (descriptors), the rest closed as they arrive; RSS bounded",
                 f"+{held} descriptors, {refused} closed at the handshake; RSS +{grew:.0f} MiB",
                 held <= 4096 + 64 and grew < 512)
        self.row(area, "dp2's open connection meanwhile: Ping and LookupPrefix", "OK, OK", f"{ping[0]}, {lookup[0]}",
                 ping[0] == OK and lookup[0] == OK)
        self.row(area, "dp2's new connection once they are gone (positive control)", OK, after[0], after[0] == OK)

    async def probe_redis_reach(self) -> None:
        """Another user of the host (uid 65534) connects to the fleet's Redis: it held a TCP port on 127.0.0.1,
        where every connection takes one of Redis's 10,000 clients before any password is asked (10,100 of them:
        every lookup UNAVAILABLE, "max number of clients reached"); now a Unix socket only its owner may open.
        Positive control: the control plane still reaches it (dp2's lookup)."""
        area = "Redis, another user of the host"
        where = redis_socket(self.info["redis"])
        family, address = (("AF_UNIX", repr(where)) if isinstance(where, str)
                           else ("AF_INET", f"('127.0.0.1', {where})"))
        script = (f"import os, socket; os.setgid(65534); os.setuid(65534); s = socket.socket(socket.{family}); "
                  f"s.settimeout(5)\ntry:\n    s.connect({address}); print('connected')\n"
                  "except OSError as e:\n    print(type(e).__name__)")
        got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
        reached = (got.stdout.strip() or got.stderr.strip()[-200:])
        async with channel(self.cp, self.key["dp2"], self.tls["dp2"]) as ch:
            lookup = await outcome(cp_grpc.ControlPlaneStub(ch).LookupPrefix(cp_pb.LookupPrefixRequest(
                namespace=self.demo_ns.to_proto(), token_ids=list(range(3 * BLOCK_TOKENS))), timeout=10))
        self.row(area, f"uid 65534 connects to the fleet's Redis ({self.info['redis']})", "refused (PermissionError)",
                 reached, reached == "PermissionError")
        self.row(area, "dp2's lookup through the control plane (positive control)", OK, lookup[0], lookup[0] == OK)

    async def probe_many_streams(self, streams: int = 300) -> None:
        """One key's watches are bounded (max_watches_per_key, 16: each holds its namespace's snapshot while its
        reader does not read), within its calls in flight (max_calls_in_flight_per_key, 256): watches past the cap
        are refused at once, and other keys, and the key's own other calls, are served meanwhile."""
        area = "many streams, dp1 key"
        cp_pid = pid_listening_on(int(self.cp.rsplit(":", 1)[1]))
        before = rss_kib(cp_pid)
        watch = cp_pb.WatchBlockMapRequest(namespace=self.demo_ns.to_proto())
        async with self.attacker_cp() as ch, channel(self.cp, self.key["dp2"], self.tls["dp2"]) as other:
            cp = cp_grpc.ControlPlaneStub(ch)
            calls = [cp.WatchBlockMap(watch) for _ in range(streams)]
            firsts = await asyncio.gather(*(outcome(c.read()) for c in calls))
            start = time.monotonic()
            ping = await outcome(cp_grpc.ControlPlaneStub(other).Ping(common_pb2.PingRequest(), timeout=10))
            ping_ms = (time.monotonic() - start) * 1000
            own = await outcome(cp.Ping(common_pb2.PingRequest(), timeout=10))
            grew = (rss_kib(cp_pid) - before) / 1024
            for c in calls:
                c.cancel()
            again = ("", "", None)
            for _ in range(50):  # the server sees the cancellations a moment later
                call = cp.WatchBlockMap(watch)
                again = await outcome(call.read())
                call.cancel()
                if again[0] == OK:
                    break
                await asyncio.sleep(0.1)
        codes = {code: sum(1 for f in firsts if f[0] == code) for code in sorted({f[0] for f in firsts})}
        self.row(area, f"{streams} WatchBlockMap streams held open on one connection",
                 "at most 16 open, the rest RESOURCE_EXHAUSTED; dp2's key served (Ping < 1 s); RSS bounded",
                 f"{codes}; dp2 Ping {ping[0]} {ping_ms:.0f} ms; RSS +{grew:.0f} MiB",
                 codes.get(OK, 0) <= 16 and codes.get("RESOURCE_EXHAUSTED", 0) >= streams - 16
                 and ping[0] == OK and ping_ms < 1000)
        self.row(area, "dp1's own next call while its watches are open (positive control)", OK, own[0], own[0] == OK)
        self.row(area, "dp1 watches again once its watches ended (positive control)", OK, again[0], again[0] == OK)

    async def _redis(self):
        """The operator's Redis client (to check what the probes left there; the attacker has none)."""
        from kvmesh.redis_client import connect
        return connect(self.info["redis"], username=self.info["redis_user"],
                       password=Path(self.info["redis_password_file"]).read_text().strip())

    async def probe_figures_share(self, made_up: int = 17_000) -> None:
        """Made-up engine names and links into itself take one node's share of the routing figures (256 of each
        16,384-entry hash), not the other nodes': dp2's new engine and link are still recorded."""
        area = "routing figures, dp1 key"
        async with self.attacker_cp() as ch:
            cp = cp_grpc.ControlPlaneStub(ch)
            for start in range(0, made_up, 1000):
                await cp.ReportStats(cp_pb.ReportStatsRequest(
                    engines=[cp_pb.EngineSample(engine_id=f"dp1:made-up-{i}", prefill_tokens_per_s=1.0)
                             for i in range(start, start + 1000)],
                    links=[cp_pb.LinkSample(source_node_id=f"made-up-{i}", dest_node_id="dp1", bytes_per_s=1.0)
                           for i in range(start, start + 1000)]), timeout=30)
        async with channel(self.cp, self.key["dp2"], self.tls["dp2"]) as ch:
            await cp_grpc.ControlPlaneStub(ch).ReportStats(cp_pb.ReportStatsRequest(
                engines=[cp_pb.EngineSample(engine_id="dp2:probe-new-engine", prefill_tokens_per_s=4321.0)],
                links=[cp_pb.LinkSample(source_node_id="dp3", dest_node_id="dp2", bytes_per_s=1234.0)]), timeout=10)
        redis = await self._redis()
        try:
            engines = await redis.hgetall("kvm:{kvm-reg}:stats:prefill-tps")
            links = await redis.hgetall("kvm:{kvm-reg}:stats:link-bw")
        finally:
            await redis.aclose()
        dp1 = sum(1 for k in engines if k.startswith(b"dp1:made-up-")) + sum(
            1 for k in links if k.startswith(b"made-up-"))
        self.row(area, f"{made_up} made-up engines and {made_up} made-up links into dp1 reported",
                 "at most 256 of each kept", f"{dp1} kept", dp1 <= 512)
        held = (engines.get(b"dp2:probe-new-engine"), links.get(b"dp3>dp2"))
        self.row(area, "dp2's new engine and link recorded after that (positive control)", "both kept",
                 f"engine {held[0]!r}, link {held[1]!r}", None not in held)

    async def probe_prefetch_orders(self) -> None:
        """dp1's key stores a quarter of dp2's tier of demo blocks on dp1 and routes them to dp2's engine, to hand the
        prefetch order to dp2 itself. Orders went to any caller before: five such made dp2 pull five quarters of its
        tier at dp1's will (and, before the tiers' fair share, evicted the victim's 3 blocks on dp2). A node's key now
        gets orders for its own node only. Control: dp1's key routing blocks dp2 holds to dp1's engine gets dp1's
        order, and dp1 takes it."""
        area = "prefetch orders, dp1 key"
        async with self.attacker_cp() as ch:
            cp = cp_grpc.ControlPlaneStub(ch)

            async def route_to(node_id: str, hashes: list[bytes]):
                return await self.route(cp, hashes, cp_pb.EngineCandidate(engine_id=node_id, node_id=node_id))

            async def saved(node_id: str, tls: str, seed: int) -> list[bytes]:
                return await self.saved(cp, node_id, tls, seed)

            hashes = await saved("dp1", "dp1", 100)
            quarter = len(hashes)
            decision = await route_to("dp2", hashes)
            source = decision.kv_source.node_id if decision.HasField("kv_source") else "none"
            order = decision.prefetch.node_id if decision.HasField("prefetch") else "none"
            self.row(area, f"Route of {quarter} demo blocks on dp1 to dp2's engine", "source dp1, no prefetch order",
                     f"source {source}, order for {order}", source == "dp1" and order == "none")
            self.row(area, "victim's 3 blocks on dp2 after that", "dp2 holds 3",
                     "dp2 holds 3" if await self.victim_sees_dp2() else "evicted", await self.victim_sees_dp2())

            theirs = await saved("dp2", "engine-dp2", 200)  # the control's blocks: dp2's engine saved them
            decision = await route_to("dp1", theirs)
            order = decision.prefetch if decision.HasField("prefetch") else None
            got = f"no order ({cp_pb.SourceDecision.Name(decision.source_decision)})"
            if order is not None:  # handed over as a scheduler does: no API key, the ticket is the authority
                async with channel(self.dps["dp1"], None, self.tls["dp1"]) as to_dp1:
                    dp1 = dp_grpc.DataPlaneStub(to_dp1)
                    forged = await outcome(dp1.Prefetch(dp_pb.PrefetchRequest(
                        namespace=self.demo_ns.to_proto(), block_hashes=order.block_hashes,
                        ticket=order.ticket[:-4] + ("BBBB" if order.ticket.endswith("AAAA") else "AAAA")),
                        timeout=10))
                    self.row(area, "keyless Prefetch to dp1 with the order's ticket, signature altered",
                             "PERMISSION_DENIED", forged[0], forged[0] == "PERMISSION_DENIED")
                    looked = await outcome(dp1.Lookup(dp_pb.LookupRequest(
                        namespace=self.demo_ns.to_proto(), block_hashes=theirs[:1]), timeout=10))
                    self.row(area, "keyless Lookup on dp1 (only Prefetch is taken without a key)",
                             "UNAUTHENTICATED", looked[0], looked[0] == "UNAUTHENTICATED")
                    reply = await outcome(dp1.Prefetch(dp_pb.PrefetchRequest(
                        namespace=self.demo_ns.to_proto(), block_hashes=order.block_hashes, ticket=order.ticket),
                        timeout=10))
                got = reply[0] if reply[0] != OK else dp_pb.PrefetchStatus.Name(reply[2].status)
            landed = got == "PREFETCH_STATUS_STARTED" and await self.map_shows(cp, theirs, "dp1")
            self.row(area, f"Route of {quarter} demo blocks on dp2 to dp1's own engine, the order handed over with "
                     "no key (positive control)", "an order for dp1, started, the blocks on dp1",
                     f"{got}; on dp1: {landed}", landed)

    async def route(self, cp: cp_grpc.ControlPlaneStub, hashes: list[bytes], *candidates: cp_pb.EngineCandidate):
        return await cp.Route(cp_pb.RouteRequest(
            namespace=self.demo_ns.to_proto(), block_hashes=hashes, policy=cp_pb.ROUTE_POLICY_LOAD_AWARE,
            kv_bytes_per_token=1,  # a pull always pays (the cost model): an order whenever one may be given
            candidates=list(candidates)), timeout=10)

    async def saved(self, cp: cp_grpc.ControlPlaneStub, node_id: str, tls: str, seed: int) -> list[bytes]:
        """A quarter of the node's tier of demo blocks saved there with its key (its engine's part)."""
        async with DataPlaneClient(self.dps[node_id], key=self.key[node_id], tls=self.tls[tls]) as dp:
            tier = SharedTier.open(await dp.describe_tier())
            hashes = hashes_of(seed, tier.num_slots // 4)
            for slot in await dp.reserve(self.demo_ns, hashes):
                if slot >= 0:
                    tier.slot(slot)[:] = np.uint8(seed % 256)
            tier.close()
            await dp.commit(self.demo_ns, hashes)
        await self.map_shows(cp, hashes, node_id)
        return hashes

    async def probe_pull_ledger(self) -> None:
        """dp1's key routes demo blocks dp2 holds to a made-up engine whose backlog is 2^62 tokens: the pull ledger
        (every tenant's) booked dp2's NIC until its queue ended, ~10^14 s, and every pull from dp2 then looked
        that much slower (RECOMPUTE_CHEAPER). No link is booked more than 30 s ahead now, and only dp1's own pulls
        wait for its bookings in full: another booker's (dp2's key) waits at most its own transfer for them.
        Control: the route was a pull from dp2 (it booked the ledger), and dp1's next pull waits behind it."""
        area = "pull ledger, dp1 key"
        async with self.attacker_cp() as ch:
            cp = cp_grpc.ControlPlaneStub(ch)
            hashes = await self.saved(cp, "dp2", "engine-dp2", 500)
            made_up = await self.route(cp, hashes, cp_pb.EngineCandidate(engine_id="made-up", node_id="made-up",
                                                                         running_tokens=2**62))
            source = made_up.kv_source.node_id if made_up.HasField("kv_source") else "none"
            self.row(area, "Route of demo blocks on dp2 to a made-up engine with a 2^62-token backlog",
                     "a pull from dp2 (booked)", f"source {source}", source == "dp2")
            after = await self.route(cp, hashes, cp_pb.EngineCandidate(engine_id="dp1", node_id="dp1"))
            wait_ms = after.estimate.transfer_ms
            self.row(area, "dp1's next pull from dp2: estimated transfer (ledger wait included)",
                     "1,000 to 30,000 ms", f"{wait_ms:,.0f} ms", 1_000 <= wait_ms <= 30_000 + 1_000)
        async with channel(self.cp, self.key["dp2"], self.tls["dp2"]) as ch:
            other = await self.route(cp_grpc.ControlPlaneStub(ch), hashes,
                                     cp_pb.EngineCandidate(engine_id="dp1", node_id="dp1"))
            wait_ms = other.estimate.transfer_ms
            self.row(area, "another booker's (dp2's key) pull from dp2 into dp1: estimated transfer", "< 1,000 ms",
                     f"{wait_ms:,.0f} ms", wait_ms < 1_000)
        async with self.attacker_cp() as ch:
            cp = cp_grpc.ControlPlaneStub(ch)
            huge = await outcome(cp.Route(cp_pb.RouteRequest(
                namespace=self.demo_ns.to_proto(), block_hashes=hashes, kv_bytes_per_token=1 << 40,
                candidates=[cp_pb.EngineCandidate(engine_id="dp1", node_id="dp1")]), timeout=10))
            self.row(area, "Route with kv_bytes_per_token of 1 TiB", "INVALID_ARGUMENT", huge[0],
                     huge[0] == "INVALID_ARGUMENT")

    async def probe_peer_pins(self) -> None:
        """dp1's key, with a demo grant on dp2, pins dp2's demo blocks under leases of the longest life (60 s), twice.
        Eviction never takes a pinned block and nothing bounded one peer's pins: all of a tenant's blocks pinned,
        renewed before expiry, kept every other tenant out of dp2. One peer now pins at most an equal share of dp2's
        slots of one tenant's blocks, and the victim's engine evicts the rest. Control: the leading share is served."""
        area = "peer pins on dp2, dp1 key"
        dp2 = self.dps["dp2"]
        async with DataPlaneClient(dp2, key=self.key["dp2"], tls=self.tls["engine-dp2"]) as engine:
            tier = SharedTier.open(await engine.describe_tier())  # dp2's engine fills its tier with demo blocks
            slots = tier.num_slots
            wanted = hashes_of(300, slots)
            reserved = await engine.reserve(self.demo_ns, wanted)
            hashes = [h for h, slot in zip(wanted, reserved) if slot >= 0]  # the victim's 3 are kept (fair share)
            for slot in reserved:
                if slot >= 0:
                    tier.slot(slot)[:] = np.uint8(3)
            tier.close()
            await engine.commit(self.demo_ns, hashes)
        second = NodeIdentity()  # a made-up peer key: the control plane grants any key a node key names
        grants = []
        async with self.attacker_cp() as ch:
            for identity in (self.identity, second):
                grants.append((await cp_grpc.ControlPlaneStub(ch).IssuePullGrant(cp_pb.IssuePullGrantRequest(
                    namespace=self.demo_ns.to_proto(), source_node_id="dp2",
                    consumer_public_key=identity.public_key), timeout=10)).token)
        leases, pinned = [], 0
        # a second lease on the rest, under the second peer key: nothing past the node's share either way
        for part, identity, grant in zip((hashes, hashes[slots // 4:]), (self.identity, second), grants):
            request = dp_pb.LookupRequest(namespace=self.demo_ns.to_proto(), block_hashes=part,
                                          consumer_node_id="dp1", lease_ms=60_000)
            got = await self.peer(dp2, "Lookup", request, grant,
                                  identity.proof(grant, PeerCall.of("Lookup", request), "dp2"))
            if got[0] == OK:
                pinned += sum(1 for s in got[2].statuses if s == dp_pb.BLOCK_STATUS_HIT)
                leases.append((got[2].lease_id, identity, grant))
        self.row(area, f"peer Lookups of {len(hashes)} demo blocks on dp2 ({slots} slots), 60 s leases, two peer "
                 "keys", f"1 to {slots // 2} pinned (half the slots at most)", f"{pinned} pinned",
                 0 < pinned <= slots // 2)
        async with DataPlaneClient(dp2, key=self.key["dp2"], tls=self.tls["engine-dp2"]) as engine:
            fresh = hashes_of(400, slots // 8)
            reserved = await engine.reserve(self.victim_ns, fresh)
            await engine.abort(self.victim_ns, fresh)
        given = sum(1 for slot in reserved if slot >= 0)
        self.row(area, f"victim's engine reserves {len(fresh)} blocks on dp2 meanwhile (the tier full of demo's)",
                 f"{len(fresh)} slots", f"{given} slots", given == len(fresh))
        for lease_id, identity, grant in leases:
            if lease_id:
                request = dp_pb.ReleaseRequest(lease_id=lease_id)
                await self.peer(dp2, "Release", request, grant,
                                identity.proof(grant, PeerCall.of("Release", request), "dp2"))

    async def map_shows(self, cp: cp_grpc.ControlPlaneStub, hashes: list[bytes], node_id: str) -> bool:
        """Waits (10 s at most) until the block map names ``node_id`` holding all of ``hashes`` (demo's)."""
        for _ in range(100):
            reply = await cp.LookupPrefix(cp_pb.LookupPrefixRequest(
                namespace=self.demo_ns.to_proto(), block_hashes=hashes), timeout=10)
            if any(h.node_id == node_id and h.leading_blocks == len(hashes) for h in reply.holders):
                return True
            await asyncio.sleep(0.1)
        return False

    async def probe_namespace_share(self, tries: int = 300) -> None:
        """A node key opens at most max_namespaces_per_tenant (256) namespaces of a tenant it may hold; the
        victim's node still opens new ones. Runs last: its batches advance dp1's and dp2's event sequences."""
        area = "namespaces, dp1 key"
        async with self.attacker_cp() as ch:
            cp = cp_grpc.ControlPlaneStub(ch)
            dp1 = next(n for n in (await cp.ListNodes(cp_pb.ListNodesRequest(), timeout=10)).nodes
                       if n.node.node_id == "dp1")
            seq, opened, refused = dp1.last_seq + 1, 0, ("", "")
            stored = cp_pb.KvEvent(stored=cp_pb.BlockStored(block_hashes=hashes_of(5, 1), block_size=BLOCK_TOKENS,
                                                            medium=common_pb2.MEDIUM_CPU))
            for i in range(tries):
                ns = Namespace("demo", f"made-up-{i}", "rev1", CacheConfig(block_size=BLOCK_TOKENS)).to_proto()
                code, details, _ = await outcome(cp.PublishEvents(cp_pb.EventBatch(
                    node_id="dp1", incarnation=dp1.incarnation, seq=seq, namespace=ns, events=[stored]), timeout=10))
                if code != OK:
                    refused = (code, details)
                    break
                seq, opened = seq + 1, opened + 1
        self.row(area, f"PublishEvents into up to {tries} made-up namespaces of tenant demo",
                 "RESOURCE_EXHAUSTED by the 256th", f"{opened} opened; then {refused[0]} {refused[1][:70]}",
                 refused[0] == "RESOURCE_EXHAUSTED" and opened < 256)
        async with channel(self.cp, self.key["dp2"], self.tls["dp2"]) as ch:
            cp = cp_grpc.ControlPlaneStub(ch)
            dp2 = next(n for n in (await cp.ListNodes(cp_pb.ListNodesRequest(), timeout=10)).nodes
                       if n.node.node_id == "dp2")
            ns = Namespace(VICTIM, "tiny", "rev2", self.victim_ns.cache_config).to_proto()
            reply = await outcome(cp.PublishEvents(cp_pb.EventBatch(
                node_id="dp2", incarnation=dp2.incarnation, seq=dp2.last_seq + 1, namespace=ns,
                events=[cp_pb.KvEvent(stored=cp_pb.BlockStored(block_hashes=hashes_of(6, 1),
                                                               block_size=BLOCK_TOKENS,
                                                               medium=common_pb2.MEDIUM_CPU))]), timeout=10))
        self.expect(area, "dp2 opens a new namespace of the victim after that (positive control)", reply, OK)

    async def probe_malformed(self) -> None:
        area = "malformed input, no key"
        for name, address in [("control plane", self.cp), *self.dps.items()]:
            host, port = address.rsplit(":", 1)
            for what, payload in [("HTTP/1 request", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
                                  ("random bytes", os.urandom(4096)),
                                  ("a TLS ClientHello cut short", bytes.fromhex("160301020001"))]:
                try:
                    with socket.create_connection((host, int(port)), timeout=5) as s:
                        s.sendall(payload)
                        s.settimeout(2)
                        try:
                            s.recv(100)
                        except (socket.timeout, OSError):
                            pass
                except OSError:
                    pass
            async with channel(address, None, self.tls["dp1"]) as ch:
                reply = await outcome(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                                           timeout=10))
            self.expect(area, f"{name} still healthy after garbage on its port", reply, OK)

    async def run_only(self, names: list[str]) -> list[Row]:
        """The stage, then only the probes named (``probe_<name>``)."""
        await self.stage()
        for name in names:
            await getattr(self, f"probe_{name}")()
        return self.rows

    async def run(self, heavy: bool = True) -> list[Row]:
        await self.stage()
        self.row("stage", "victim scheduler sees dp2 holding victim's 3 blocks (positive control)", "True",
                 str(await self.victim_sees_dp2()), await self.victim_sees_dp2())
        await self.probe_credentials()
        await self.probe_admin_api()
        await self.probe_control_plane()
        await self.probe_data_planes()
        await self.probe_malformed()
        await self.probe_metrics_slowloris()
        await self.probe_many_streams()
        await self.probe_half_open()
        await self.probe_idle_connections()
        await self.probe_redis_reach()
        await self.probe_request_memory()
        await self.probe_churn()
        await self.probe_figures_share()
        await self.probe_prefetch_orders()
        await self.probe_pull_ledger()
        await self.probe_peer_pins()
        if heavy:
            await self.probe_huge_requests()
            await self.probe_faults()
        await self.probe_namespace_share()  # last: it advances dp1's and dp2's event sequences
        return self.rows


def start_up(workdir: Path) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh_apps.cli", "up", "--json", "--workdir", str(workdir),
                             "--block-bytes", "4096", "--capacity", "1MiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"kvmesh up did not start: {proc.stderr.read()}")
    return proc, json.loads(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--light", action="store_true", help="skip the huge-request and fault probes")
    parser.add_argument("--only", default="", help="comma-separated probe names (e.g. huge_requests,churn)")
    args = parser.parse_args()
    import tempfile
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvmesh-judge-"))
    proc, info = start_up(workdir)
    try:
        judge = Judge(info)
        rows = asyncio.run(judge.run_only(args.only.split(",")) if args.only else judge.run(heavy=not args.light))
    finally:
        proc.terminate()
        proc.wait(20)
    failed = [r for r in rows if not r.ok]
    print(f"\n{len(rows)} probes, {len(failed)} failed")
    for r in failed:
        print(f"FAIL [{r.area}] {r.what}: expected {r.expected}; got {r.got}")


if __name__ == "__main__":
    main()
