"""docker-compose.yml, running: the stack proven end to end through its containers.

``make compose-test`` (scripts/compose_test.sh) builds the images, brings the stack up with the small model, waits
for every health check and runs this module with ``KVMESH_COMPOSE_PROJECT`` naming the project; without it the
module is skipped. Everything goes through the containers: the admin CLI runs in the ``admin`` service, requests go
to the engines' published ports, the control plane is asked on its published port (over mutual TLS, with the admin
client certificate copied out of its volume), metrics are scraped and files read from inside containers on the
compose network; the TLS attacker is a container of the kvmesh image on that network with no volume of the stack.
Tests run in file order on one stack; the control-plane restart comes last. ``KVMESH_COMPOSE_SUMMARY`` names the
JSON file the measured figures go to.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import secrets
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import grpc
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.channels import ClientTLS, channel
from kvmesh.hashing import HashAlgo
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh.v1 import common_pb2, control_plane_pb2 as cp_pb, control_plane_pb2_grpc as cp_grpc

from engine_connector.config import KV_LAYOUT

from tests.pki import certificate, write_pem

PROJECT = os.environ.get("KVMESH_COMPOSE_PROJECT", "")
SUMMARY = os.environ.get("KVMESH_COMPOSE_SUMMARY", "")
ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not PROJECT, reason="needs a running stack: make compose-test")]

TENANT = os.environ.get("KVMESH_TENANT", "demo")
MODEL = "kvmesh-model"  # --served-model-name in docker-compose.yml
BLOCK = 32
BLOCK_BYTES = int(os.environ.get("KVMESH_BLOCK_BYTES", "65536"))
VOCAB = 2048  # the tiny model's (kvmesh_apps.tiny_model defaults)
PROMPT_TOKENS = 1000
MAX_TOKENS = 16
NODES = {"dp1": "engine1", "dp2": "engine2"}
TRACES = "/var/log/kvmesh/traces"
RUN = secrets.randbits(32)  # fresh prompts and tenant names: the module may run again on the same stack
OTHER_TENANT = f"acme-{RUN:08x}"
RESULTS: dict = {}


# ---- the stack ----

def compose(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(["docker-compose", "-p", PROJECT, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode:
        raise AssertionError(f"docker-compose {' '.join(args)}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc


def run_in(service: str, *cmd: str, user: str = "", check: bool = True) -> subprocess.CompletedProcess:
    """``cmd`` inside the running container of ``service``."""
    return compose("exec", "-T", *(["-u", user] if user else []), service, *cmd, check=check)


def admin(*args: str) -> dict:
    """The admin CLI in a one-off container of the ``admin`` service (bootstrap admin key from its volume)."""
    return json.loads(compose("run", "--rm", "-T", "admin", *args).stdout)


@functools.cache
def operator_tls() -> ClientTLS:
    """The admin's client certificate and the deployment's CA, copied out of the ``admin-tls`` volume (the operator's
    credentials for the published control-plane port; its certificate names ``control-plane``)."""
    directory = Path(tempfile.mkdtemp(prefix="kvmesh-compose-tls-"))
    for name in ("ca.crt", "tls.crt", "tls.key"):
        path = directory / name
        path.touch(mode=0o600)
        path.write_text(compose("run", "--rm", "-T", "--entrypoint", "cat", "admin", f"/run/kvmesh/tls/{name}").stdout)
    return ClientTLS(str(directory / "ca.crt"), str(directory / "tls.crt"), str(directory / "tls.key"),
                     "control-plane")


def published(service: str, port: int) -> str:
    return compose("port", service, str(port)).stdout.strip()


def containers() -> list[dict]:
    ids = compose("ps", "-q").stdout.split()
    return json.loads(subprocess.run(["docker", "inspect", *ids], capture_output=True, text=True, check=True).stdout)


def container(service: str) -> dict:
    (found,) = [c for c in containers() if c["Config"]["Labels"]["com.docker.compose.service"] == service]
    return found


def ip_of(service: str) -> str:
    (net,) = container(service)["NetworkSettings"]["Networks"].values()
    return net["IPAddress"]


def wait_healthy(service: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while (health := container(service)["State"].get("Health", {}).get("Status")) != "healthy":
        assert time.monotonic() < deadline, f"{service} is {health} after {timeout:.0f} s"
        time.sleep(2)


def scrape(url: str) -> dict[str, float]:
    """Prometheus samples at ``url``, fetched from inside the compose network (the control plane's container)."""
    text = run_in("control-plane", "python", "-c",
                  "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10)"
                  ".read().decode())", url).stdout
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


# ---- the engines and the control plane ----

def complete(engine: str, prompt: list[int], **extra) -> dict:
    """A greedy completion on ``engine``'s published port: generated token ids and the connector's report."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    request = urllib.request.Request(f"http://{published(engine, 8000)}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        out = json.load(response)
    return {"token_ids": out["choices"][0]["token_ids"], "kvmesh": (out.get("kv_transfer_params") or {})["kvmesh"]}


NAMESPACE = Namespace(TENANT, MODEL, "", CacheConfig(
    block_size=BLOCK, kv_dtype="float32", kv_layout=KV_LAYOUT, parallel_layout="tp1-pp1",
    hash_algo=HashAlgo.SHA256_CBOR, hash_seed="0")).validate()  # what the engines' connectors derive


def holders(key: str, prompt: list[int], namespace: Namespace = NAMESPACE, tls: ClientTLS | None = None
            ) -> dict[str, int]:
    """LookupPrefix on the control plane's published port: node -> leading blocks of ``prompt`` it holds (over
    ``tls``, by default the operator's mutual TLS)."""
    async def lookup() -> dict[str, int]:
        async with channel(published("control-plane", 50051), key, tls or operator_tls()) as ch:
            reply = await cp_grpc.ControlPlaneStub(ch).LookupPrefix(cp_pb.LookupPrefixRequest(
                namespace=namespace.to_proto(), token_ids=prompt, media=[common_pb2.MEDIUM_CPU]), timeout=10)
        return {h.node_id: h.leading_blocks for h in reply.holders}
    return asyncio.run(lookup())


def wait_held(key: str, prompt: list[int], want: dict[str, int], timeout: float = 30) -> dict[str, int]:
    """Until the block map shows at least ``want`` (events reach it asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        held = holders(key, prompt)
        if all(held.get(node, 0) >= n for node, n in want.items()) or time.monotonic() > deadline:
            return held
        time.sleep(0.5)


def draw(seed: int) -> list[int]:
    return np.random.default_rng([RUN, seed]).integers(2, VOCAB, PROMPT_TOKENS).tolist()


USABLE_BLOCKS = (PROMPT_TOKENS - 1) // BLOCK  # vLLM computes at least the last token


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield RESULTS
    if SUMMARY:
        Path(SUMMARY).write_text(json.dumps(RESULTS))


@pytest.fixture(scope="module")
def keys() -> dict[str, str]:
    """Through the admin CLI: a new tenant, and a scheduler key each for it and for the engines' tenant."""
    admin("tenants", "create", OTHER_TENANT, "--name", "compose-test tenant")
    return {tenant: admin("keys", "issue", "--role", "scheduler", "--tenant", tenant,
                          "--description", "compose-test router")["secret"] for tenant in (TENANT, OTHER_TENANT)}


@pytest.fixture(scope="module")
def scenario(keys) -> dict:
    """engine1 computes a prompt; engine2 then serves it (pulling from dp1), and recomputes it under a cache salt."""
    prompt = draw(1)
    pulled_before = scrape("http://dp2:9464/metrics").get('kvmesh_dp_bytes_total{direction=pulled}', 0.0)
    computed = complete("engine1", prompt)
    held = wait_held(keys[TENANT], prompt, {"dp1": USABLE_BLOCKS})
    pulled = complete("engine2", prompt)
    # A salt changes every block hash: nothing cached anywhere matches, engine2 computes the whole prompt.
    recomputed = complete("engine2", prompt, cache_salt="compose-test-recompute")
    other = complete("engine2", draw(2)[:BLOCK] + prompt[BLOCK:])  # negative control: another first block
    pulled_after = scrape("http://dp2:9464/metrics").get('kvmesh_dp_bytes_total{direction=pulled}', 0.0)
    report = pulled["kvmesh"]
    RESULTS.update(pull_bytes=report["bytes_pulled"], pulled_tokens=report["peer_tokens"],
                   pull_ms=round(report["pull_ms"], 1), transfer_ms=round(report["transfer_ms"], 1),
                   outputs_match=pulled["token_ids"] == computed["token_ids"] == recomputed["token_ids"])
    return {"prompt": prompt, "computed": computed, "held": held, "pulled": pulled, "recomputed": recomputed,
            "other": other, "dp2_pulled_bytes": pulled_after - pulled_before}


# ---- the checks ----

def test_the_admin_cli_manages_tenants_and_keys_through_a_container(keys):
    tenants = {t["tenant_id"] for t in admin("tenants", "list")["tenants"]}
    assert {TENANT, OTHER_TENANT} <= tenants
    node_keys = {k.get("node_id") for k in admin("keys", "list")["keys"] if k.get("role") == "ROLE_NODE"}
    assert {"dp1", "dp2"} <= node_keys  # issued by keys-init
    assert all(key.startswith("kvm_") for key in keys.values())


def test_a_tenant_key_sees_only_its_own_blocks(keys, scenario):
    # Positive control: the engines' tenant's scheduler key sees engine1's blocks on dp1.
    assert scenario["held"].get("dp1", 0) >= USABLE_BLOCKS
    # The attacker: acme's key asks for the same namespace, and learns nothing (answered like absent blocks).
    assert holders(keys[OTHER_TENANT], scenario["prompt"]) == {}


def test_engine2_loads_the_prefix_engine1_computed_pulled_from_dp1(scenario):
    computed, pulled = scenario["computed"]["kvmesh"], scenario["pulled"]["kvmesh"]
    assert computed["loaded_tokens"] == 0 and computed["stored_blocks"] >= USABLE_BLOCKS  # engine1 computed it
    assert pulled["source"] == "dp1" and pulled["outcome"] in ("pulled", "hit"), pulled
    assert pulled["peer_tokens"] == USABLE_BLOCKS * BLOCK
    assert pulled["bytes_pulled"] == USABLE_BLOCKS * BLOCK_BYTES
    assert scenario["dp2_pulled_bytes"] == pulled["bytes_pulled"]  # dp2's own metrics agree
    assert scenario["recomputed"]["kvmesh"]["loaded_tokens"] == 0  # the recompute loaded nothing


def test_outputs_are_identical_to_recompute(scenario):
    reference = scenario["computed"]["token_ids"]
    assert len(reference) == MAX_TOKENS
    assert scenario["pulled"]["token_ids"] == reference
    assert scenario["recomputed"]["token_ids"] == reference
    # Negative control: the outputs depend on the prefix, so a wrong prefix would have shown.
    assert scenario["other"]["token_ids"] != reference


def _tcp_peers(service: str) -> set[tuple[str, int, str, int]]:
    """Established TCP connections in ``service``'s network namespace: (local ip, port, remote ip, port)."""
    def addr(text: str) -> tuple[str, int]:
        ip, port = text.split(":")
        return socket.inet_ntoa(struct.pack("<I", int(ip, 16))), int(port, 16)
    found = set()
    for line in run_in(service, "cat", "/proc/net/tcp").stdout.splitlines()[1:]:
        fields = line.split()
        if fields[3] == "01":  # ESTABLISHED
            found.add((*addr(fields[1]), *addr(fields[2])))
    return found


def test_the_pull_crossed_the_network_not_shared_memory(scenario):
    tier = "/dev/shm/kvmesh-dp-dp1.tier"
    # Positive control: dp1's tier is in its IPC namespace, which engine1 shares.
    for service in ("dp1", "engine1"):
        assert run_in(service, "test", "-e", tier, check=False).returncode == 0, service
    # dp2 (and engine2) cannot map it: a pull can only have come over the network.
    for service in ("dp2", "engine2"):
        assert run_in(service, "test", "-e", tier, check=False).returncode != 0, service
    for service in ("dp1", "dp2"):
        assert container(service)["HostConfig"]["IpcMode"] == "shareable"
        assert "UCX_TLS=tcp" in container(service)["Config"]["Env"]
    dp1, dp2 = ip_of("dp1"), ip_of("dp2")
    service_ports = {50051, 50061, 9464}
    ucx = [c for c in _tcp_peers("dp2") if {c[0], c[2]} == {dp1, dp2} and not {c[1], c[3]} & service_ports]
    assert ucx, "no UCX TCP connection between dp2 and dp1"
    RESULTS["ucx_tcp_connections"] = len(ucx)


def test_metrics_of_every_service_are_scrapeable(scenario):
    expected = {
        "http://control-plane:9464/metrics": "kvmesh_cp_lookup_seconds_count",
        "http://dp1:9464/metrics": 'kvmesh_dp_bytes_total{direction=served}',
        "http://dp2:9464/metrics": 'kvmesh_dp_bytes_total{direction=pulled}',
        "http://engine1:8000/metrics": "vllm:prompt_tokens_total",
        "http://engine2:8000/metrics": "vllm:prompt_tokens_total",
    }
    for url, name in expected.items():
        samples = scrape(url)
        matching = [v for k, v in samples.items() if k.startswith(name)]
        assert matching and max(matching) > 0, f"{url}: no {name} > 0"
    RESULTS["metrics_scraped"] = len(expected)


def test_one_trace_follows_the_pull_across_containers(scenario):
    text = run_in("control-plane", "sh", "-c", f"cat {TRACES}/*.jsonl").stdout
    spans = [json.loads(line) for line in text.splitlines()]
    by_trace: dict[str, list[dict]] = defaultdict(list)
    for span in spans:
        by_trace[span["trace_id"]].append(span)
    pull_traces = [t for t, ss in by_trace.items()
                   if any(s["service"] == "kvmesh-engine2" and s["attributes"].get("kvmesh.source_node") == "dp1"
                          for s in ss)]
    assert pull_traces, "no engine2 span names dp1 as its source"
    services = {s["service"] for s in by_trace[pull_traces[0]]}
    assert {"kvmesh-engine2", "kvmesh-dp2", "kvmesh-dp1", "kvmesh-control-plane"} <= services, services
    ids = {s["span_id"] for s in by_trace[pull_traces[0]]}
    assert all(s["parent_id"] in ids for s in by_trace[pull_traces[0]] if s["parent_id"])  # one connected tree
    RESULTS["trace_services"] = sorted(services)


# A plaintext client, a client certificate from another CA, none, a client that trusts another CA (so it would
# accept an impostor server), and the positive control: the deployment's CA and a certificate it issued.
PROBE = r"""
import json, sys
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

def read(path):
    return open(path, "rb").read()

good, foreign = "/probe/good/", "/probe/foreign/"
ways = {
    "plaintext": None,
    "foreign_client_cert": (good + "ca.crt", foreign + "tls.key", foreign + "tls.crt"),
    "no_client_cert": (good + "ca.crt", None, None),
    "foreign_server_ca": (foreign + "ca.crt", good + "tls.key", good + "tls.crt"),
    "deployment_cert": (good + "ca.crt", good + "tls.key", good + "tls.crt"),
}
out = {}
for target in sys.argv[1:]:
    out[target] = {}
    for way, files in ways.items():
        if files is None:
            ch = grpc.insecure_channel(target)
        else:
            ch = grpc.secure_channel(target, grpc.ssl_channel_credentials(*(read(f) if f else None for f in files)))
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            out[target][way] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as exc:
            out[target][way] = exc.code().name
        finally:
            ch.close()
print(json.dumps(out))
"""


def test_plaintext_and_foreign_certificates_are_refused_on_every_grpc_port(keys, scenario, tmp_path):
    """The attacker: a container on the compose network (the kvmesh image, none of the stack's volumes) dials the
    control plane and both data planes in plaintext, with a certificate from its own CA, with none, and trusting
    its own CA; every way is refused. Positive control: the same container and code with the deployment's CA and
    a certificate it issued (the admin's) is answered SERVING by all three. From the host, a plaintext client
    holding a valid scheduler key is refused on the published port too, where the operator's TLS is answered."""
    probe = tmp_path / "probe"
    (probe / "good").mkdir(parents=True)
    (probe / "foreign").mkdir()
    tls = operator_tls()
    for name, source in (("ca.crt", tls.ca_file), ("tls.crt", tls.cert_file), ("tls.key", tls.key_file)):
        (probe / "good" / name).write_bytes(Path(source).read_bytes())
    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "attacker CA")])
    write_pem(probe / "foreign", "ca", certificate("attacker CA", ca_name, ca_key, ca_key, ca=True))
    write_pem(probe / "foreign", "tls", certificate("dp1", ca_name, ca_key, leaf_key), leaf_key)
    (probe / "probe.py").write_text(PROBE)
    (network,) = container("dp1")["NetworkSettings"]["Networks"]  # the services' network (the control plane's two)
    targets = ["control-plane:50051", "dp1:50061", "dp2:50061"]
    run = subprocess.run(["docker", "run", "--rm", "--network", network, "-u", "0", "-v", f"{probe}:/probe:ro",
                          "--entrypoint", "python", "kvmesh:dev", "/probe/probe.py", *targets],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    outcomes = json.loads(run.stdout)
    for target in targets:
        assert outcomes[target]["deployment_cert"] == "SERVING", outcomes  # positive control
        refused = {way: code for way, code in outcomes[target].items() if way != "deployment_cert"}
        # Refused in the handshake (a TLS 1.3 client may learn of a refused certificate only on its first read).
        assert set(refused.values()) <= {"UNAVAILABLE", "UNKNOWN"}, outcomes
    # From the host: the published control-plane port, a valid key, no TLS.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(_plaintext_lookup(keys[TENANT], scenario["prompt"]))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert holders(keys[TENANT], scenario["prompt"]).get("dp1", 0) >= USABLE_BLOCKS  # positive control
    RESULTS["tls_probe"] = outcomes


async def _plaintext_lookup(key: str, prompt: list[int]) -> None:
    async with channel(published("control-plane", 50051), key) as ch:
        await cp_grpc.ControlPlaneStub(ch).LookupPrefix(cp_pb.LookupPrefixRequest(
            namespace=NAMESPACE.to_proto(), token_ids=prompt, media=[common_pb2.MEDIUM_CPU]), timeout=10)


REDIS_REACH = ("import socket\ntry:\n    socket.create_connection(('redis', 6379), timeout=5).close()\n"
               "    print('connected')\nexcept OSError as exc:\n    print(type(exc).__name__)")


def test_redis_is_reached_by_the_control_plane_only(scenario):
    """Each connection to Redis takes one of its 10,000 clients before any password is asked, so whoever reaches it
    can take them all. Redis is on the internal ``store`` network, which only the control plane joins: a data plane
    and a container on the services' network (the kvmesh image, as the TLS attacker above) cannot reach it.
    Positive control: the same code in the control plane's container connects."""
    (network,) = container("dp1")["NetworkSettings"]["Networks"]
    outsider = subprocess.run(["docker", "run", "--rm", "--network", network, "--entrypoint", "python", "kvmesh:dev",
                               "-c", REDIS_REACH], capture_output=True, text=True, timeout=300)
    reach = {"outsider": outsider.stdout.strip() or outsider.stderr[-300:],
             "dp1": run_in("dp1", "python", "-c", REDIS_REACH).stdout.strip(),
             "control-plane": run_in("control-plane", "python", "-c", REDIS_REACH).stdout.strip()}
    RESULTS["redis_reach"] = reach
    assert reach["control-plane"] == "connected", reach  # positive control
    assert reach["outsider"] != "connected" and reach["dp1"] != "connected", reach


SECRETS = ("node.key", "admin.key", "redis-password", "redis-acl-password", "tenant-secret", "grant-key.pem",
           "users.acl", "healthcheck-password", "tls.key", "ca.key")


def _secret_files(service: str) -> dict[str, str]:
    """Every secret file visible in ``service``'s container, even to root there: path -> sha256."""
    names = " -o ".join(f"-name {name}" for name in SECRETS)
    out = run_in(service, "sh", "-c", f"find / \\( -path /proc -o -path /sys \\) -prune -o \\( {names} \\) -type f "
                 "-exec sha256sum {} +", user="root").stdout
    return {path: digest for digest, path in (line.split() for line in out.splitlines())}


def test_each_node_secret_is_mounted_only_into_that_node(scenario):
    node_key, tls_key = "/run/kvmesh/node/node.key", "/run/kvmesh/tls/tls.key"
    seen = {service: _secret_files(service) for service in ("dp1", "engine1", "dp2", "engine2", "control-plane")}
    for node, engine in NODES.items():
        # Positive control: the node's data plane and engine both hold the node's key, the same one, and each its
        # own TLS key.
        assert sorted(seen[node]) == sorted(seen[engine]) == [node_key, tls_key], (seen[node], seen[engine])
        assert seen[engine][node_key] == seen[node][node_key]
    # The attacker in dp1 (root in its container) finds no other node's key, nor any control-plane secret.
    assert seen["dp1"][node_key] != seen["dp2"][node_key]
    assert run_in("dp1", "cat", "/run/kvmesh/nodes/dp2/node.key", user="root", check=False).returncode != 0
    # No two containers share a TLS key (not even a node's data plane and engine); the CA's key is in none.
    tls_keys = [files[tls_key] for files in seen.values()]
    assert len(tls_keys) == len(set(tls_keys)) == 5
    assert not [path for files in seen.values() for path in files if path.endswith("ca.key")]
    assert sorted(p for p in seen["control-plane"] if not p.startswith("/run/kvmesh/control-plane/")) == [
        "/run/kvmesh/admin/admin.key", tls_key]
    # Docker's own view: each node volume is mounted into that node's containers (and the init steps) only; each
    # TLS volume into its one service (and secrets-init); the CA's volume into secrets-init alone.
    mounts = defaultdict(set)
    for c in containers():
        for m in c["Mounts"]:
            mounts[m.get("Name", "")].add(c["Config"]["Labels"]["com.docker.compose.service"])
    for node, engine in NODES.items():
        assert mounts[f"{PROJECT}_{node}-secrets"] <= {node, engine, "secrets-init", "keys-init"}
    assert mounts[f"{PROJECT}_cp-secrets"] <= {"control-plane", "secrets-init"}
    for service, volume in {"dp1": "dp1", "dp2": "dp2", "engine1": "engine1", "engine2": "engine2",
                            "control-plane": "cp"}.items():
        users = mounts[f"{PROJECT}_{volume}-tls"]
        assert service in users and users <= {service, "secrets-init"}, (volume, users)
    assert mounts[f"{PROJECT}_admin-tls"] <= {"secrets-init", "keys-init", "admin"}
    assert mounts[f"{PROJECT}_ca-secrets"] <= {"secrets-init"}
    RESULTS["secrets_isolated"] = True


def test_the_control_plane_survives_a_restart_with_its_map(keys, scenario):
    before = wait_held(keys[TENANT], scenario["prompt"], {"dp1": USABLE_BLOCKS, "dp2": USABLE_BLOCKS})
    started = time.monotonic()
    compose("restart", "control-plane")
    wait_healthy("control-plane")
    RESULTS["control_plane_restart_s"] = round(time.monotonic() - started, 1)
    # The map (and the scheduler key) survived: the data planes re-register on their own; give them a moment.
    deadline = time.monotonic() + 30
    while (after := holders(keys[TENANT], scenario["prompt"])) != before and time.monotonic() < deadline:
        time.sleep(1)
    assert after == before
    assert OTHER_TENANT in {t["tenant_id"] for t in admin("tenants", "list")["tenants"]}
    # And pulls still work: engine1 loads what engine2 computes after the restart (grants signed by the new process).
    prompt = draw(3)
    computed = complete("engine2", prompt)
    wait_held(keys[TENANT], prompt, {"dp2": USABLE_BLOCKS})
    pulled = complete("engine1", prompt)
    assert pulled["kvmesh"]["source"] == "dp2" and pulled["kvmesh"]["peer_tokens"] == USABLE_BLOCKS * BLOCK
    assert pulled["token_ids"] == computed["token_ids"]
    RESULTS["pull_bytes_after_restart"] = pulled["kvmesh"]["bytes_pulled"]
