"""Mooncake-format traces: one JSON object per line with ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids`` (ids of prefix-chained 512-token blocks).

Block hashes: hash id ``i`` at chain position ``k`` becomes
``sha256(parent_hash || i as 8 bytes big-endian)`` with parent ``b""`` for the
first block: 32 bytes, deterministic, and equal for equal prefixes exactly as
the trace's ids are. Only full blocks (``input_length // 512``) are hashed:
vLLM caches full blocks only.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_ms: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


def load_window(path: Path, start: int, count: int, time_scale: float = 1.0) -> list[TraceRequest]:
    """``count`` consecutive requests from line ``start``, arrivals shifted to 0 and divided by ``time_scale``."""
    out: list[TraceRequest] = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i < start:
                continue
            if len(out) == count:
                break
            row = json.loads(line)
            out.append(TraceRequest(float(row["timestamp"]), int(row["input_length"]), int(row["output_length"]),
                                    tuple(row["hash_ids"])))
    if not out:
        raise ValueError(f"{path}: no requests from line {start}")
    t0 = out[0].arrival_ms
    return [TraceRequest((r.arrival_ms - t0) / time_scale, r.input_tokens, r.output_tokens, r.hash_ids)
            for r in out]


class BlockHashes:
    """Maps a request's hash ids to chained 32-byte block hashes (memoised by chain). ``block_tokens``: the
    tokens of one hash id (a scaled-down trace has fewer than the trace's 512)."""

    def __init__(self, block_tokens: int = TRACE_BLOCK_TOKENS) -> None:
        self._memo: dict[tuple[bytes, int], bytes] = {}
        self.block_tokens = block_tokens

    def of(self, r: TraceRequest) -> list[bytes]:
        out, parent = [], b""
        for block_id in r.hash_ids[: r.input_tokens // self.block_tokens]:
            key = (parent, block_id)
            h = self._memo.get(key)
            if h is None:
                h = self._memo[key] = hashlib.sha256(parent + block_id.to_bytes(8, "big")).digest()
            out.append(h)
            parent = h
        return out
