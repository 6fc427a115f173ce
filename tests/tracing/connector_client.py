"""A stand-in engine (and, for the prefetch test, its scheduler) for the tracing tests, in one child process that
owns its TracerProvider.

``python connector_client.py ARGS_JSON``: configures tracing from the environment under ``args["service"]``, builds
the connector's NodeLink + SchedulerSide for the given node and asks how many tokens of a prompt (given as block
hashes) it can load, with ``args["kv_transfer_params"]``; or, when ``args`` names a ``scheduler_key``, first
routes the prompt to the engine on dp2 with ``SchedulerClient`` (prefetch on: the order goes to dp2) and asks with
the ``kv_transfer_params`` Route returned, as the engine would. Prints one JSON line:
``{"prefetch_status": ... (routed only), "matched_tokens": N, "report": {...}}``.
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
    tracing.configure(args["service"])
    config = ConnectorConfig.from_extra_config(args["connector"])
    ns = Namespace(config.tenant, "tiny", "rev1", CacheConfig(block_size=BS, kv_dtype="float32",
                                                              kv_layout=KV_LAYOUT)).validate()
    hashes = [bytes.fromhex(h) for h in args["hashes"]]
    out: dict = {}
    if "scheduler_key" in args:
        decision = asyncio.run(route(args, ns, hashes))
        out["prefetch_status"], params = decision.prefetch_status, decision.kv_transfer_params()
    else:
        params = args["kv_transfer_params"]
    link = NodeLink(config.data_plane_address, config.key(), config.control_plane_address,  # as the connector does
                    tls=config.tls(config.data_plane_tls_name),
                    control_plane_tls=config.tls(config.control_plane_tls_name))
    side = SchedulerSide(link, ns, config, BS, can_load=True, can_save=True)
    side.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda req_id: (list(range(1000)),)))
    request = Request(args["request_id"], hashes, params)
    # The scheduler side answers None while its background lookup and pull run; vLLM asks each step.
    deadline = time.monotonic() + 30
    while (matched := side.num_new_matched_tokens(request, 0)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    out["matched_tokens"], out["report"] = matched, side.finished(request)[1]["kvmesh"]
    link.close()
    tracing.shutdown()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
