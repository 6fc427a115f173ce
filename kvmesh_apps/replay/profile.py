"""The simulated fleet: engines (see :mod:`costs` for the model), their memory, the network, the noise.

Defaults: 8 engines, each one 4-GPU H100 replica of Llama-2-70B (327,680 KV bytes
per token), in two racks. Each node has a 25 GB/s RDMA NIC; the racks share one
uplink (``inter_rack_bytes_per_s``) that every cross-rack pull crosses. The
figures are assumptions, printed with every result; flags change them.

KV memory (``gpu_kv_blocks``, ``cpu_tier_blocks``) is counted in 512-token blocks
(:data:`CAPACITY_BLOCK_TOKENS`) whatever ``block_tokens`` is: a trace of 16-token
blocks replays on engines of the same memory, holding 32 times as many blocks
(:attr:`Profile.gpu_blocks`: memory // block, as vLLM sizes its block pool).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvmesh_apps.replay.costs import KV_BYTES_PER_TOKEN
from kvmesh_apps.replay.trace import TRACE_BLOCK_TOKENS

CAPACITY_BLOCK_TOKENS = 512   # the unit of gpu_kv_blocks and cpu_tier_blocks


@dataclass(frozen=True)
class Profile:
    name: str = "Llama-2-70B, 4xH100 TP4 per engine (Vidur-measured step costs), 2 racks"
    speed: float = 1.0                  # step times divided by this (the "prefill speed" sweep)
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN
    gpu_kv_blocks: int = 880            # ~148 GB of KV per replica: 90 % of 4x80 GB less 140 GB of weights
    cpu_tier_blocks: int = 3_200        # ~512 GiB of host memory per node (both in 512-token blocks)
    max_batched_tokens: int = 2_048     # chunked-prefill token budget per step (vLLM's default)
    max_running: int = 128
    nic_bytes_per_s: float = 25e9       # each node's RDMA NIC, each direction
    inter_rack_bytes_per_s: float = 1.5e9   # the shared rack uplink, each direction
    promotion_bytes_per_s: float = 25e9     # CPU tier -> GPU (PCIe) per engine
    lookup_ms: float = 1.0
    racks: int = 2
    step_noise: float = 0.03            # sigma of a step's log-normal time factor
    engine_noise: float = 0.02          # sigma of each engine's persistent speed factor
    probe_noise: float = 0.05           # sigma of a bandwidth probe's or a calibration's error
    reprobe_s: float = 30.0             # every link is probed again this often (one pair at a time, spread out)
    probe_bytes: int = 64 << 20         # a probe is a real transfer of this many bytes on the simulated network
    report_s: float = 5.0               # engines report their measured prefill throughput this often
    load_report_ms: float = 250.0       # the router's view of each engine's queue is a snapshot this old at most
    pull_timeout_ms: float = 5000.0     # a pull not done by then is cancelled and its tokens recomputed (the
                                        # connector's pull timeout)
    block_tokens: int = TRACE_BLOCK_TOKENS   # the engines' KV block: the trace's tokens per hash id
    shared_machine: float = 0.0         # engines share one machine's cores (sim-to-real): each other busy engine
                                        # makes a step this much slower (0: engines have their own hardware)

    @property
    def gpu_blocks(self) -> int:
        """``gpu_kv_blocks``' memory in blocks of ``block_tokens``."""
        return self.gpu_kv_blocks * CAPACITY_BLOCK_TOKENS // self.block_tokens

    @property
    def cpu_blocks(self) -> int:
        return self.cpu_tier_blocks * CAPACITY_BLOCK_TOKENS // self.block_tokens

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.kv_bytes_per_token

    def as_dict(self) -> dict:
        return asdict(self)
