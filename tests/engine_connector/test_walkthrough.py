"""docs/engine_connector.md's walkthrough and docs/scheduling.md's quick start, run as written.

The walkthrough's shell blocks run in one ``bash`` (``set -euo pipefail``): a tiny model, ``kvmesh up --model``,
two ``vllm serve`` processes started with the lines ``kvmesh up`` printed (read from its output, never typed in
here), a prompt computed on engine 1 and pulled by engine 2 with ``remote_kv_source``, one computed on engine 2
and pulled by engine 1 through ``auto_source``, and the engines' ``/metrics``. Its last block (stop everything)
runs at the end. The scheduler quick start (docs/scheduling.md: a scheduler key issued with ``kvmesh admin``,
``SchedulerClient.namespace_for``, ``lookup_prefix``, ``route``, the request sent where Route said) and
docs/api.md's stub example run against the same fleet and engines; negative control: the namespace a user
would build from the documented fields alone, or with one flag off, finds no holder.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvmesh.channels import ClientTLS
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh_apps.redis_server import free_port

from control_plane.scheduler_client import SchedulerClient
from tests.doc_blocks import doc_block
from tests.engine_connector.serve import metrics, process_env, stop_group, tail

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.nixl, pytest.mark.timeout(1500)]


WALKTHROUGH = [doc_block(block) for block in ("walkthrough-fleet", "walkthrough-engines",
                                               "walkthrough-remote-kv-source", "walkthrough-auto-source",
                                               "walkthrough-metrics")]
STOP = doc_block("walkthrough-stop")


@dataclass
class Walk:
    dir: Path
    env: dict[str, str]
    output: str
    url1: str
    url2: str

    def json(self, name: str) -> dict:
        return json.loads((self.dir / name).read_text())

    def line(self, first_word: str) -> list[str]:
        return next(line.split() for line in (self.dir / "up.txt").read_text().splitlines()
                    if line.split()[:1] == [first_word])

    def bash(self, script: str, timeout: float = 600) -> str:
        done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], cwd=self.dir, env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{script}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
        return done.stdout


@pytest.fixture(scope="module")
def walk(tmp_path_factory) -> Walk:
    work = tmp_path_factory.mktemp("walkthrough")
    port1, port2 = free_port(), free_port()
    env = process_env(work, DIR=str(work), PORT1=str(port1), PORT2=str(port2))
    proc = subprocess.Popen(["bash", "-c", "set -euo pipefail\n" + "\n".join(WALKTHROUGH)], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        try:
            output, _ = proc.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        logs = "\n".join(f"--- {name}\n{tail(work / name)}" for name in ("up.txt", "engine1.log", "engine2.log"))
        assert proc.returncode == 0, f"the walkthrough failed ({proc.returncode}):\n{output}\n{logs}"
        yield Walk(work, env, output, f"http://127.0.0.1:{port1}", f"http://127.0.0.1:{port2}")
        subprocess.run(["bash", "-c", STOP], cwd=work, env=env, timeout=60)  # the walkthrough's own last step
    finally:
        stop_group(proc)


def report(answer: dict) -> dict:
    return answer["kv_transfer_params"]["kvmesh"]


def test_remote_kv_source_pulls_the_prefix(walk):
    computed, pulled = report(walk.json("computed.json")), report(walk.json("pulled.json"))
    assert computed["peer_tokens"] == 0 and computed["stored_blocks"] >= 9, computed
    assert pulled["outcome"] == "pulled" and pulled["source"] == "dp1", pulled
    assert pulled["peer_tokens"] >= 9 * 32 and pulled["bytes_pulled"] == pulled["peer_tokens"] * 1024, pulled
    assert "KvmeshConnector: blocks of namespace" in walk.output


def test_auto_source_pulls_from_the_holder(walk):
    auto = report(walk.json("auto.json"))
    assert auto["outcome"] == "pulled" and auto["source"] == "dp2" and auto["peer_tokens"] >= 9 * 32, auto


def test_pulls_show_in_the_engines_metrics(walk):
    assert "vllm:kvmesh_" in walk.output  # step 5 printed them
    expected = {walk.url2: report(walk.json("pulled.json"))["peer_tokens"],
                walk.url1: report(walk.json("auto.json"))["peer_tokens"]}
    for url, tokens in expected.items():
        deadline, peer = time.monotonic() + 30, 0.0
        while peer < tokens and time.monotonic() < deadline:
            peer = sum(v for k, v in metrics(url, "vllm:kvmesh_loaded_tokens_total").items() if 'tier="peer"' in k)
            time.sleep(1)
        assert peer == tokens, f"{url}: {peer} peer tokens in /metrics, the pull reported {tokens}"
        pulled_bytes = sum(metrics(url, "vllm:kvmesh_pulled_bytes_total").values())
        assert pulled_bytes == tokens * 1024, pulled_bytes


def test_scheduler_quick_start_routes_a_pull(walk):
    (walk.dir / "route_and_pull.py").write_text(doc_block("scheduler-route-and-pull"))
    out = walk.bash(doc_block("scheduler-quick-start"))
    (walk.dir / "quick-start.out").write_text(out)
    assert re.search(r"^holders \{'dp1': 32\}$", out, re.M), out
    assert re.search(r"^route engine-2 PULL \{'remote_kv_source'", out, re.M), out
    assert re.search(r"^engine engine-2 pulled from dp1 (\d+) tokens$", out, re.M), out

    # The same key and prompt: the documented way finds dp1; the fields alone (the doc's old way) and one
    # flag off find nothing.
    cp, key = walk.line("control")[2], (walk.dir / "scheduler.key").read_text().strip()
    model = str(walk.dir / "tiny-llama")
    prompt = list(range(1000, 2024))

    async def holders(ns) -> dict[str, int]:
        async with SchedulerClient(cp, ns, api_key=key, tls=tls) as client:
            return {h.node_id: h.leading_blocks for h in (await client.lookup_prefix(token_ids=prompt)).holders}

    tls_dir = walk.dir / "fleet" / "tls"
    tls = ClientTLS(str(tls_dir / "ca.crt"), str(tls_dir / "admin.crt"), str(tls_dir / "admin.key"))
    right = SchedulerClient.namespace_for(model, tenant="demo", block_size=32, kv_dtype="bfloat16")
    assert asyncio.run(holders(right.to_proto()))["dp1"] == 32  # the proto form is taken too
    for wrong in (Namespace("demo", model, "", CacheConfig(block_size=32, kv_dtype="bfloat16")),
                  SchedulerClient.namespace_for(model, tenant="demo", block_size=32, kv_dtype="float32")):
        assert asyncio.run(holders(wrong)) == {}

    # docs/api.md's example with the generated stub, the same key and namespace rule.
    (walk.dir / "lookup.py").write_text(doc_block("api-lookup-prefix"))
    out = walk.bash(f"python lookup.py {cp} scheduler.key {model} {walk.dir / 'fleet' / 'tls'}", timeout=60)
    # dp1 computed the prompt; dp2 holds it since engine 2 pulled it (31 blocks) and computed the last one
    assert {line.split()[0]: int(line.split()[2]) for line in out.splitlines()} == {"dp1": 32, "dp2": 32}, out
