"""`kvmesh up`: starts the local topology, every service answers gRPC health, Ctrl-C stops it all; slot sizes
from --model or --block-bytes, bad input refused with one line and exit status 2."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from data_plane.client import DataPlaneClient
from kvmesh_apps import up


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_up_starts_serves_and_stops(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh_apps.cli", "up", "--data-planes", "1", "--json",
                             "--workdir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        info = json.loads(line)
        assert serving(info["control_plane"])
        for address in info["data_planes"].values():
            assert serving(address)
        assert Path(info["admin_key_file"]).read_text().startswith("kvm_")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        assert list((tmp_path / "redis").glob("appendonly*"))  # Redis ran with AOF in the workdir
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


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
    code = up.main(argv)
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
    (["--block-tokens", "0"], "positive multiple of 32"),
    (["--block-bytes", "0"], "--block-bytes must be a positive"),
    (["--block-bytes", "-5"], "--block-bytes must be a positive"),
    (["--model", "{tmp}/model", "--block-bytes", "4096"], "contradicts --model: its 32-token blocks are 12288"),
    (["--dtype", "float32"], "give --model too"),
    (["--model", "{tmp}/model", "--dtype", "int8"], "dtype 'int8'"),
    (["--model", "{tmp}/model", "--kv-cache-dtype", "int8"], "kv cache dtype 'int8'"),
    (["--model", "{tmp}/model", "--capacity", "8KiB"], "holds no 12288-byte block"),
    (["--capacity", "lots"], "is not a size"),
    (["--data-planes", "-1"], "--data-planes must be 0 or more"),
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
            async with DataPlaneClient(address, key=key) as client:
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
    hint = up.ENGINE_HINT.format(model=slots.model, dtype=slots.engine_flags(), block_tokens=slots.block_tokens,
                                 address="127.0.0.1:1", key_file="k", cp="127.0.0.1:2", tenant="t")
    assert hint.startswith(f"vllm serve {model} --dtype bfloat16 --block-size 64 --kv-transfer-config ")
    kv = up._parser().parse_args(["--model", str(model), "--dtype", "float32", "--kv-cache-dtype", "fp8"])
    assert up.resolve_slots(kv).engine_flags() == " --dtype float32 --kv-cache-dtype fp8"
    assert up.resolve_slots(kv).block_bytes == 2 * 3 * 32 * 1 * 32  # one byte per element
    plain = up.resolve_slots(up._parser().parse_args(["--block-bytes", "4096", "--block-tokens", "96"]))
    assert (plain.block_bytes, plain.block_tokens, plain.engine_flags()) == (4096, 96, "")
