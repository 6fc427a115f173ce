"""Fixtures for the engine-connector tests: a tiny model, a /dev/shm store, engine subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvmesh.tiny_model import build_tiny_llama

REPO_ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).resolve().with_name("engine_driver.py")
ENGINE_TIMEOUT_S = 300

_LOGGING_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s"}},
    "handlers": {"stdout": {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stdout"}},
    "loggers": {
        name: {"handlers": ["stdout"], "level": "INFO", "propagate": False} for name in ("vllm", "engine_connector")
    },
}

EngineRunner = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="module")
def shm_store_path() -> Iterator[Path]:
    """A fresh directory in /dev/shm for a module's block store, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="kvmesh-engine-connector-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def run_engines(tmp_path_factory: pytest.TempPathFactory) -> EngineRunner:
    """Run engine specs (see ``engine_driver``) in parallel subprocesses; return their results.

    Keep at most two specs per call: each engine wants ~3 GiB and both CPU cores.
    """
    work = tmp_path_factory.mktemp("vllm")
    env = dict(
        os.environ,
        VLLM_CACHE_ROOT=str(work / "cache"),
        TORCHINDUCTOR_CACHE_DIR=str(work / "inductor"),
        VLLM_RPC_BASE_PATH=str(work / "rpc"),
        VLLM_NO_USAGE_STATS="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        # The driver and vLLM's spawned workers import engine_connector from the checkout.
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p),
    )
    (work / "rpc").mkdir()
    # vLLM applies this in every process it starts, so engine.log shows the connector's logs.
    (work / "logging.json").write_text(json.dumps(_LOGGING_CONFIG))
    env["VLLM_LOGGING_CONFIG_PATH"] = str(work / "logging.json")
    runs = iter(range(1_000_000))

    def run(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        procs = []
        for spec in specs:
            run_dir = work / f"run-{next(runs)}"
            run_dir.mkdir()
            (run_dir / "spec.json").write_text(json.dumps(spec))
            log = (run_dir / "engine.log").open("w")
            cmd = [sys.executable, str(DRIVER), "spec.json", "result.json"]
            procs.append((run_dir, log, subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT)))
        results = []
        for run_dir, log, proc in procs:
            try:
                rc = proc.wait(timeout=ENGINE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
            log.close()
            if rc != 0:
                tail = (run_dir / "engine.log").read_text()[-4000:]
                pytest.fail(f"engine in {run_dir} exited with {rc}:\n{tail}")
            results.append(json.loads((run_dir / "result.json").read_text()))
        return results

    return run
