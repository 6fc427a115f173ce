"""Runs one vLLM engine through a scripted list of steps; the tests start it as a subprocess.

Usage: ``python engine_driver.py SPEC.json RESULT.json`` with the repository root on
``PYTHONPATH``. SPEC::

    {"model": DIR, "connector": null | {"store_path": DIR, "store_slots": N, "kv_role": ROLE},
     "enable_prefix_caching": BOOL,
     "steps": [{"op": "generate", "name": NAME, "prompt": [IDS], "max_tokens": N,
                "kv_transfer_params": {...} | null},
               {"op": "corrupt_store"}]}

RESULT: ``{"engine_start_s": S, "outputs": {NAME: {"token_ids", "num_cached_tokens",
"kv_transfer_params", "elapsed_s"}}}``. ``corrupt_store`` zero-fills the store's data file
in place and leaves its index alone, so every indexed block fails its integrity check.
A separate process per engine keeps vLLM's worker processes and global state out of pytest.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32


def _build_llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    connector = spec.get("connector")
    kv_transfer_config = None
    if connector is not None:
        kv_transfer_config = KVTransferConfig(
            kv_connector="KvmeshConnector",
            kv_connector_module_path="engine_connector.connector",
            kv_role=connector.get("kv_role", "kv_both"),
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "store_path": connector["store_path"],
                "store_slots": connector.get("store_slots", 1024),
            },
        )
    return LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=4096,
        max_num_seqs=4,
        seed=0,
        enable_prefix_caching=spec.get("enable_prefix_caching", True),
        prefix_caching_hash_algo="sha256_cbor",
        kv_transfer_config=kv_transfer_config,
    )


def _zero_fill(path: Path) -> None:
    size = path.stat().st_size
    chunk = bytes(1 << 20)
    with path.open("r+b") as f:
        for offset in range(0, size, len(chunk)):
            f.write(chunk[: min(len(chunk), size - offset)])


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    from engine_connector.block_store import ShmBlockStore

    started = time.perf_counter()
    llm = _build_llm(spec)
    result: dict[str, Any] = {"engine_start_s": time.perf_counter() - started, "outputs": {}}
    for step in spec["steps"]:
        if step["op"] == "corrupt_store":
            _zero_fill(Path(spec["connector"]["store_path"]) / ShmBlockStore.DATA_FILE)
            continue
        params = SamplingParams(
            max_tokens=step["max_tokens"],
            temperature=0.0,
            ignore_eos=True,
            extra_args={"kv_transfer_params": step.get("kv_transfer_params") or {}},
        )
        started = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": step["prompt"]}], params, use_tqdm=False)
        result["outputs"][step["name"]] = {
            "token_ids": list(out.outputs[0].token_ids),
            "num_cached_tokens": out.num_cached_tokens,
            "kv_transfer_params": out.kv_transfer_params,
            "elapsed_s": time.perf_counter() - started,
        }
    return result


def main(argv: list[str]) -> None:
    spec_path, result_path = argv
    result = run(json.loads(Path(spec_path).read_text()))
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
