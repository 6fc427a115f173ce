"""Mooncake-format traces: one JSON object per line with ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids`` (ids of prefix-chained 512-token blocks).

Parsing: every row is checked (:func:`parse_row`, :meth:`TraceRequest.validate`) and a bad
one is a :class:`TraceError` naming the file, the line (1-based) and the field. Blank
lines are skipped and do not count as requests; other keys are ignored. A request's
index (``--start``) counts requests, from 0. A gzip-compressed file (``.jsonl.gz``) is read
as it is; a UTF-8 byte-order mark is skipped. A row's ``hash_ids`` must be its prompt's
512-token blocks: at least ``input_length // 512`` and at most ``ceil(input_length / 512)``
(a trace cut in blocks of another size would give wrong hit rates, so it is refused).

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

import gzip
import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512
MAX_WINDOW_SPAN_MS = 86_400_000  # a window's arrivals within one day: timestamps are milliseconds from one origin
FORMAT_HELP = "docs/scheduling.md, 'The trace format, checks and windows', says what a trace holds"
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
        if self.input_tokens < 1:
            raise ValueError(f"input_length: must be >= 1 (a prompt of at least one token), got {self.input_tokens}")
        if self.output_tokens < 0:
            raise ValueError(f"output_length: must be >= 0, got {self.output_tokens}")
        for k, h in enumerate(self.hash_ids):
            if not 0 <= h < _MAX_HASH_ID:
                raise ValueError(f"hash_ids[{k}]: must be an integer in [0, 2**64), got {h}")
        low, high = self.input_tokens // TRACE_BLOCK_TOKENS, -(-self.input_tokens // TRACE_BLOCK_TOKENS)
        if not low <= len(self.hash_ids) <= high:
            implied = f" (about {self.input_tokens // len(self.hash_ids)} tokens an id)" if self.hash_ids else ""
            raise ValueError(
                f"hash_ids: {len(self.hash_ids)} ids for input_length {self.input_tokens}{implied}; a Mooncake "
                f"trace has one id per {TRACE_BLOCK_TOKENS}-token block of the prompt ({high} here), and a trace "
                f"in blocks of another size would replay with wrong hit rates")
        return self


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_row(text: str) -> TraceRequest:
    """One line of a trace -> a validated request; ValueError naming the field (or "not a JSON object")."""
    try:
        row = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if isinstance(row, list):
        raise ValueError("a JSON array, not one JSON object per line (JSONL): convert it with jq -c '.[]'")
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
    try:
        arrival = float(ts)
    except OverflowError:
        raise ValueError(f"timestamp: too large for a number of milliseconds ({str(ts)[:20]}...)") from None
    return TraceRequest(arrival, row["input_length"], row["output_length"], tuple(ids)).validate()


def _rows(path: Path) -> Iterator[tuple[int, str]]:
    """(line number from 1, text) of each non-blank line; TraceError for a file that cannot be read."""
    try:
        with open(path, "rb") as f:
            gzipped = f.read(2) == b"\x1f\x8b"
        with (gzip.open(path, "rb") if gzipped else open(path, "rb")) as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError:
                    raise TraceError(f"{path}, line {lineno}: not UTF-8 text (a trace is JSON lines, plain or "
                                     f"gzip-compressed; {FORMAT_HELP})") from None
                if text.strip():
                    yield lineno, text
    except (OSError, EOFError) as exc:  # gzip: a truncated or corrupt file
        raise TraceError(f"{path}: cannot read the trace ({getattr(exc, 'strerror', None) or exc})") from None


def _parse(path: Path, lineno: int, text: str) -> TraceRequest:
    try:
        return parse_row(text)
    except ValueError as exc:
        raise TraceError(f"{path}, line {lineno}: {exc} ({FORMAT_HELP})") from None


@dataclass(frozen=True, slots=True)
class TraceInfo:
    path: Path
    requests: int     # non-blank lines
    lines: int        # the last non-blank line's number
    largest_tokens: int = 0   # the largest request's prompt and output tokens together
    largest_line: int = 0     # its line

    def check_fits(self, kv_blocks: int, block_tokens: int, flag: str) -> None:
        """TraceError when the largest request needs more than ``kv_blocks`` blocks of ``block_tokens``: an
        engine could never admit it (nor, behind it, the requests after it on that engine)."""
        need = -(-self.largest_tokens // block_tokens)
        if need > kv_blocks:
            raise TraceError(f"{self.path}, line {self.largest_line}: a request of {self.largest_tokens} tokens "
                             f"(prompt and output) needs {need} KV blocks of {block_tokens} tokens, more than an "
                             f"engine holds ({flag} {kv_blocks}): raise {flag}, or leave the request out")


def scan(path: Path) -> TraceInfo:
    """Checks every row; TraceError at the first bad one, or for a trace without requests."""
    requests = last = largest = largest_line = 0
    for lineno, text in _rows(path):
        r = _parse(path, lineno, text)
        requests, last = requests + 1, lineno
        if r.input_tokens + max(1, r.output_tokens) > largest:
            largest, largest_line = r.input_tokens + max(1, r.output_tokens), lineno
    if not requests:
        raise TraceError(f"{path}: no requests (an empty trace)")
    return TraceInfo(path, requests, last, largest, largest_line)


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
    if out[-1].arrival_ms - t0 > MAX_WINDOW_SPAN_MS:
        raise TraceError(f"{path}: requests {start} to {start + count - 1} arrive over "
                         f"{(out[-1].arrival_ms - t0) / 3.6e6:.3g} hours (first at {t0:.0f} ms, last at "
                         f"{out[-1].arrival_ms:.0f} ms), more than a day: timestamps must be milliseconds from one "
                         f"origin (a row in epoch milliseconds among relative ones, or seconds read as ms?)")
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
