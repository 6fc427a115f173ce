"""`kvmesh up`: starts the local topology, every service answers gRPC health (over mutual TLS; plaintext only with
--insecure-plaintext), Ctrl-C stops it all; slot sizes from --model or --block-bytes, bad input refused with one line
and exit status 2."""

from __future__ import annotations

import asyncio
import json
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_connector.config import KV_LAYOUT
from kvmesh.namespace import CacheConfig, Namespace

from data_plane.client import DataPlaneClient
from kvmesh.channels import ClientTLS
from kvmesh.command_line import run_command
from kvmesh_apps import up


def admin_tls(info: dict, server: str | None = None) -> ClientTLS | None:
    """The admin's certificate from ``kvmesh up --json``, checking the server's names ``server`` (a data plane's:
    its node id; None: the address, which only the control plane's names) (None: the fleet runs plaintext)."""
    tls = info["tls"]
    return ClientTLS(tls["ca_file"], tls["admin"]["cert_file"], tls["admin"]["key_file"], server) if tls else None


def serving(address: str, tls: ClientTLS | None) -> bool:
    channel = grpc.insecure_channel(address) if tls is None else grpc.secure_channel(
        address, tls.credentials(), options=tls.options([]))
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_up_starts_serves_and_stops(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh_apps.cli", "up", "--data-planes", "1", "--json",
                             "--workdir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        info = json.loads(line)
        tls = info["tls"]  # mutual TLS by default; the paths of the CA and every certificate are listed
        assert tls["ca_file"] == str(tmp_path / "tls" / "ca.crt")
        assert set(tls["data_planes"]) == set(tls["engines"]) == {"dp1"}
        for pair in [tls["admin"], tls["control_plane"], tls["data_planes"]["dp1"], tls["engines"]["dp1"]]:
            assert Path(pair["cert_file"]).is_file() and Path(pair["key_file"]).is_file()
        assert serving(info["control_plane"], admin_tls(info))
        for node, address in info["data_planes"].items():
            assert serving(address, admin_tls(info, node))
        assert Path(info["admin_key_file"]).read_text().startswith("kvm_")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        assert list((tmp_path / "redis").glob("appendonly*"))  # Redis ran with AOF in the workdir
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_insecure_plaintext_runs_every_link_in_plaintext(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh_apps.cli", "up", "--data-planes", "2", "--json",
                             "--insecure-plaintext", "--workdir", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        assert info["tls"] is None and not (tmp_path / "tls").exists()
        for address in [info["control_plane"], *info["data_planes"].values()]:
            assert serving(address, None)

        async def pull():  # the data planes reach the control plane and each other in plaintext
            key1, key2 = (Path(info["node_key_files"][n]).read_text().strip() for n in ("dp1", "dp2"))
            async with DataPlaneClient(info["data_planes"]["dp1"], key=key1) as dp1, \
                    DataPlaneClient(info["data_planes"]["dp2"], key=key2) as dp2:
                ns = _namespace(info)
                hashes = [bytes([i]) * 32 for i in range(2)]
                await dp1.reserve(ns, hashes)
                await dp1.commit(ns, hashes)
                return await dp2.pull(ns, hashes, "dp1", info["data_planes"]["dp1"], timeout_ms=10_000)

        assert asyncio.run(pull()).pulled == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _namespace(info: dict) -> Namespace:
    return Namespace(info["tenant"], "m", "r", CacheConfig(block_size=info["block_tokens"], kv_dtype="float32",
                                                           kv_layout=KV_LAYOUT)).validate()


# ---- slot size: derived from --model, explicit, or refused before anything starts ----

SHAPE = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 1, "num_hidden_layers": 3, "intermediate_size": 256, "vocab_size": 512,
         "torch_dtype": "float32"}


def _model(tmp_path: Path, config: dict | str = SHAPE, name: str = "model") -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return path


def _refused(argv: list[str], capsys) -> str:
    code = run_command("kvmesh up", up.main, argv)   # as `kvmesh up` runs it
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvmesh up: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("argv, message", [
    (["--model", "{tmp}/missing"], "is not a directory"),
    (["--model", "{tmp}/no-config"], "cannot read"),
    (["--model", "{tmp}/broken"], "not valid JSON"),
    (["--model", "{tmp}/bad-head"], "head size 48"),
    (["--model", "{tmp}/model", "--block-tokens", "48"], "positive multiple of 32"),
    (["--block-tokens", "0"], "--block-tokens must be 1 to 4096 tokens"),
    (["--block-bytes", "4096", "--block-tokens", "8192"], "--block-tokens must be 1 to 4096 tokens"),
    (["--block-bytes", "0"], "--block-bytes must be a positive"),
    (["--block-bytes", "-5"], "--block-bytes must be a positive"),
    (["--model", "{tmp}/model", "--block-bytes", "4096"], "contradicts --model: its 32-token blocks are 12288"),
    (["--dtype", "float32"], "give --model too"),
    (["--model", "{tmp}/model", "--dtype", "int8"], "dtype 'int8'"),
    (["--model", "{tmp}/model", "--kv-cache-dtype", "int8"], "kv cache dtype 'int8'"),
    (["--model", "{tmp}/model", "--capacity", "8KiB"], "holds no 12288-byte block"),
    (["--capacity", "lots"], "is not a size"),
    (["--data-planes", "-1"], "--data-planes must be 0 to 64"),
    (["--data-planes", "100000"], "--data-planes must be 0 to 64"),
    (["--block-tokens", "abc"], "--block-tokens: invalid int value"),
    (["--no-such-flag"], "unrecognized arguments"),
])
def test_bad_input_exits_2_with_one_line_before_starting_anything(tmp_path, capsys, argv, message) -> None:
    _model(tmp_path)
    (tmp_path / "no-config").mkdir()
    _model(tmp_path, "{oops", "broken")
    _model(tmp_path, {**SHAPE, "hidden_size": 192}, "bad-head")
    line = _refused([a.format(tmp=tmp_path) for a in argv] + ["--workdir", str(tmp_path / "work")], capsys)
    assert message in line, line
    assert not (tmp_path / "work").exists()  # nothing was started


def test_model_sizes_the_slots_and_the_engine_hint(tmp_path) -> None:
    """--model: 3 layers x 1 KV head x 32 x 2 bytes (float32 served as bfloat16 on CPU) x 2 x 64 tokens = 24,576."""
    model = _model(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh_apps.cli", "up", "--data-planes", "1", "--json",
                             "--model", str(model), "--block-tokens", "64", "--capacity", "1MiB",
                             "--workdir", str(tmp_path / "work")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        info = json.loads(proc.stdout.readline())
        assert (info["block_bytes"], info["block_tokens"], info["capacity_bytes"]) == (24576, 64, 1 << 20)
        assert (info["model"], info["dtype"], info["kv_cache_dtype"]) == (str(model), "bfloat16", "auto")
        (node, address), = info["data_planes"].items()

        async def describe():
            key = Path(info["node_key_files"][node]).read_text().strip()
            async with DataPlaneClient(address, key=key, tls=admin_tls(info, node)) as client:
                return await client.describe_tier()

        tier = asyncio.run(describe())
        assert (tier.block_bytes, tier.block_tokens, tier.num_slots) == (24576, 64, (1 << 20) // 24576)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_printed_engine_line_names_the_model_dtype_and_block_size(tmp_path) -> None:
    """The ``vllm serve`` line of the human output (formatted without starting a fleet)."""
    model = _model(tmp_path)
    args = up._parser().parse_args(["--model", str(model), "--block-tokens", "64"])
    slots = up.resolve_slots(args)
    info = {"data_planes": {"dp1": "127.0.0.1:1"}, "node_key_files": {"dp1": "k"}, "control_plane": "127.0.0.1:2",
            "tenant": "t", "tls": None}
    hint = up.engine_hint(slots, info, "dp1")
    assert hint.startswith(f"python -m vllm.entrypoints.openai.api_server --model {model} --dtype bfloat16 --block-size 64 --kv-transfer-config ")
    extra = json.loads(shlex.split(hint)[-1])["kv_connector_extra_config"]
    assert extra == {"data_plane_address": "127.0.0.1:1", "api_key_file": "k", "control_plane_address": "127.0.0.1:2",
                     "tenant": "t", "auto_source": True}
    info["tls"] = {"ca_file": "/w/tls/ca.crt", "control_plane_name": "control-plane",
                   "engines": {"dp1": {"cert_file": "/w/e.crt", "key_file": "/w/e.key"}}}
    extra = json.loads(shlex.split(up.engine_hint(slots, info, "dp1"))[-1])["kv_connector_extra_config"]
    assert (extra["tls_ca_file"], extra["tls_cert_file"], extra["tls_key_file"]) == (
        "/w/tls/ca.crt", "/w/e.crt", "/w/e.key")
    # the names the engine checks in its servers' certificates: no other certificate of the CA answers as them
    assert (extra["data_plane_tls_name"], extra["control_plane_tls_name"]) == ("dp1", "control-plane")
    kv = up._parser().parse_args(["--model", str(model), "--dtype", "float32", "--kv-cache-dtype", "fp8"])
    assert up.resolve_slots(kv).engine_flags() == " --dtype float32 --kv-cache-dtype fp8"
    assert up.resolve_slots(kv).block_bytes == 2 * 3 * 32 * 1 * 32  # one byte per element
    # found in review: a GPU engine's (or CPU latent attention's) 16-token blocks were refused, although the
    # connector's startup error named this very command; without --model any --block-size is taken
    sixteen = up.resolve_slots(up._parser().parse_args(["--block-bytes", "36864", "--block-tokens", "16"]))
    assert (sixteen.block_bytes, sixteen.block_tokens) == (36864, 16)
    plain = up.resolve_slots(up._parser().parse_args(["--block-bytes", "4096", "--block-tokens", "96"]))
    assert (plain.block_bytes, plain.block_tokens, plain.engine_flags()) == (4096, 96, "")
