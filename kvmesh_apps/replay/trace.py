"""Mooncake-format traces: one JSON object per line with ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids`` (ids of prefix-chained 512-token blocks).

Parsing: every row is checked (:func:`parse_row`, :meth:`TraceRequest.validate`) and a bad
one is a :class:`TraceError` naming the file, the line (1-based) and the field. Blank
lines are skipped and do not count as requests; other keys are ignored. A request's
index (``--start``) counts requests, from 0.

Windows: :func:`select_windows` picks disjoint windows of consecutive requests
(never the same window twice); :func:`load_window` reads one, sorted by arrival
(a trace whose timestamps go backwards inside a window is replayed in arrival
order, ties in file order) and shifted so its first arrival is at 0.

Block hashes: hash id ``i`` at chain position ``k`` becomes
``sha256(parent_hash || i as 8 bytes big-endian)`` with parent ``b""`` for the
first block: 32 bytes, deterministic, and equal for equal prefixes exactly as
the trace's ids are. Only full blocks (``input_length // 512``) are hashed:
vLLM caches full blocks only.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512
WINDOW_SPACING = 4000    # requests between the starts of consecutive windows, when the trace is long enough
_MAX_HASH_ID = 2**64     # a hash id is hashed as 8 bytes


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file, and the line and field where there is one."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_ms: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]

    def validate(self) -> TraceRequest:
        """Raises ValueError naming the trace field at fault; returns self."""
        if not math.isfinite(self.arrival_ms) or self.arrival_ms < 0:
            raise ValueError(f"timestamp: must be a finite number >= 0, got {self.arrival_ms!r}")
        for name, value in (("input_length", self.input_tokens), ("output_length", self.output_tokens)):
            if value < 0:
                raise ValueError(f"{name}: must be >= 0, got {value}")
        for k, h in enumerate(self.hash_ids):
            if not 0 <= h < _MAX_HASH_ID:
                raise ValueError(f"hash_ids[{k}]: must be an integer in [0, 2**64), got {h}")
        return self


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_row(text: str) -> TraceRequest:
    """One line of a trace -> a validated request; ValueError naming the field (or "not a JSON object")."""
    try:
        row = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(row, dict):
        raise ValueError(f"not a JSON object (got {type(row).__name__})")
    for name in ("timestamp", "input_length", "output_length", "hash_ids"):
        if name not in row:
            raise ValueError(f"{name}: missing")
    ts = row["timestamp"]
    if not (_is_int(ts) or isinstance(ts, float)):
        raise ValueError(f"timestamp: must be a number of milliseconds, got {ts!r}")
    for name in ("input_length", "output_length"):
        if not _is_int(row[name]):
            raise ValueError(f"{name}: must be an integer, got {row[name]!r}")
    ids = row["hash_ids"]
    if not isinstance(ids, list):
        raise ValueError(f"hash_ids: must be a list of integers, got {ids!r}")
    for k, h in enumerate(ids):
        if not _is_int(h):
            raise ValueError(f"hash_ids[{k}]: must be an integer, got {h!r}")
    return TraceRequest(float(ts), row["input_length"], row["output_length"], tuple(ids)).validate()


def _rows(path: Path) -> Iterator[tuple[int, str]]:
    """(line number from 1, text) of each non-blank line; TraceError for a file that cannot be read."""
    try:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise TraceError(f"{path}, line {lineno}: not UTF-8 text") from None
                if text.strip():
                    yield lineno, text
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace ({exc.strerror or exc})") from None


def _parse(path: Path, lineno: int, text: str) -> TraceRequest:
    try:
        return parse_row(text)
    except ValueError as exc:
        raise TraceError(f"{path}, line {lineno}: {exc}") from None


@dataclass(frozen=True, slots=True)
class TraceInfo:
    path: Path
    requests: int     # non-blank lines
    lines: int        # the last non-blank line's number


def scan(path: Path) -> TraceInfo:
    """Checks every row; TraceError at the first bad one, or for a trace without requests."""
    requests = last = 0
    for lineno, text in _rows(path):
        _parse(path, lineno, text)
        requests, last = requests + 1, lineno
    if not requests:
        raise TraceError(f"{path}: no requests (an empty trace)")
    return TraceInfo(path, requests, last)


@dataclass(frozen=True, slots=True)
class WindowPlan:
    """Disjoint windows of ``requests`` consecutive requests starting at ``starts`` (request indices), and what
    was asked for: fewer windows, or shorter ones, when the trace cannot hold them (``note`` says so)."""
    starts: tuple[int, ...]
    requests: int
    windows_requested: int
    requests_requested: int
    trace_requests: int      # in the whole trace

    @property
    def note(self) -> str:
        parts = []
        if self.requests < self.requests_requested:
            parts.append(f"windows of {_n(self.requests, 'request')}, not {self.requests_requested}")
        if len(self.starts) < self.windows_requested:
            parts.append(f"{_n(len(self.starts), 'disjoint window')}, not {self.windows_requested}")
        if not parts:
            return ""
        left = self.trace_requests - self.starts[0]
        return (f"{' and '.join(parts)}: the trace has {_n(left, 'request')} from request {self.starts[0]} on"
                + ("; one window gives no confidence interval" if len(self.starts) == 1 else ""))

    def as_dict(self) -> dict:
        return {"windows": list(self.starts), "windows_requested": self.windows_requested,
                "requests": self.requests, "requests_requested": self.requests_requested,
                "trace_requests": self.trace_requests, "note": self.note}


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'s' * (count != 1)}"


def select_windows(info: TraceInfo, start: int, windows: int, requests: int,
                   spacing: int = WINDOW_SPACING) -> WindowPlan:
    """``windows`` windows of ``requests`` requests from request ``start``, ``spacing`` apart; closer (never
    overlapping) when the rest of the trace is shorter than that; as many as fit when even adjacent ones do
    not; one window of what is left when not even one fits. TraceError when ``start`` is past the end."""
    if start >= info.requests:
        lines = f" on {info.lines} lines" if info.lines != info.requests else ""
        raise TraceError(f"--start {start} is past the end of {info.path}: it has {info.requests} requests{lines} "
                         f"(requests 0 to {info.requests - 1})")
    left = info.requests - start
    size = min(requests, left)
    stride = max(size, min(spacing, (left - size) // (windows - 1))) if windows > 1 else size
    count = min(windows, 1 + (left - size) // stride)
    return WindowPlan(tuple(start + k * stride for k in range(count)), size, windows, requests, info.requests)


def load_window(path: Path, start: int, count: int, time_scale: float = 1.0) -> list[TraceRequest]:
    """Requests ``start`` to ``start + count - 1``, sorted by arrival, arrivals shifted to 0 and divided by
    ``time_scale``. TraceError for a bad row in the window or a trace that ends before it does."""
    out: list[TraceRequest] = []
    seen = 0
    for index, (lineno, text) in enumerate(_rows(path)):
        if index >= start + count:
            break
        seen = index + 1
        if index >= start:
            out.append(_parse(path, lineno, text))
    if len(out) < count:
        raise TraceError(f"{path}: a window of {count} requests from request {start} does not fit: the trace has "
                         f"{seen} requests")
    out.sort(key=lambda r: r.arrival_ms)
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
