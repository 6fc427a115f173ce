"""A stand-in scheduler and engine for the prefetch tracing test, in one child process (it owns its TracerProvider).

``python prefetch_client.py ARGS_JSON``: routes a prompt (given as block hashes) to the engine on dp2 with
``SchedulerClient`` (prefetch on: the order goes to dp2), then has the connector's scheduler side ask for it with
the ``kv_transfer_params`` Route returned, as the engine would. Prints one JSON line:
``{"prefetch_status": ..., "matched_tokens": N, "report": {...}}``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from kvmesh import tracing
from kvmesh.channels import ClientTLS
from kvmesh.namespace import CacheConfig, Namespace

from control_plane.scheduler_client import Candidate, Policy, SchedulerClient
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


async def route(args: dict, ns: Namespace, hashes: list[bytes]):
    tls = ClientTLS(*args["scheduler_tls"])
    async with SchedulerClient(args["control_plane"], ns, api_key=args["scheduler_key"], tls=tls) as client:
        return await client.route([Candidate("dp2", "dp2")], block_hashes=hashes, policy=Policy.LOAD_AWARE,
                                  min_cached_token_delta=BS)


def main(args: dict) -> None:
    tracing.configure("kvmesh-scheduler")
    config = ConnectorConfig.from_extra_config(args["connector"])
    ns = Namespace(config.tenant, "tiny", "rev1", CacheConfig(block_size=BS, kv_dtype="float32",
                                                              kv_layout=KV_LAYOUT)).validate()
    hashes = [bytes.fromhex(h) for h in args["hashes"]]
    decision = asyncio.run(route(args, ns, hashes))
    link = NodeLink(config.data_plane_address, config.key(), config.control_plane_address, tls=config.tls())
    side = SchedulerSide(link, ns, config, BS, can_load=True, can_save=True)
    side.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda req_id: (list(range(1000)),)))
    request = Request("prefetched-1", hashes, decision.kv_transfer_params())
    deadline = time.monotonic() + 30
    while (matched := side.num_new_matched_tokens(request, 0)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    report = side.finished(request)[1]["kvmesh"]
    link.close()
    tracing.shutdown()
    print(json.dumps({"prefetch_status": decision.prefetch_status, "matched_tokens": matched, "report": report}),
          flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
