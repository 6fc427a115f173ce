"""`kvmesh up` is secure by default, tried as an outsider on the same machine: every gRPC server of the fleet refuses a
plaintext client, a client without a certificate and a client whose certificate another CA signed; the `kvmesh admin`
line it prints works as printed, a scheduler and an engine's data-plane client work with the generated certificates,
and the data planes pull from each other over mutual TLS. Its CA and keys are the workdir's owner's alone and appear in
no log and on no output."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from control_plane.scheduler_client import Candidate, Policy, SchedulerClient
from data_plane.client import DataPlaneClient, SharedTier
from engine_connector.config import KV_LAYOUT
from kvmesh.channels import ClientTLS, channel
from kvmesh.hashing import BlockHasher
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh.v1 import common_pb2, control_plane_pb2_grpc as cp_grpc, data_plane_pb2_grpc as dp_grpc

from tests.deploy.up_fleet import stop_all_ups
from tests.pki import certificate, write_pem

pytestmark = pytest.mark.slow

BLOCK_TOKENS = 32
BLOCK_BYTES = 4096


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A `kvmesh up` fleet of two data planes, and what it printed: {"lines", "control_plane", "data_planes",
    "engine": {node: extra config}, "admin": command line, "workdir"}."""
    workdir = tmp_path_factory.mktemp("up")
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh_apps.cli", "up", "--data-planes", "2", "--workdir",
                             str(workdir), "--block-bytes", str(BLOCK_BYTES), "--capacity", "1MiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("Ctrl-C stops everything"):
                break
        text = "\n".join(lines)
        assert "Ctrl-C stops everything" in text, text
        printed = {"lines": lines, "workdir": workdir, "data_planes": {}, "engine": {}}
        for line in lines:
            if line.startswith("control plane"):
                printed["control_plane"] = line.split()[-1]
            elif line.startswith("data plane"):
                node, address = line.split()[-2:]
                printed["data_planes"][node] = address
            elif line.strip().startswith("engine:"):
                config = json.loads(shlex.split(line.split("--kv-transfer-config", 1)[1])[0])
                extra = config["kv_connector_extra_config"]
                printed["engine"][next(n for n, a in printed["data_planes"].items()
                                       if a == extra["data_plane_address"])] = extra
            elif line.strip().startswith("admin:"):
                printed["admin"] = line.split("admin:", 1)[1].strip()
        yield printed
    finally:
        stop_all_ups([proc])


@pytest.fixture(scope="module")
def foreign(tmp_path_factory) -> tuple[str, str, str]:
    """Another CA, and a client certificate and key it signed: (ca file, cert file, key file)."""
    directory = tmp_path_factory.mktemp("foreign-pki")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvmesh local fleet CA forged")])
    ca_file = write_pem(directory, "ca", certificate("kvmesh local fleet CA forged", name, key, key, ca=True))[0]
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    return (ca_file, *write_pem(directory, "admin", certificate("admin", name, key, leaf_key), leaf_key))


def _servers(fleet) -> list[tuple[str, object, dict]]:
    """(address, stub class, engine settings whose node key and certificate it accepts) of every gRPC server of
    the fleet: a data plane's local API takes its own node's key."""
    engines = fleet["engine"]
    return [(fleet["control_plane"], cp_grpc.ControlPlaneStub, engines["dp1"]),
            *((address, dp_grpc.DataPlaneStub, engines[node]) for node, address in fleet["data_planes"].items())]


async def _ping(address: str, stub_class, tls: ClientTLS | None, key: str) -> None:
    """One authenticated RPC: the control plane's or a data plane's Ping."""
    async with channel(address, key, tls) as ch:
        await stub_class(ch).Ping(common_pb2.PingRequest(), timeout=10)


def _engine_tls(extra: dict, link: str = "data_plane") -> ClientTLS:
    """The printed engine settings' TLS for its data plane or the control plane (``link``), checking the name
    the settings give for that server."""
    return ClientTLS(extra["tls_ca_file"], extra["tls_cert_file"], extra["tls_key_file"], extra[f"{link}_tls_name"])


def _admin_tls(fleet) -> ClientTLS:
    """A scheduler's TLS as docs/scheduling.md writes it: the admin certificate, the control plane's name."""
    tls = fleet["workdir"] / "tls"
    return ClientTLS(str(tls / "ca.crt"), str(tls / "admin.crt"), str(tls / "admin.key"), "control-plane")


async def test_every_server_refuses_plaintext_and_certificates_of_another_ca(fleet, foreign):
    foreign_ca, foreign_cert, foreign_key = foreign
    assert len(_servers(fleet)) == 3
    for address, stub, extra in _servers(fleet):
        key = Path(extra["api_key_file"]).read_text().strip()
        ours = _engine_tls(extra, "control_plane" if stub is cp_grpc.ControlPlaneStub else "data_plane")
        for why, tls in [("plaintext", None),
                         ("no client certificate", ClientTLS(ours.ca_file)),
                         ("a client certificate of another CA", ClientTLS(ours.ca_file, foreign_cert, foreign_key)),
                         ("trusting another CA", ClientTLS(foreign_ca, ours.cert_file, ours.key_file))]:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _ping(address, stub, tls, key)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, (address, why, refused.value)
        await _ping(address, stub, ours, key)  # positive control: the fleet's own certificate, the same key


def test_the_printed_admin_line_works_as_printed(fleet):
    """Run through a shell exactly as printed (``kvmesh`` from this interpreter's environment)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    assert fleet["admin"].startswith("kvmesh admin ") and "--tls-cert-file" in fleet["admin"]
    out = subprocess.run(["bash", "-c", fleet["admin"]], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert [t["tenant_id"] for t in json.loads(out.stdout)["tenants"]] == ["demo"]
    # Negative control: the same line without its TLS flags is refused, in one line that says what to give.
    assert "--tls-server-name control-plane" in fleet["admin"]  # the control plane's name, checked
    plain = re.sub(r" --tls-(ca-file|cert-file|key-file|server-name) \S+", "", fleet["admin"])
    out = subprocess.run(["bash", "-c", plain], capture_output=True, text=True, env=env, timeout=60)
    said = [line for line in out.stderr.splitlines() if line.startswith("kvmesh admin:")]
    assert out.returncode == 1 and len(said) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "UNAVAILABLE" in said[0] and "TLS" in said[0], said


async def test_scheduler_and_engine_clients_work_with_the_generated_certificates(fleet):
    """The printed engine settings (node key, TLS files) reach the data planes; a scheduler with the admin's
    certificate reaches the control plane; dp2 pulls dp1's blocks (grant from the control plane, then dp1) over
    mutual TLS."""
    ns = Namespace("demo", "tiny", "rev1", CacheConfig(block_size=BLOCK_TOKENS, kv_dtype="float32",
                                                       kv_layout=KV_LAYOUT)).validate()
    hashes = BlockHasher().block_hashes(list(range(3 * BLOCK_TOKENS)), BLOCK_TOKENS)
    e1, e2 = fleet["engine"]["dp1"], fleet["engine"]["dp2"]
    key1, key2 = (Path(e["api_key_file"]).read_text().strip() for e in (e1, e2))
    async with DataPlaneClient(e1["data_plane_address"], key=key1, tls=_engine_tls(e1)) as dp1, \
            DataPlaneClient(e2["data_plane_address"], key=key2, tls=_engine_tls(e2)) as dp2:
        tier = SharedTier.open(await dp1.describe_tier())
        for i, slot in enumerate(await dp1.reserve(ns, hashes)):
            tier.slot(slot)[:] = np.uint8(i + 1)
        tier.close()
        assert await dp1.commit(ns, hashes) == 3
        result = await dp2.pull(ns, hashes, "dp1", e1["data_plane_address"], timeout_ms=10_000)
        assert (result.pulled, result.refused) == (3, ""), result
        tier = SharedTier.open(await dp2.describe_tier())
        slots, lease = await dp2.acquire(ns, hashes, lease_ms=5_000)
        assert [int(tier.slot(s)[0]) for s in slots] == [1, 2, 3]
        tier.close()
        await dp2.release(lease)
    workdir = fleet["workdir"]
    admin_key = (workdir / "secrets" / "admin.key").read_text().strip()
    async with SchedulerClient(fleet["control_plane"], ns, api_key=admin_key, tls=_admin_tls(fleet)) as scheduler:
        deadline = time.monotonic() + 10
        while True:  # tier changes reach the index asynchronously
            match = await scheduler.lookup_prefix(block_hashes=hashes)
            held = {h.node_id: h.leading_blocks for h in match.holders}
            if held == {"dp1": 3, "dp2": 3} or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
    assert held == {"dp1": 3, "dp2": 3}


async def test_a_scheduler_hands_its_prefetch_order_to_the_data_plane_it_names_over_tls(fleet):
    """A scheduler whose TLS names the control plane (as docs/scheduling.md writes it) hands Route's prefetch order
    to dp2 over mutual TLS, checking dp2's certificate names dp2 (not the control plane): STARTED, and the blocks
    arrive on dp2."""
    ns = Namespace("demo", "tiny", "rev2", CacheConfig(block_size=BLOCK_TOKENS, kv_dtype="float32",
                                                       kv_layout=KV_LAYOUT)).validate()
    hashes = BlockHasher().block_hashes(list(range(100, 100 + 24 * BLOCK_TOKENS)), BLOCK_TOKENS)  # > 512 tokens
    e1, e2 = fleet["engine"]["dp1"], fleet["engine"]["dp2"]
    key1, key2 = (Path(e["api_key_file"]).read_text().strip() for e in (e1, e2))
    admin_key = (fleet["workdir"] / "secrets" / "admin.key").read_text().strip()
    async with DataPlaneClient(e1["data_plane_address"], key=key1, tls=_engine_tls(e1)) as dp1, \
            DataPlaneClient(e2["data_plane_address"], key=key2, tls=_engine_tls(e2)) as dp2, \
            SchedulerClient(fleet["control_plane"], ns, api_key=admin_key, tls=_admin_tls(fleet)) as scheduler:
        await dp1.reserve(ns, hashes)
        assert await dp1.commit(ns, hashes) == len(hashes)
        deadline = time.monotonic() + 10
        while not (await scheduler.lookup_prefix(block_hashes=hashes)).holders and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        decision = await scheduler.route([Candidate("dp2:engine", "dp2")], block_hashes=hashes,
                                         policy=Policy.LOAD_AWARE)
        assert decision.prefetch is not None and decision.prefetch_status == "STARTED", decision
        deadline = time.monotonic() + 10
        while True:  # the prefetch runs in the background
            slots, lease = await dp2.acquire(ns, hashes)
            if lease:
                await dp2.release(lease)
            if len(slots) == len(hashes) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert len(slots) == len(hashes), f"{len(slots)} of {len(hashes)} prefetched blocks on dp2"


def test_tls_files_are_the_owners_alone_and_private_keys_appear_nowhere_else(fleet):
    directory = fleet["workdir"] / "tls"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    files = sorted(p.name for p in directory.iterdir())
    assert {"ca.crt", "ca.key", "control-plane.key", "dp1.key", "dp2.key", "engine-dp1.key", "admin.key"} <= set(files)
    for path in directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    keys = [p.read_text() for p in directory.glob("*.key")]
    assert all("PRIVATE KEY" in k for k in keys)
    printed = "\n".join(fleet["lines"])
    logs = [p.read_text(errors="replace") for p in fleet["workdir"].glob("*.log")]
    assert logs  # positive control: the services' logs are there to search
    for body in (k.split("-----")[2] for k in keys):
        assert body.strip() and body.strip().splitlines()[0] not in printed
        assert not any(body.strip().splitlines()[0] in log for log in logs)


class _Recorder(grpc.GenericRpcHandler):
    """Answers nothing (UNIMPLEMENTED) and keeps every call's ``authorization`` metadata: the keys it was sent."""

    def __init__(self) -> None:
        self.received: list[tuple[str, str]] = []

    def service(self, details):
        self.received += [(details.method, v) for k, v in details.invocation_metadata if k == "authorization"]
        return None


async def _impostor(fleet, cert_of: str) -> tuple[grpc.aio.Server, _Recorder, str]:
    """A server on a free loopback port with ``cert_of``'s certificate and key from the fleet's workdir (what a
    compromised node holds: its own), requiring a client certificate of the fleet's CA, as the real servers do."""
    tls = fleet["workdir"] / "tls"
    server, recorder = grpc.aio.server(), _Recorder()
    server.add_generic_rpc_handlers([recorder])
    pair = [((tls / f"{cert_of}.key").read_bytes(), (tls / f"{cert_of}.crt").read_bytes())]
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(pair, (tls / "ca.crt").read_bytes(),
                                                                              True))
    await server.start()
    return server, recorder, f"127.0.0.1:{port}"


async def _admin_cli(fleet, address: str) -> subprocess.CompletedProcess:
    """The printed admin line pointed at ``address``, without its ``--tls-server-name`` (what a user who drops it, or
    a script of their own, runs): asynchronously, so the impostor in this loop keeps answering."""
    argv = shlex.split(fleet["admin"])
    at = argv.index("--tls-server-name")
    del argv[at:at + 2]
    argv[argv.index("--control-plane") + 1] = address
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "kvmesh_apps.cli", *argv[1:],
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return subprocess.CompletedProcess(argv, proc.returncode, out.decode(), err.decode())


async def _clients_of(fleet, address: str, data_plane_name: str | None) -> list[str]:
    """What each client of the fleet got from ``address``: a scheduler and `kvmesh admin` that name no server (the
    documented defaults: ``ClientTLS`` without ``server_name``, the admin line without ``--tls-server-name``) and
    a data-plane client expecting ``data_plane_name`` (None: naming none): the outcome of each, in that order."""
    tls = fleet["workdir"] / "tls"
    admin_key = (fleet["workdir"] / "secrets" / "admin.key").read_text().strip()
    ns = Namespace("demo", "tiny", "rev3", CacheConfig(block_size=BLOCK_TOKENS, kv_dtype="float32",
                                                       kv_layout=KV_LAYOUT)).validate()
    outcomes = []
    nameless = ClientTLS(str(tls / "ca.crt"), str(tls / "admin.crt"), str(tls / "admin.key"))
    async with SchedulerClient(address, ns, api_key=admin_key, tls=nameless, timeout_s=5) as scheduler:
        try:
            await scheduler.lookup_prefix(token_ids=list(range(2 * BLOCK_TOKENS)))
        except grpc.aio.AioRpcError as error:
            outcomes.append(error.code().name)
    admin = await _admin_cli(fleet, address)
    outcomes.append("UNAVAILABLE" if "UNAVAILABLE" in admin.stderr else f"rc={admin.returncode} {admin.stderr[-300:]}")
    e1 = fleet["engine"]["dp1"]
    key1 = Path(e1["api_key_file"]).read_text().strip()
    async with DataPlaneClient(address, key=key1, tls=ClientTLS(e1["tls_ca_file"], e1["tls_cert_file"],
                                                                e1["tls_key_file"], data_plane_name)) as dp:
        try:
            await dp.describe_tier()
        except grpc.aio.AioRpcError as error:
            outcomes.append(error.code().name)
    return outcomes


async def test_a_nodes_certificate_answers_as_no_other_server_whatever_the_client_names(fleet):
    """dp1's certificate and key (a compromised node's) on a loopback port: a scheduler and `kvmesh admin` dialling
    it as the control plane without naming the server, and a data-plane client expecting dp2, fail the handshake
    and send no key (before: every certificate of the fleet named 127.0.0.1, and the fake control plane got the
    admin's and the scheduler's keys). Positive controls: the control plane's own certificate at such a port gets
    the scheduler's and the admin CLI's calls; a data-plane client expecting dp1 gets through to dp1's."""
    server, recorder, address = await _impostor(fleet, "dp1")
    try:
        assert await _clients_of(fleet, address, "dp2") == ["UNAVAILABLE"] * 3
        assert await _clients_of(fleet, address, None) == ["UNAVAILABLE"] * 3  # a node's names no address
        assert recorder.received == []
        # positive control, the same server: the client expecting dp1 completes the handshake and sends its key
        e1 = fleet["engine"]["dp1"]
        async with DataPlaneClient(address, key="probe-key", tls=_engine_tls(e1)) as dp:
            with pytest.raises(grpc.aio.AioRpcError) as answered:
                await dp.describe_tier()
        assert answered.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert recorder.received and {v for _, v in recorder.received} == {"Bearer probe-key"}
    finally:
        await server.stop(0)
    server, recorder, address = await _impostor(fleet, "control-plane")
    try:  # positive control: the control plane's certificate is what the nameless clients accept
        outcomes = await _clients_of(fleet, address, "dp2")
        assert outcomes[0] == "UNIMPLEMENTED" and outcomes[1].startswith("rc=1 ") and "UNIMPLEMENTED" in outcomes[1], \
            outcomes
        assert outcomes[2] == "UNAVAILABLE"  # expecting dp2: the control plane's certificate does not name it
        methods = {m.rsplit("/", 2)[1] for m, _ in recorder.received}
        assert methods == {"kvmesh.v1.ControlPlane", "kvmesh.v1.TenantAdmin"}, recorder.received
    finally:
        await server.stop(0)
