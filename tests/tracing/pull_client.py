"""A stand-in engine for the tracing test: the connector's scheduler side asks for one prompt.

``python pull_client.py ARGS_JSON`` (a child process, so it owns its TracerProvider): configures
tracing from the environment, builds the connector's NodeLink + SchedulerSide for the given node
and asks how many tokens of a prompt (given as block hashes) it can load from the named source.
Prints one JSON line: ``{"matched_tokens": N, "report": {...}}``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from kvmesh import tracing
from kvmesh.namespace import CacheConfig, Namespace

from engine_connector.config import KV_LAYOUT, ConnectorConfig
from engine_connector.node_link import NodeLink
from engine_connector.scheduler_side import SchedulerSide

BS = 32


@dataclass
class Request:
    request_id: str
    block_hashes: list[bytes]
    kv_transfer_params: dict
    num_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_tokens = len(self.block_hashes) * BS + 1


def main(args: dict) -> None:
    tracing.configure("kvmesh-engine-connector")
    config = ConnectorConfig.from_extra_config(args["connector"])
    ns = Namespace(config.tenant, "tiny", "rev1", CacheConfig(block_size=BS, kv_dtype="float32",
                                                              kv_layout=KV_LAYOUT)).validate()
    link = NodeLink(config.data_plane_address, config.key(), config.control_plane_address, tls=config.tls())
    side = SchedulerSide(link, ns, config, BS, can_load=True, can_save=True)
    side.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda req_id: (list(range(1000)),)))
    request = Request("traced-1", [bytes.fromhex(h) for h in args["hashes"]], args["kv_transfer_params"])
    deadline = time.monotonic() + 30
    # The scheduler side answers None while its background lookup and pull run; vLLM asks each step.
    while (matched := side.num_new_matched_tokens(request, 0)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    report = side.finished(request)[1]["kvmesh"]
    link.close()
    tracing.shutdown()
    print(json.dumps({"matched_tokens": matched, "report": report}), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
