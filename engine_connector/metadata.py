"""What the scheduler-side connector tells the worker side each step, and per-request options.

Everything here crosses a process boundary (scheduler -> worker) by pickling, so it is
plain data.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

# Key of this connector's entry in a request's ``kv_transfer_params``.
PARAMS_KEY = "kvmesh"


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """Copy one block between the engine's block ``block_id`` and the store entry ``block_hash``."""

    req_id: str
    block_id: int
    block_hash: bytes


@dataclass(slots=True)
class KvmeshConnectorMetadata(KVConnectorMetadata):
    """One step's work: ``loads`` run before the forward, ``saves`` after it."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class TransferParams:
    """Per-request options, from ``SamplingParams(extra_args={"kv_transfer_params": {"kvmesh": {...}}})``.

    ``load``: look up and load the prompt's prefix from the store (default true).
    ``save``: save the request's full blocks to the store (default true).
    """

    load: bool = True
    save: bool = True

    @classmethod
    def from_request_params(cls, params: Mapping[str, Any] | None) -> "TransferParams":
        """Parse ``request.kv_transfer_params``; other keys are ignored.

        Never raises: it runs in the engine's scheduler, where an exception would kill
        the engine rather than fail one request.
        """
        ours = (params or {}).get(PARAMS_KEY)
        if not isinstance(ours, Mapping):
            return cls()
        return cls(load=bool(ours.get("load", True)), save=bool(ours.get("save", True)))
