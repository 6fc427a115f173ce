"""One vLLM engine (CPU build) in a child process, driven over stdin/stdout, for the local fleet.

``python -m kvmesh_apps.engine_host SPEC_JSON`` builds ``vllm.LLM`` from the spec, then answers one
JSON request per stdin line with one stdout line prefixed ``kvmesh-engine ``. vLLM logs go to
the same stdout; :class:`EngineProcess` keeps the prefixed lines and writes the rest to the log.

Spec: ``{"model": DIR, "connector": EXTRA_CONFIG | null, "enable_prefix_caching": bool,
"max_model_len": N, "block_size": 32, "dtype": "float32", "max_num_seqs": 4}`` (``dtype`` is vLLM's
``--dtype``: ``auto`` serves a float32 checkpoint in bfloat16 on CPU, kvmesh_apps.kv_shape).
Requests (one JSON object per line):

* ``{"op": "generate", "prompt": [ids], "max_tokens": N, "kv_transfer_params": {...}, "logprobs": K,
  "reset_prefix_cache": bool}`` -> ``{"token_ids", "logprobs", "num_cached_tokens",
  "kv_transfer_params", "elapsed_s", "ttft_s"}``; ``logprobs`` (with K > 0) is, per generated token,
  ``[[token_id, logprob], ...]`` for the top K (and the sampled token);
* ``{"op": "concurrent", "requests": [{"id", "prompt", "max_tokens", "kv_transfer_params", "logprobs",
  "at_s"}]}``: drives the engine step by step, adding each request ``at_s`` seconds after the
  start, and answers ``{"requests": {id: {"token_ids", "logprobs", "token_times", "added_s",
  "kv_transfer_params", "num_cached_tokens"}}}`` (times in seconds from the start): running requests keep decoding
  while later ones wait for their KV;
* ``{"op": "metrics", "prefix": "vllm:"}`` -> ``{"metrics": {name{labels}: value}}`` (vLLM's own
  metrics snapshot, counters and gauges);
* ``{"op": "ping"}``. EOF ends the process.

Prompts are token ids (the tiny models have no tokenizer).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from queue import Empty, Queue
from typing import Any

PREFIX = "kvmesh-engine "
BLOCK_SIZE = 32
# float32 keeps greedy outputs and logprobs identical across batch shapes (docs/engine_connector.md).
DTYPE = "float32"


def _build_llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig
    from vllm.plugins import load_general_plugins

    # KVTransferConfig checks the connector name when built, before LLM() would load the plugins
    # (the kvmesh plugin registers KvmeshConnector; `vllm serve` loads them while parsing args).
    load_general_plugins()
    extra = spec.get("connector")
    kv_transfer_config = None
    if extra is not None:
        # Found by name through the kvmesh vLLM plugin (engine_connector.plugin).
        kv_transfer_config = KVTransferConfig(kv_connector="KvmeshConnector", kv_role="kv_both",
                                              kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    return LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=spec.get("dtype", DTYPE),
        block_size=spec.get("block_size", BLOCK_SIZE),
        max_model_len=spec.get("max_model_len", 4096),
        max_num_seqs=spec.get("max_num_seqs", 4),
        seed=0,
        enable_prefix_caching=spec.get("enable_prefix_caching", True),
        prefix_caching_hash_algo="sha256_cbor",
        kv_transfer_config=kv_transfer_config,
        disable_log_stats=False,  # RequestOutput.metrics: time to first token
    )


def _sampling_params(request: dict[str, Any]) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=request.get("max_tokens", 8), temperature=0.0, ignore_eos=True,
                          logprobs=request.get("logprobs") or None,
                          extra_args={"kv_transfer_params": request.get("kv_transfer_params") or {}})


def _logprobs(completion: Any) -> list[list[list[float]]] | None:
    if completion.logprobs is None:
        return None
    return [[[token_id, float(lp.logprob)] for token_id, lp in step.items()] for step in completion.logprobs]


def _generate(llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    params = _sampling_params(request)
    if request.get("reset_prefix_cache"):
        llm.reset_prefix_cache()  # a cold engine: nothing of the prompt is cached locally
    started = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": request["prompt"]}], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    metrics = getattr(out, "metrics", None)
    ttft = getattr(metrics, "first_token_latency", 0.0) or elapsed
    return {"token_ids": list(out.outputs[0].token_ids), "logprobs": _logprobs(out.outputs[0]),
            "num_cached_tokens": out.num_cached_tokens, "kv_transfer_params": out.kv_transfer_params,
            "elapsed_s": elapsed, "ttft_s": ttft}


def _concurrent(llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    engine = llm.llm_engine
    todo = sorted(request["requests"], key=lambda r: r.get("at_s", 0.0))
    results: dict[str, dict[str, Any]] = {}
    names: dict[str, str] = {}  # vLLM's internal request id -> ours
    started = time.perf_counter()
    while todo or engine.has_unfinished_requests():
        now = time.perf_counter() - started
        while todo and todo[0].get("at_s", 0.0) <= now:
            r = todo.pop(0)
            internal = engine.add_request(r["id"], {"prompt_token_ids": r["prompt"]}, _sampling_params(r))
            names[internal] = r["id"]
            results[r["id"]] = {"added_s": now, "token_times": [], "token_ids": [], "logprobs": None,
                                "kv_transfer_params": None}
        if not engine.has_unfinished_requests():
            time.sleep(min(0.005, max(0.0, todo[0].get("at_s", 0.0) - now)))
            continue
        for out in engine.step():
            result = results[names.get(out.request_id, out.request_id)]
            completion = out.outputs[0]
            now = time.perf_counter() - started
            result["token_times"] += [now] * (len(completion.token_ids) - len(result["token_ids"]))
            result["token_ids"] = list(completion.token_ids)
            if out.finished:
                result["logprobs"] = _logprobs(completion)
                result["kv_transfer_params"] = out.kv_transfer_params
                result["num_cached_tokens"] = out.num_cached_tokens
    return {"requests": results}


def _metrics(llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    prefix = request.get("prefix", "vllm:")
    values: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith(prefix) and hasattr(metric, "value") and isinstance(metric.value, (int, float)):
            labels = ",".join(f"{k}={v}" for k, v in sorted(metric.labels.items()) if k not in ("engine",
                                                                                                    "model_name"))
            values[f"{metric.name}{{{labels}}}"] = float(metric.value)
    return {"metrics": values}


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    started = time.perf_counter()
    llm = _build_llm(spec)
    _reply({"ready": True, "start_s": time.perf_counter() - started})
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "generate":
                _reply(_generate(llm, request))
            elif request["op"] == "concurrent":
                _reply(_concurrent(llm, request))
            elif request["op"] == "metrics":
                _reply(_metrics(llm, request))
            else:
                _reply({"pong": True})
        except Exception as exc:  # noqa: BLE001 - report it to the parent, keep serving
            _reply({"error": f"{type(exc).__name__}: {exc}"})
    return 0


class EngineError(RuntimeError):
    pass


class EngineProcess:
    """The parent's handle on an engine child: start, send requests, stop. One request at a time."""

    def __init__(self, name: str, spec: dict[str, Any], env: dict[str, str], log_path: Path,
                 prefix: list[str] | None = None) -> None:
        """``prefix``: a command the child runs under (e.g. ``ip netns exec NS``: a host of :mod:`netns`)."""
        self.name = name
        self._prefix = list(prefix or [])
        self.spec = spec
        self.log_path = log_path
        self.start_s = 0.0
        self._env = env
        self._proc: subprocess.Popen | None = None
        self._replies: Queue = Queue()

    def start(self) -> "EngineProcess":
        """Launch the child (returns at once; :meth:`wait_ready` waits for the engine)."""
        self._proc = subprocess.Popen([*self._prefix, sys.executable, "-m", "kvmesh_apps.engine_host",
                                       json.dumps(self.spec)],
                                      env={**os.environ, **self._env, "PYTHONUNBUFFERED": "1"},
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)
        threading.Thread(target=self._pump, daemon=True, name=f"engine-{self.name}").start()
        return self

    def _pump(self) -> None:
        with open(self.log_path, "a", encoding="utf-8") as log:
            for line in self._proc.stdout:
                if line.startswith(PREFIX):
                    self._replies.put(json.loads(line[len(PREFIX):]))
                else:
                    log.write(line)
                    log.flush()
        self._replies.put(None)

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            reply = self._replies.get(timeout=timeout)
        except Empty:
            raise EngineError(f"engine {self.name}: no answer in {timeout:.0f} s (log: {self.log_path})") from None
        if reply is None:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise EngineError(f"engine {self.name} exited:\n{tail}")
        if "error" in reply:
            raise EngineError(f"engine {self.name}: {reply['error']}")
        return reply

    def wait_ready(self, timeout: float = 300.0) -> "EngineProcess":
        self.start_s = self._next(timeout)["start_s"]
        return self

    def generate(self, prompt: list[int], max_tokens: int = 8, kv_transfer_params: dict | None = None,
                 reset_prefix_cache: bool = False, logprobs: int = 0, timeout: float = 300.0) -> dict[str, Any]:
        return self.ask({"op": "generate", "prompt": prompt, "max_tokens": max_tokens,
                         "kv_transfer_params": kv_transfer_params, "reset_prefix_cache": reset_prefix_cache,
                         "logprobs": logprobs}, timeout)

    def concurrent(self, requests: list[dict[str, Any]], timeout: float = 300.0) -> dict[str, dict[str, Any]]:
        """Run ``requests`` together (each added ``at_s`` after the start); per request id, its result."""
        return self.ask({"op": "concurrent", "requests": requests}, timeout)["requests"]

    def metrics(self, prefix: str = "vllm:") -> dict[str, float]:
        return self.ask({"op": "metrics", "prefix": prefix})["metrics"]

    def ask(self, request: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        return self._next(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        try:
            self._proc.stdin.close()
            self._proc.wait(timeout)
        except (subprocess.TimeoutExpired, OSError):
            self._proc.kill()
            self._proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
