"""One request's account of its KV loads (the connector's ``kv_transfer_params["kvmesh"]`` report).

Its own module so that the scheduler side (which fills it) and the stats (which count it) both import it and not
each other.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(slots=True)
class LoadReport:
    """What one request's loads did; returned in ``RequestOutput.kv_transfer_params["kvmesh"]``."""

    loaded_tokens: int = 0
    local_tokens: int = 0  # loaded from this node's tiers
    peer_tokens: int = 0  # loaded after a pull from a peer
    failed_blocks: int = 0
    stored_blocks: int = 0
    bytes_pulled: int = 0  # moved by this request's pulls (blocks another pull on the node brought: ``joined_blocks``)
    joined_blocks: int = 0
    pull_ms: float = 0.0  # the Pull RPC as the connector saw it
    peer_lookup_ms: float = 0.0  # the source's Lookup, inside the pull
    transfer_ms: float = 0.0  # the NIXL READ, inside the pull
    lookup_ms: float = 0.0  # LookupPrefix (auto_source) and Acquire
    wait_ms: float = 0.0  # from the first ask to the answer (the request waited, others ran)
    source: str = ""  # node pulled from
    outcome: str = "none"
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def merge(self, attempt: "LoadReport") -> None:
        """Add one background task's account (numbers add up, the latest outcome wins)."""
        for f in fields(self):
            value = getattr(attempt, f.name)
            if f.type in ("int", "float"):
                setattr(self, f.name, getattr(self, f.name) + value)
            elif value and value != "none":
                setattr(self, f.name, value)
