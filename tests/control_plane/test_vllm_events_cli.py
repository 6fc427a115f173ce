"""``kvmesh vllm-events`` as a process: it authenticates with a node key file, fills the block map under the
engine's namespace, and every error it can meet at start is one line and exit status 2, never a retry loop.

(tests/engine_connector/test_stock_vllm_events.py feeds it from a real ``vllm serve``.)"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from pathlib import Path

import pytest

vllm_events = pytest.importorskip("vllm.distributed.kv_events", reason="needs vLLM")

from kvmesh.hashing import BlockHasher, HashAlgo  # noqa: E402
from kvmesh.namespace import engine_namespace  # noqa: E402

from control_plane.model import ALL_TIERS  # noqa: E402
from control_plane.vllm_events import _parser  # noqa: E402
from tenancy.model import Role  # noqa: E402

ROOT = Path(__file__).parent.parent.parent
TOKENS = list(range(7000, 7000 + 32 * 4))
NS_FLAGS = ["--model", "tiny", "--block-size", "32", "--kv-dtype", "bfloat16", "--tenant", "acme"]


def cli(control_plane, key_file, node_id="engine-1", zmq="tcp://127.0.0.1:1", *extra):
    return ["--zmq", zmq, "--control-plane", f"127.0.0.1:{control_plane.port}", "--api-key-file", str(key_file),
            "--node-id", node_id, "--data-plane-address", "127.0.0.1:7001", *NS_FLAGS, *extra]


async def run(args, timeout=30.0) -> tuple[int, list[str], float]:
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "kvmesh_apps.cli", "vllm-events", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    return proc.returncode, out.decode().splitlines(), time.monotonic() - started


async def node_key(control_plane, tmp_path, node_id) -> Path:
    _, secret = await control_plane.core.tenants.issue_key(Role.NODE, node_id=node_id)
    path = tmp_path / f"{node_id}.key"
    path.write_text(secret + "\n")
    return path


async def test_refused_keys_are_one_line_and_exit(control_plane, tmp_path):
    revoked = tmp_path / "unknown.key"
    revoked.write_text("kvm_0123456789abcdef_" + "x" * 43)
    for key_file, node, code in [(revoked, "engine-1", "UNAUTHENTICATED"),
                                 (await node_key(control_plane, tmp_path, "engine-2"), "engine-1",
                                  "PERMISSION_DENIED")]:  # a node key bound to another node
        rc, lines, took = await run(cli(control_plane, key_file, node))
        assert rc == 1 and len(lines) == 1, lines
        assert lines[0].startswith("kvmesh vllm-events: error: the control plane refused the key") and code in lines[0]
        assert took < 15, took  # no retry loop


@pytest.mark.parametrize("args, says", [
    ([], "the following arguments are required: --zmq, --control-plane, --api-key-file, --node-id, "
         "--data-plane-address, --model, --block-size, --kv-dtype"),
    (["--api-key-file", "/nonexistent/key"], "cannot read --api-key-file /nonexistent/key"),
    (["--block-size", "0"], "argument --block-size: must be a positive integer"),
    (["--block-size", "8192"], "block_size must be in 1..4096"),
    (["--control-plane", "127.0.0.1"], "argument --control-plane: must be host:port"),
    (["--hash-algo", "md5"], "argument --hash-algo: invalid choice"),
    (["--tls-ca-file", "/nonexistent/ca.pem"], "cannot read --tls-ca-file /nonexistent/ca.pem"),
])
async def test_bad_input_is_one_line(control_plane, tmp_path, args, says):
    key = await node_key(control_plane, tmp_path, "engine-1")
    rc, lines, _ = await run(args if not args else cli(control_plane, key) + args)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("kvmesh vllm-events: error: ") and says in lines[0], \
        lines


async def test_unreachable_control_plane_is_one_line(tmp_path):
    key = tmp_path / "k"
    key.write_text("kvm_0123456789abcdef_" + "x" * 43)
    rc, lines, took = await run(["--zmq", "tcp://127.0.0.1:1", "--control-plane", "127.0.0.1:1", "--api-key-file",
                                 str(key), "--node-id", "n", "--data-plane-address", "127.0.0.1:2", *NS_FLAGS])
    assert rc == 1 and len(lines) == 1 and "did not answer within 10 s" in lines[0], lines
    assert took < 20


async def test_node_key_feeds_the_engines_namespace(control_plane, tmp_path, admin):
    """The positive control of the refusals above: the same command with the node's own key populates the map,
    under exactly the namespace a scheduler derives with SchedulerClient.namespace_for."""
    key = await node_key(control_plane, tmp_path, "engine-1")
    endpoint = f"ipc://{tmp_path}/kv-events"
    ns = engine_namespace("tiny", block_size=32, kv_dtype="bfloat16", tenant="acme")
    hashes = BlockHasher(HashAlgo.SHA256).block_hashes(TOKENS, 32)
    publisher = vllm_events.ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvmesh_apps.cli", "vllm-events", *cli(control_plane, key, zmq=endpoint),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 30
        longest = 0
        while longest < 4:
            assert time.monotonic() < deadline and proc.returncode is None, "blocks never reached the map"
            publisher.publish(vllm_events.KVEventBatch(ts=0.0, events=[vllm_events.BlockStored(
                block_hashes=hashes, parent_block_hash=None, token_ids=TOKENS, block_size=32, lora_id=None,
                medium="GPU", lora_name=None)]))
            await asyncio.sleep(0.2)
            longest = (await control_plane.core.lookup_prefix(admin, ns, hashes, [], None, ALL_TIERS)).longest
    finally:
        publisher.shutdown()
        if proc.returncode is None:
            proc.terminate()
        out, _ = await asyncio.wait_for(proc.communicate(), 15)
    assert proc.returncode == 0, out.decode()
    assert "feeding " in out.decode() and "Traceback" not in out.decode()


def test_readme_names_every_required_flag():
    line = next(line for line in (ROOT / "README.md").read_text().splitlines() if "`kvmesh vllm-events " in line)
    required = [a.option_strings[0] for a in _parser()._actions if a.required]
    assert required
    missing = [flag for flag in required if not re.search(rf"{flag}\b", line)]
    assert not missing, f"README's vllm-events line lacks {missing}"


def test_the_kv_dtypes_taken_are_the_ones_the_connector_derives():
    """--kv-dtype takes what engine_connector/config.py derives from vLLM: --kv-cache-dtype (vLLM's CacheDType) unless
    auto, else the dtype served in. A vLLM that adds a cache dtype fails this until KV_DTYPES names it."""
    import typing

    from vllm.config.cache import CacheDType
    from vllm.config.model import _STR_DTYPE_TO_TORCH_DTYPE

    from control_plane.vllm_events import KV_DTYPES, kv_dtype

    served = {str(dtype).removeprefix("torch.") for dtype in _STR_DTYPE_TO_TORCH_DTYPE.values()}
    assert set(KV_DTYPES) == (set(typing.get_args(CacheDType)) - {"auto"}) | served
    assert {kv_dtype(name) for name in _STR_DTYPE_TO_TORCH_DTYPE} == served  # --dtype half, float, ...


@pytest.mark.parametrize("failure, says", [
    ("zmq.ZMQError(zmq.ETERM)", "reading vLLM's events from --zmq"),
    ("RuntimeError('a bug')", "internal error (RuntimeError: a bug)"),  # a bug: still one line, not lost
])
async def test_a_failure_reading_vllms_events_ends_the_command(control_plane, tmp_path, failure, says):
    """The subscription runs in a task beside the publisher: when it fails the command ends in one line (exit 1);
    it used to go on "feeding" nothing for ever. (The positive control, a subscription that works and keeps the
    command running: test_node_key_feeds_the_engines_namespace.)"""
    key = await node_key(control_plane, tmp_path, "engine-1")
    broken = ("import sys, zmq\nimport control_plane.vllm_events as v\nfrom kvmesh.command_line import run_command\n"
              f"async def consume(self, sock):\n    raise {failure}\n"
              "v.VllmEventAdapter.consume = consume\nsys.exit(run_command(v.PROG, v.main, sys.argv[1:]))\n")
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", broken, *cli(control_plane, key, zmq=f"ipc://{tmp_path}/kv-events"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    lines = err.decode().splitlines()
    errors = [line for line in lines if line.startswith("kvmesh vllm-events: error: ")]
    assert proc.returncode == 1 and errors == lines[-1:] and says in errors[0], lines
    assert "Traceback" not in err.decode() and time.monotonic() - started < 20
