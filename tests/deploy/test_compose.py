"""docker-compose.yml, checked offline (test_compose_stack.py runs it, under `make compose-test`).

1. It validates against the Compose Specification JSON schema (``compose_spec.json``, vendored from the
   docker-compose 1.29.2 wheel, Apache-2.0 — the schema `docker-compose config` itself applies).
2. Structural checks the schema cannot make: depends_on targets exist, services reach each other by name
   and never over localhost, every build file and bind-mounted file exists, healthchecks are present,
   host ports are unique, every KVMESH_CP_* / KVMESH_DP_* variable is a real setting, no password or key has
   a default, each node's secret volume is mounted into that node's services only, and every gRPC link is mutual
   TLS with each service's certificate (issued for its service name) on a volume of its own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from control_plane.config import ControlPlaneConfig
from data_plane.config import DataPlaneConfig

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict = COMPOSE["services"]
# Images without a shell or client inside: documented in docker-compose.yml, started-only dependencies.
NO_HEALTHCHECK = {"otel-collector", "jaeger"}
# One-shot jobs (restart "no"): dependents wait for them to complete successfully.
ONE_SHOT = {n for n, s in SERVICES.items() if s.get("restart") == "no"}


def test_valid_against_the_compose_spec():
    schema = json.loads((Path(__file__).with_name("compose_spec.json")).read_text())
    errors = sorted(jsonschema.Draft201909Validator(schema).iter_errors(COMPOSE), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]


def _is_engine(service: dict) -> bool:
    return "vllm.entrypoints.openai.api_server" in (service.get("command") or [])


def test_topology_has_every_part():
    assert {"redis", "control-plane", "otel-collector", "jaeger"} <= set(SERVICES)
    data_planes = [n for n, s in SERVICES.items() if s.get("command") == ["data-plane"]]
    engines = [n for n, s in SERVICES.items() if _is_engine(s)]
    assert len(data_planes) >= 2 and len(engines) >= 2


def test_depends_on_targets_exist_and_wait_for_health():
    for name, service in SERVICES.items():
        for target, cond in (service.get("depends_on") or {}).items():
            assert target in SERVICES, f"{name} depends on unknown service {target}"
            if target in ONE_SHOT:
                assert cond["condition"] == "service_completed_successfully", f"{name} should wait for {target}"
            elif target not in NO_HEALTHCHECK:
                assert cond["condition"] == "service_healthy", f"{name} should wait for {target} to be healthy"


def test_every_long_running_service_has_a_healthcheck():
    missing = [n for n, s in SERVICES.items() if n not in NO_HEALTHCHECK | ONE_SHOT and "healthcheck" not in s]
    assert not missing


def _env(service: dict) -> dict[str, str]:
    return {k: str(v) for k, v in (service.get("environment") or {}).items()}


def test_services_reach_each_other_by_name_not_localhost():
    local = re.compile(r"\b(localhost|127\.0\.0\.1|\[::1\])\b")
    for name, service in SERVICES.items():
        texts = list(_env(service).values()) + [str(c) for c in service.get("command") or []]
        offenders = [t for t in texts if local.search(t)]
        assert not offenders, f"{name} points at localhost: {offenders}"
        for key, value in _env(service).items():
            if key.endswith(("_ADDRESS", "_ENDPOINT", "_URL")):
                host = re.sub(r"^\w+://", "", value).split(":")[0]
                assert host in SERVICES, f"{name}: {key}={value} does not name a service"


def test_redis_is_on_a_network_only_the_control_plane_shares():
    """Every connection to Redis takes one of its clients before a password is asked: a container that reaches it
    (an engine, a data plane) could take them all. Redis is on the internal ``store`` network alone, and only the
    control plane joins it (the running stack checks the reach: test_compose_stack.py)."""
    assert SERVICES["redis"]["networks"] == ["store"]
    assert COMPOSE["networks"]["store"].get("internal") is True
    joined = {name for name, service in SERVICES.items() if "store" in (service.get("networks") or [])}
    assert joined == {"redis", "control-plane"}


def test_build_files_and_bind_mounts_exist():
    for name, service in SERVICES.items():
        build = service.get("build")
        if build:
            assert (ROOT / build["context"] / build["dockerfile"]).is_file(), name
            target = build.get("target")
            assert not target or f" AS {target}" in (ROOT / build["context"] / build["dockerfile"]).read_text()
        else:
            assert service.get("image"), f"{name} has neither build nor image"
        for volume in service.get("volumes") or []:
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in COMPOSE["volumes"], f"{name} uses undeclared volume {source}"


def _interpolate(text: str) -> str:
    """Compose's ``${VAR:-default}`` / ``${VAR-default}`` with nothing set: the defaults."""
    return re.sub(r"\$\{\w+:?-([^}]*)\}", r"\1", text)


def test_host_ports_are_unique_and_loopback_by_default():
    ports = [_interpolate(p).rsplit(":", 1)[0] for s in SERVICES.values() for p in s.get("ports") or []]
    assert len(ports) == len(set(ports))
    assert all(p.startswith("127.0.0.1:") for p in ports), ports


def test_no_password_or_key_has_a_default():
    text = (ROOT / "docker-compose.yml").read_text()
    defaults = re.findall(r"\$\{(\w*(?:PASSWORD|KEY|SECRET|TOKEN)\w*):?-", text)
    assert not defaults
    secrets = [k for s in SERVICES.values() for k, v in _env(s).items()
               if re.search(r"PASSWORD|_KEY$|SECRET|_TOKEN$", k) and not k.endswith("_FILE")]
    assert not secrets, f"secrets belong in files on the secret volumes: {secrets}"
    acl = (ROOT / "docker/redis/users.acl").read_text()
    assert not re.search(r"#[0-9a-f]{64}|>\S|nopass", acl)  # placeholders (#@user) only


NODE_SERVICES = {"dp1": {"dp1", "engine1"}, "dp2": {"dp2", "engine2"}}
INIT_STEPS = {"secrets-init", "keys-init"}


def _mounting(volume: str) -> set[str]:
    return {name for name, s in SERVICES.items() for v in s.get("volumes") or [] if v.split(":")[0] == volume}


def test_each_node_secret_is_mounted_into_that_node_only():
    for node, services in NODE_SERVICES.items():
        assert _mounting(f"{node}-secrets") == services | INIT_STEPS
        for service in services:
            mount = next(v for v in SERVICES[service]["volumes"] if v.startswith(f"{node}-secrets:"))
            assert mount.endswith(":ro")
    assert _mounting("cp-secrets") == {"control-plane", "secrets-init"}
    assert _mounting("redis-secrets") == {"redis", "secrets-init"}
    assert _mounting("admin-secrets") == {"control-plane", "admin"} | INIT_STEPS
    for name, service in SERVICES.items():
        if _is_engine(service):
            flag = next(c for c in service["command"] if c.startswith("--kv-transfer-config="))
            key_file = json.loads(flag.split("=", 1)[1])["kv_connector_extra_config"]["api_key_file"]
            mounted = [v.split(":")[1] for v in service["volumes"] if v.split(":")[0].endswith("-secrets")]
            assert [m for m in mounted if key_file.startswith(m + "/")], f"{name}: {key_file} is on no secret volume"


@pytest.mark.parametrize("prefix, settings", [("KVMESH_CP_", ControlPlaneConfig), ("KVMESH_DP_", DataPlaneConfig)])
def test_kvmesh_variables_are_real_settings(prefix, settings):
    for name, service in SERVICES.items():
        for key in _env(service):
            if key.startswith(prefix):
                assert key[len(prefix):].lower() in settings.model_fields, f"{name}: unknown setting {key}"


def test_engines_load_the_kvmesh_connector_and_share_their_node_memory():
    for name, service in SERVICES.items():
        if not _is_engine(service):
            continue
        flag = next(c for c in service["command"] if c.startswith("--kv-transfer-config="))
        config = json.loads(flag.split("=", 1)[1])
        assert config["kv_connector"] == "KvmeshConnector"
        assert config["kv_connector_module_path"] == "engine_connector.connector"
        assert service["ipc"].startswith("service:") and service["ipc"].split(":")[1] in SERVICES
        assert _env(service)["PYTHONHASHSEED"] == "0"
        assert _env(service)["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
        assert _env(service)["KVMESH_TRACE_FILE"].startswith("/var/log/kvmesh/traces/")


def test_redis_uses_the_acl_file_and_persists():
    conf = (ROOT / "docker/redis/redis.conf").read_text()
    acl = (ROOT / "docker/redis/users.acl").read_text().splitlines()
    assert "appendonly yes" in conf and "aclfile /run/kvmesh/redis/users.acl" in conf
    assert any(v == "redis-secrets:/run/kvmesh/redis" for v in SERVICES["redis"]["volumes"])
    assert any(line.startswith("user default off") for line in acl)
    cp = _env(SERVICES["control-plane"])
    for user in (cp["KVMESH_CP_REDIS_USERNAME"], cp["KVMESH_CP_REDIS_ACL_USERNAME"]):
        assert any(line.startswith(f"user {user} on #@{user} ") for line in acl)  # a generated password's hash
    assert any(v.endswith(":/data") for v in SERVICES["redis"]["volumes"])


# ---- TLS ----

TLS_DIR = "/run/kvmesh/tls"
GRPC_SERVERS = {"control-plane": "KVMESH_CP_", "dp1": "KVMESH_DP_", "dp2": "KVMESH_DP_"}
TLS_CLIENTS = {"engine1", "engine2", "admin", "keys-init"}  # keys-init runs the admin CLI: the admin certificate


def _tls_names() -> tuple[list[str], list[str]]:
    command = SERVICES["secrets-init"]["command"]
    return (command[command.index("--tls-servers") + 1].split(","),
            command[command.index("--tls-clients") + 1].split(","))


def _tls_volume(service: str) -> str:
    (mount,) = [v for v in SERVICES[service].get("volumes") or [] if v.split(":")[1] == TLS_DIR]
    assert mount.endswith(":ro"), service
    return mount.split(":")[0]


def test_every_grpc_server_requires_mutual_tls_on_a_certificate_for_its_service_name():
    servers, clients = _tls_names()
    assert set(GRPC_SERVERS) == set(servers) and set(clients) == {"engine1", "engine2", "admin"}
    for name, prefix in GRPC_SERVERS.items():
        env = _env(SERVICES[name])
        assert {env[prefix + k] for k in ("TLS_CERT_FILE", "TLS_KEY_FILE", "TLS_CLIENT_CA_FILE")} == {
            f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key", f"{TLS_DIR}/ca.crt"}, name
        # The health check speaks mutual TLS too (with the service's own certificate), checking the service name.
        test = SERVICES[name]["healthcheck"]["test"]
        assert test[-3:] == ["--tls", TLS_DIR, name], name
    for name in ("dp1", "dp2"):  # a data plane calls the control plane and its peers over TLS
        env = _env(SERVICES[name])
        assert env["KVMESH_DP_TLS_CA_FILE"] == f"{TLS_DIR}/ca.crt" and "KVMESH_DP_TLS_SERVER_NAME" not in env
        assert env["KVMESH_DP_ADVERTISE_ADDRESS"].split(":")[0] == name  # the name in its certificate
        assert env["KVMESH_DP_CONTROL_PLANE_ADDRESS"].split(":")[0] == "control-plane"


def test_every_grpc_client_shows_its_own_certificate():
    for name, service in SERVICES.items():
        if _is_engine(service):
            flag = next(c for c in service["command"] if c.startswith("--kv-transfer-config="))
            extra = json.loads(flag.split("=", 1)[1])["kv_connector_extra_config"]
            assert (extra["tls_ca_file"], extra["tls_cert_file"], extra["tls_key_file"]) == (
                f"{TLS_DIR}/ca.crt", f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key"), name
            assert not extra.get("tls_server_name")  # the host of each address is the name checked
            assert {extra["data_plane_address"].split(":")[0], extra["control_plane_address"].split(":")[0]} <= \
                set(GRPC_SERVERS)
        elif name in ("admin", "keys-init"):
            env = _env(service)
            assert (env["KVMESH_ADMIN_TLS_CA_FILE"], env["KVMESH_ADMIN_TLS_CERT_FILE"],
                    env["KVMESH_ADMIN_TLS_KEY_FILE"]) == (f"{TLS_DIR}/ca.crt", f"{TLS_DIR}/tls.crt",
                                                          f"{TLS_DIR}/tls.key")


def test_each_tls_key_is_mounted_into_its_own_service_only():
    owners = {service: _tls_volume(service) for service in set(GRPC_SERVERS) | TLS_CLIENTS}
    assert owners["keys-init"] == owners["admin"] == "admin-tls"
    assert len(set(owners.values())) == len(owners) - 1  # one volume per service (keys-init shares the admin's)
    for service, volume in owners.items():
        assert _mounting(volume) == ({"admin", "keys-init"} if volume == "admin-tls" else {service}) | {
            "secrets-init"}, volume
    servers, clients = _tls_names()
    for name in servers + clients:  # secrets-init writes each certificate into that volume
        volume = owners[name]
        assert f"{volume}:/secrets/tls/{name}" in SERVICES["secrets-init"]["volumes"]
    assert _mounting("ca-secrets") == {"secrets-init"}  # the CA's key: nowhere else
