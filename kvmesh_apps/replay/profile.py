"""The simulated model and fleet: what an engine computes, holds and moves.

The default is a 70B-class dense model (80 layers, 8 KV heads of 128, bf16:
327,680 KV bytes per token) served by 4-GPU replicas, in two racks: RDMA inside
a rack, an oversubscribed uplink between racks. The figures are assumptions,
printed with every result; change them with flags.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvmesh_apps.replay.trace import TRACE_BLOCK_TOKENS


@dataclass(frozen=True)
class Profile:
    name: str = "70B-class dense, bf16 KV, one 4-GPU replica per engine, 2 racks"
    prefill_tokens_per_s: float = 6_000.0
    kv_bytes_per_token: int = 327_680
    gpu_kv_blocks: int = 900           # ~150 GB of HBM for KV, in 512-token blocks
    cpu_tier_blocks: int = 3_200       # ~512 GiB of host memory per node
    intra_rack_bytes_per_s: float = 25e9
    inter_rack_bytes_per_s: float = 1.5e9
    promotion_bytes_per_s: float = 25e9
    lookup_ms: float = 1.0
    racks: int = 2
    block_tokens: int = TRACE_BLOCK_TOKENS

    def rack_of(self, engine: int, engines: int) -> int:
        return engine * self.racks // engines

    def link_bytes_per_s(self, source: int, dest: int, engines: int) -> float:
        same = self.rack_of(source, engines) == self.rack_of(dest, engines)
        return self.intra_rack_bytes_per_s if same else self.inter_rack_bytes_per_s

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.kv_bytes_per_token

    def as_dict(self) -> dict:
        return asdict(self)
