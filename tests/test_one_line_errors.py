"""Every command fails in one line: each subcommand driven into each error a user can cause, as a subprocess, against
real servers (the set-up's Valkey, a real control plane). Each case asserts exactly one line on stderr, of the form
``kvmesh <subcommand>: error: <what>; <how to fix>``, no traceback, and a non-zero exit (2: bad input, 1: runtime)."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh_apps.procs import ServiceProcess
from kvmesh_apps.redis_server import free_port, write_secret
from tenancy.grants import GrantSigner

BAD_INPUT, RUNTIME = 2, 1


def kvmesh(*args: str, module: str = "kvmesh_apps.cli", env: dict[str, str] | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def fails_in_one_line(out: subprocess.CompletedProcess, status: int, prog: str, *words: str) -> str:
    """The one stderr line of a failed command (asserting its form, status and the words it must name)."""
    lines = out.stderr.splitlines()
    assert "Traceback" not in out.stderr and len(lines) == 1, out.stderr
    assert out.returncode == status, (out.returncode, out.stderr)
    line = lines[0]
    assert line.startswith(f"{prog}: error: ") and "; " in line, line
    for word in words:
        assert word in line, (word, line)
    return line


@pytest.fixture(scope="module")
def secrets(tmp_path_factory, admin_key) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("secrets")
    GrantSigner.create_file(d / "grant.pem")
    return {"admin": write_secret(d / "admin.key", admin_key), "grant": d / "grant.pem"}


def cp_flags(secrets: dict[str, Path], redis_url: str, listen: str = "127.0.0.1:0") -> list[str]:
    return ["--listen", listen, "--redis-url", redis_url, "--admin-key-file", str(secrets["admin"]),
            "--grant-key-file", str(secrets["grant"]), "--key-prefix", "oneline"]


@pytest.fixture(scope="module")
def control_plane(redis_server, secrets):
    proc = ServiceProcess(["control-plane", *cp_flags(secrets, redis_server.url)]).start()
    yield proc
    proc.stop()


# ---- control plane ----

def test_control_plane_with_redis_down(secrets):
    flags = cp_flags(secrets, f"redis://127.0.0.1:{free_port()}/0")
    out = kvmesh("control-plane", *flags)
    fails_in_one_line(out, RUNTIME, "kvmesh control-plane", "Redis unreachable", "Redis URL")
    # the same without a grant key file (a first try's settings): still that one line, no warning before it
    out = kvmesh("control-plane", *flags[:flags.index("--grant-key-file")], *flags[flags.index("--key-prefix"):])
    fails_in_one_line(out, RUNTIME, "kvmesh control-plane", "Redis unreachable")


def test_control_plane_with_a_bad_redis_url(secrets):
    out = kvmesh("control-plane", *cp_flags(secrets, "http://127.0.0.1:6379"))
    fails_in_one_line(out, BAD_INPUT, "kvmesh control-plane", "http://127.0.0.1:6379", "redis://")


def test_control_plane_with_its_port_taken(redis_server, secrets, control_plane):
    out = kvmesh("control-plane", *cp_flags(secrets, redis_server.url, listen=control_plane.address))
    fails_in_one_line(out, RUNTIME, "kvmesh control-plane", f"cannot listen on {control_plane.address}",
                      "pick another port")
    assert control_plane.proc.poll() is None  # the running one is untouched


def test_control_plane_bad_settings(redis_server, secrets, tmp_path):
    out = kvmesh("control-plane", *cp_flags(secrets, redis_server.url), "--lease-ms", "5")
    fails_in_one_line(out, BAD_INPUT, "kvmesh control-plane", "invalid configuration", "--lease-ms",
                      "KVMESH_CP_LEASE_MS")
    flags = cp_flags(secrets, redis_server.url)
    flags[flags.index("--admin-key-file") + 1] = str(tmp_path / "missing.key")
    fails_in_one_line(kvmesh("control-plane", *flags), BAD_INPUT, "kvmesh control-plane",
                      str(tmp_path / "missing.key"), "check the path")


def test_control_plane_with_its_metrics_port_taken_or_a_tls_file_missing(redis_server, secrets, control_plane,
                                                                         tmp_path):
    out = kvmesh("control-plane", *cp_flags(secrets, redis_server.url), "--metrics-listen", control_plane.address)
    fails_in_one_line(out, RUNTIME, "kvmesh control-plane", f"cannot listen on {control_plane.address}")
    missing = str(tmp_path / "absent.pem")
    out = kvmesh("control-plane", *cp_flags(secrets, redis_server.url), "--tls-cert-file", missing,
                 "--tls-key-file", missing)
    fails_in_one_line(out, BAD_INPUT, "kvmesh control-plane", missing)


def test_python_m_control_plane_server_is_one_line_too(secrets):
    out = kvmesh(*cp_flags(secrets, f"redis://127.0.0.1:{free_port()}/0"), module="control_plane.server")
    fails_in_one_line(out, RUNTIME, "kvmesh control-plane", "Redis unreachable")


# ---- data plane ----

def dp_flags(key_file: Path | str, listen: str = "127.0.0.1:0") -> list[str]:
    return ["--node-id", "oneline", "--listen", listen, "--api-key-file", str(key_file), "--no-lock-memory",
            "--capacity-bytes", "8MiB", "--block-bytes", str(1 << 20)]


def test_data_plane_with_a_missing_or_unreadable_key_file(tmp_path):
    for path in (tmp_path / "absent.key", tmp_path):  # a directory is unreadable as a key file
        out = kvmesh("data-plane", *dp_flags(path))
        fails_in_one_line(out, BAD_INPUT, "kvmesh data-plane", str(path))
    # as `python -m data_plane.server` (how kvmesh_apps.dp_process starts it)
    out = kvmesh(*dp_flags(tmp_path / "absent.key"), module="data_plane.server")
    fails_in_one_line(out, BAD_INPUT, "kvmesh data-plane", "absent.key")


def test_a_key_file_holding_what_no_key_holds_is_named_in_one_line(tmp_path):
    """Non-ASCII, a control character, binary: gRPC refused to send such a key (admin: four lines of gRPC log and
    an internal error; vllm-events: a 10 s wait blamed on the control plane; data plane: silence)."""
    for name, content in (("utf8.key", "kvm_abcdefabcdef_s\u00e9cret\n".encode()), ("ctl.key", b"kvm_ab\x01cd\n"),
                          ("binary.key", b"\xff\xfe\x00\x81" * 8)):
        path = tmp_path / name
        path.write_bytes(content)
        why = "is not text" if name == "binary.key" else "holds characters no API key has"
        fails_in_one_line(kvmesh("data-plane", *dp_flags(path)), BAD_INPUT, "kvmesh data-plane", str(path), why)
        fails_in_one_line(kvmesh("admin", "--control-plane", f"127.0.0.1:{free_port()}", "--key-file", str(path),
                                 "tenants", "list"), BAD_INPUT, "kvmesh admin", str(path), why)
        fails_in_one_line(kvmesh("vllm-events", "--node-id", "n1", "--api-key-file", str(path), "--control-plane",
                                 f"127.0.0.1:{free_port()}", "--model", "m", "--data-plane-address", "127.0.0.1:2",
                                 "--zmq", "tcp://127.0.0.1:5557", "--block-size", "16", "--kv-dtype", "bfloat16"),
                          BAD_INPUT, "kvmesh vllm-events", str(path), "holds characters no API key has")


def test_a_tier_larger_than_the_host_names_the_setting_and_leaves_no_file(tmp_path):
    key = tmp_path / "node.key"
    key.write_text(kvmesh("admin", "new-key").stdout)
    out = kvmesh("data-plane", "--node-id", "huge", "--listen", "127.0.0.1:0", "--api-key-file", str(key),
                 "--no-lock-memory", "--shm-dir", str(tmp_path), "--capacity-bytes", "1PiB")
    fails_in_one_line(out, BAD_INPUT, "kvmesh data-plane", "cannot map a CPU tier", "--capacity-bytes")
    assert not list(tmp_path.glob("*.tier")), "the refused tier's file was left behind"


def test_data_plane_with_its_port_taken(tmp_path, admin_key):
    key = write_secret(tmp_path / "node.key", admin_key)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = f"127.0.0.1:{holder.getsockname()[1]}"
        out = kvmesh(*dp_flags(key, listen=taken), module="data_plane.server")
    fails_in_one_line(out, RUNTIME, "kvmesh data-plane", f"cannot listen on {taken}")


def test_data_plane_with_its_metrics_port_taken_or_a_tls_file_missing(tmp_path, admin_key):
    key = write_secret(tmp_path / "node.key", admin_key)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = f"127.0.0.1:{holder.getsockname()[1]}"
        out = kvmesh("data-plane", *dp_flags(key), "--metrics-listen", taken)
    fails_in_one_line(out, RUNTIME, "kvmesh data-plane", f"cannot listen on {taken}")
    missing = str(tmp_path / "absent.pem")
    for flags in (["--tls-cert-file", missing, "--tls-key-file", missing], ["--tls-ca-file", missing,
                                                                           "--control-plane-address", "127.0.0.1:1"]):
        out = kvmesh("data-plane", *dp_flags(key), *flags)
        fails_in_one_line(out, BAD_INPUT, "kvmesh data-plane", missing)


def test_data_plane_bad_settings(tmp_path):
    out = kvmesh("data-plane", *dp_flags(tmp_path / "k"), "--capacity-bytes", "lots")
    fails_in_one_line(out, BAD_INPUT, "kvmesh data-plane", "invalid configuration", "--capacity-bytes")
    out = kvmesh("data-plane", "--no-such-flag")
    fails_in_one_line(out, BAD_INPUT, "kvmesh data-plane", "--no-such-flag", "--help")
    out = kvmesh("data-plane", *dp_flags(tmp_path / "k"), "--peer-tls-name", "host")
    fails_in_one_line(out, BAD_INPUT, "kvmesh data-plane", "--peer-tls-name", "'node-id' or 'address'")
    # under TLS peers check a certificate names the node id: one with ':' cannot be a DNS name
    out = kvmesh("data-plane", *dp_flags(tmp_path / "k")[2:], "--node-id", "rack:7", "--tls-ca-file", "/ca.crt")
    fails_in_one_line(out, BAD_INPUT, "kvmesh data-plane", "'rack:7' cannot be a certificate's DNS name")



@pytest.mark.parametrize("flag, value, words", [
    ("--listen", "127.0.0.1:99999", ["listen '127.0.0.1:99999'", "0 to 65535"]),  # served on 34463 before
    ("--advertise-address", "127.0.0.1:99999", ["advertise_address", "0 to 65535"]),  # registered as given before
    ("--advertise-address", "a:b:c", ["advertise_address 'a:b:c'", "brackets"]),
    ("--advertise-address", "10.0.0.7:0", ["advertise_address", "port 0"]),
    ("--control-plane-address", "notanaddress", ["control_plane_address", "needs a port"]),  # retried for ever before
    ("--control-plane-address", "127.0.0.1:99999", ["control_plane_address", "0 to 65535"]),
])
def test_data_plane_addresses_out_of_range_or_malformed(tmp_path, flag, value, words):
    """Found in review: ports above 65535 lost their high bits in getaddrinfo and gRPC (99999 served on 34463), and
    a malformed control-plane address read as an outage and was retried for ever. Controls: every other data-plane
    test starts on good addresses, IPv6 ones in brackets included (test_addresses_in_brackets_and_bare_hosts_pass)."""
    out = kvmesh("data-plane", *dp_flags(tmp_path / "k"), flag, value)
    fails_in_one_line(out, BAD_INPUT, "kvmesh data-plane", "invalid configuration", *words)


def test_addresses_in_brackets_and_bare_hosts_pass():
    from data_plane.config import DataPlaneConfig
    from kvmesh.addresses import check_address

    assert check_address("listen", "[::1]:0", port="any") == "[::1]:0"
    assert check_address("advertise_address", "node-7.rack", port="optional") == "node-7.rack"
    config = DataPlaneConfig(node_id="n1", api_key="k", listen="[::1]:0", advertise_address="[fd00::7]",
                             control_plane_address="cp.internal:50051")
    assert config.advertised(7100) == "[fd00::7]:7100"
    bare = DataPlaneConfig(node_id="n1", api_key="k", listen="[::1]:0", advertise_address="fd00::7")
    assert bare.advertised(7100) == "[fd00::7]:7100"  # a bare IPv6 host, as before


def test_a_misspelled_setting_in_the_environment_stops_the_start(secrets, tmp_path):
    """Found in review: pydantic-settings ignores a variable with the prefix that names no setting, so
    KVMESH_CP_TLS_CLIENT_CA (for ..._FILE) left mutual TLS off without a word, and KVMESH_DP_CAPACITY (for
    ..._BYTES) pinned the 1 GiB default. Controls: compose's KVMESH_CP_PORT and the variables Kubernetes gives a pod
    for a Service named kvmesh-cp are let through, and a name like no setting is only warned about (the start goes
    on to its next check)."""
    out = kvmesh("control-plane", "--listen", "127.0.0.1:0", env={"KVMESH_CP_TLS_CLIENT_CA": "/ca.crt"})
    fails_in_one_line(out, BAD_INPUT, "kvmesh control-plane", "KVMESH_CP_TLS_CLIENT_CA",
                      "did you mean KVMESH_CP_TLS_CLIENT_CA_FILE?")
    out = kvmesh("data-plane", *dp_flags(tmp_path / "k"), env={"KVMESH_DP_CAPACITY": "64MiB"})
    fails_in_one_line(out, BAD_INPUT, "kvmesh data-plane", "did you mean KVMESH_DP_CAPACITY_BYTES?")
    kubernetes = {"KVMESH_CP_PORT": "tcp://10.0.0.9:50051", "KVMESH_CP_SERVICE_HOST": "10.0.0.9",
                  "KVMESH_CP_PORT_50051_TCP_ADDR": "10.0.0.9"}  # a Service named kvmesh-cp: not settings
    out = kvmesh("control-plane", "--listen", "127.0.0.1:0", "--redis-url", "redis://127.0.0.1:1/0", env=kubernetes)
    assert not any(name in out.stderr for name in kubernetes) and "no admin key" in out.stderr, out.stderr
    out = kvmesh("control-plane", "--listen", "127.0.0.1:0", "--redis-url", "redis://127.0.0.1:1/0",
                 env={"KVMESH_CP_QQQZZZ": "1"})  # like no setting: said, and the start goes on
    assert "warning: KVMESH_CP_QQQZZZ in the environment names no setting (ignored)" in out.stderr, out.stderr
    assert "no admin key" in out.stderr

# ---- admin ----

def admin(control_plane, *args: str, key: Path | None = None) -> subprocess.CompletedProcess:
    auth = ["--key-file", str(key)] if key else []
    return kvmesh("admin", "--control-plane", control_plane.address, *auth, *args)


def test_admin_input_errors(control_plane, secrets, tmp_path):
    fails_in_one_line(admin(control_plane, "tenants", "list"), BAD_INPUT, "kvmesh admin", "--key-file")
    fails_in_one_line(admin(control_plane, "tenants", "list", key=tmp_path / "none.key"), BAD_INPUT,
                      "kvmesh admin", "none.key")
    out = admin(control_plane, "--tls-ca-file", str(tmp_path / "ca.pem"), "tenants", "list", key=secrets["admin"])
    fails_in_one_line(out, BAD_INPUT, "kvmesh admin", "ca.pem")
    fails_in_one_line(admin(control_plane, "audit", "--limit", "-5", key=secrets["admin"]), BAD_INPUT,
                      "kvmesh admin", "--limit", "-5")
    fails_in_one_line(kvmesh("admin", "--control-plane", "127.0.0.1", "--key-file", str(secrets["admin"]),
                             "tenants", "list"), BAD_INPUT, "kvmesh admin", "host:port")
    fails_in_one_line(kvmesh("admin", "--key-file", str(secrets["admin"])), BAD_INPUT, "kvmesh admin", "required")
    fails_in_one_line(kvmesh("admin", "--key-file", str(secrets["admin"]), "tenants", "list",
                             env={"KVMESH_CONTROL_PLANE": "control-plane"}), BAD_INPUT, "kvmesh admin", "host:port")
    # the positive control: the same command, well formed, answers
    out = admin(control_plane, "audit", "--limit", "5", key=secrets["admin"])
    assert out.returncode == 0 and isinstance(json.loads(out.stdout), dict), out.stderr


def test_admin_against_an_unreachable_control_plane(secrets):
    out = kvmesh("admin", "--control-plane", f"127.0.0.1:{free_port()}", "--key-file", str(secrets["admin"]),
                 "tenants", "list")
    fails_in_one_line(out, RUNTIME, "kvmesh admin", "UNAVAILABLE", "check that the service runs")


def test_admin_with_a_wrong_key_fails_in_one_line(control_plane, tmp_path):
    wrong = kvmesh("admin", "new-key").stdout.strip()
    out = admin(control_plane, "tenants", "list", key=write_secret(tmp_path / "wrong.key", wrong))
    fails_in_one_line(out, RUNTIME, "kvmesh admin", "UNAUTHENTICATED", "check the API key")


def test_keys_issue_checks_secret_out_before_issuing(control_plane, secrets, tmp_path):
    def key_ids() -> set[str]:
        out = admin(control_plane, "keys", "list", key=secrets["admin"])
        assert out.returncode == 0, out.stderr
        return {k["key_id"] for k in json.loads(out.stdout).get("keys", [])}

    before = key_ids()
    for bad in ("/nonexistent-dir/k", str(tmp_path)):
        out = admin(control_plane, "keys", "issue", "--role", "node", "--node", "n1", "--secret-out", bad,
                    key=secrets["admin"])
        fails_in_one_line(out, BAD_INPUT, "kvmesh admin", "--secret-out")
    assert key_ids() == before  # no key was issued whose secret nobody saw
    # the positive control: a writable path gets the secret (0600), and the key exists
    good = tmp_path / "node.key"
    out = admin(control_plane, "keys", "issue", "--role", "node", "--node", "n1", "--secret-out", str(good),
                key=secrets["admin"])
    assert out.returncode == 0, out.stderr
    issued = json.loads(out.stdout)
    assert good.read_text().strip() == issued["secret"] and stat.S_IMODE(good.stat().st_mode) == 0o600
    assert key_ids() == before | {issued["key"]["key_id"]}
    assert [p.name for p in tmp_path.iterdir()] == ["node.key"]  # no staging file left behind


# ---- programs: bad flag values ----

@pytest.mark.parametrize("prog, args, words", [
    ("kvmesh up", ["up", "--data-planes", "two"], ["--data-planes"]),
    ("kvmesh up", ["up", "--capacity", "ten"], ["--capacity"]),
    ("kvmesh up", ["up", "--workdir", __file__], ["--workdir", __file__, "is a file"]),
    ("kvmesh demo", ["demo", "--sessions", "0"], ["--sessions", "positive"]),
    ("kvmesh demo", ["demo", "--model", "huge"], ["--model", "huge"]),
    ("kvmesh vllm-events", ["vllm-events", "--zmq", "tcp://127.0.0.1:1"], ["required"]),
    ("kvmesh vllm-events", ["vllm-events", "--zmq", "tcp://127.0.0.1:1", "--control-plane", "cp.example",
                            "--node-id", "n", "--data-plane-address", "127.0.0.1:1", "--tenant", "t", "--model", "m",
                            "--block-size", "16"], ["host:port"]),
    ("kvmesh bench control-plane", ["bench", "control-plane", "--rounds", "0"], ["--rounds"]),
    ("kvmesh bench load", ["bench", "load", "--seconds", "-1"], ["--seconds"]),
    ("kvmesh bench pull", ["bench", "pull", "--rounds", "many"], ["--rounds"]),
    ("kvmesh bench replay", ["bench", "replay", "--trace", "/nonexistent.jsonl"], ["/nonexistent.jsonl"]),
    ("kvmesh bench engine", ["bench", "engine", "--pullers", "-3"], ["--pullers"]),
    ("kvmesh bench prefetch", ["bench", "prefetch", "--repetitions", "0"], ["--repetitions"]),
    ("kvmesh bench prefetch", ["bench", "prefetch", "--prefix-tokens", "100"], ["--prefix-tokens", "32"]),
    ("kvmesh bench prefetch", ["bench", "prefetch", "--link-mbit", "0"], ["--link-mbit"]),
    ("kvmesh", ["frobnicate"], ["unknown command"]),
    ("kvmesh bench", ["bench"], ["no benchmark"]),
    ("kvmesh bench", ["bench", "frobnicate"], ["unknown benchmark 'frobnicate'"]),
    # a flag no parser knows, before the subcommand: named, not its value taken for the subcommand
    ("kvmesh admin", ["admin", "--admin-key", "kvm_a_b", "tenants", "list"], ["unrecognized argument --admin-key"]),
])
def test_bad_flag_values(prog, args, words):
    fails_in_one_line(kvmesh(*args), BAD_INPUT, prog, *words)


# ---- help ----

def test_help_texts_are_clean():
    dp = kvmesh("data-plane", "--help")
    assert dp.returncode == 0 and "PydanticUndefined" not in dp.stdout and "--node-id" in dp.stdout
    adm = kvmesh("admin", "--help")
    assert adm.returncode == 0 and "``" not in adm.stdout and ":data:" not in adm.stdout
    assert adm.stdout.count("keys issue --role") == 1 and adm.stdout.count("tenant administration") == 1
