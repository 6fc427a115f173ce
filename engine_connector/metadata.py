"""What the scheduler-side connector tells the worker side each step.

It crosses a process boundary (scheduler -> worker) by pickling, so it is plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True, slots=True)
class BlockLoad:
    """Copy data-plane slot ``slot`` (pinned under the request's lease) into engine block ``block_id``."""

    req_id: str
    block_id: int
    slot: int


@dataclass(frozen=True, slots=True)
class SaveRun:
    """Save one request's consecutive full blocks: ``block_ids[i]`` holds chain block ``first_index + i``."""

    req_id: str
    first_index: int
    block_ids: list[int]
    block_hashes: list[bytes]
    max_offload_tokens: int = 0
    protected_blocks: int = 0


@dataclass(slots=True)
class KvmeshConnectorMetadata(KVConnectorMetadata):
    """One step's work: ``loads`` run before the forward, ``saves`` after it; ``leases`` are
    released once the loads are copied."""

    loads: list[BlockLoad] = field(default_factory=list)
    leases: list[str] = field(default_factory=list)
    saves: list[SaveRun] = field(default_factory=list)
