"""Mooncake-format traces: one JSON object per line with ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids`` (ids of prefix-chained 512-token blocks). Traces of the same shape in other
units (Alibaba's Qwen traces: seconds, 16-token blocks) are read with a :class:`TraceFormat` saying so
(``--trace-time-unit``, ``--trace-block-tokens``); nothing guesses it.

Parsing: every row is checked (:func:`parse_row`, :meth:`TraceRequest.validate`) and a bad
one is a :class:`TraceError` naming the file, the line (1-based) and the field. Blank
lines are skipped and do not count as requests; other keys are ignored. A request's
index (``--start``) counts requests, from 0. A gzip-compressed file (``.jsonl.gz``) is read
as it is; a UTF-8 byte-order mark is skipped. A row's ``hash_ids`` must be its prompt's
blocks of the format's ``block_tokens`` (B): at least ``input_length // B`` and at most ``ceil(input_length / B)``
(a trace cut in blocks of another size would give wrong hit rates, so it is refused, naming the size its ids
imply). A window whose arrivals come faster than :data:`MAX_REQUESTS_PER_S` in some second is refused
(:func:`check_arrivals`): timestamps in seconds read as milliseconds, most likely.

Windows: :func:`select_windows` picks disjoint windows of consecutive requests
(never the same window twice); :func:`load_window` reads one, sorted by arrival
(a trace whose timestamps go backwards inside a window is replayed in arrival
order, ties in file order) and shifted so its first arrival is at 0.

Block hashes: hash id ``i`` at chain position ``k`` becomes
``sha256(parent_hash || i as 8 bytes big-endian)`` with parent ``b""`` for the
first block: 32 bytes, deterministic, and equal for equal prefixes exactly as
the trace's ids are. Only full blocks (``input_length // B``) are hashed:
vLLM caches full blocks only.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvmesh.namespace import MAX_BLOCK_SIZE

TRACE_BLOCK_TOKENS = 512
MAX_WINDOW_SPAN_MS = 86_400_000  # a window's arrivals within one day: timestamps are milliseconds from one origin
# Far above a real deployment's trace (Mooncake's conversation trace, first 1,000 requests: at most 17 in a second);
# a trace in seconds read as milliseconds arrives 1,000 times faster than it did.
MAX_REQUESTS_PER_S = 1000
FORMAT_HELP = "docs/scheduling.md, 'The trace format, checks and windows', says what a trace holds"
WINDOW_SPACING = 4000    # requests between the starts of consecutive windows, when the trace is long enough
_MAX_HASH_ID = 2**64     # a hash id is hashed as 8 bytes


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file, and the line and field where there is one."""


TimeUnit = Literal["ms", "s"]
_MS_PER = {"ms": 1.0, "s": 1000.0}


@dataclass(frozen=True, slots=True)
class TraceFormat:
    """What a trace's numbers mean: ``block_tokens`` tokens per hash id, timestamps in ``time_unit``."""
    block_tokens: int = TRACE_BLOCK_TOKENS
    time_unit: TimeUnit = "ms"

    @property
    def ms_per_unit(self) -> float:
        return _MS_PER[self.time_unit]

    def as_dict(self) -> dict:
        return {"block_tokens": self.block_tokens, "time_unit": self.time_unit}


def block_tokens_flag(text: str) -> int:
    """``--trace-block-tokens``: an integer in 1..MAX_BLOCK_SIZE (the router's largest block)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_BLOCK_SIZE:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to {MAX_BLOCK_SIZE} (the tokens of one hash "
                                         f"id: 512 for Mooncake's traces, 16 for Alibaba's blksz_16), got {text!r}")
    return value


def add_format_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace-block-tokens", type=block_tokens_flag, default=TRACE_BLOCK_TOKENS,
                        help="tokens per hash id of the trace (default 512, Mooncake's; 16 for Alibaba's "
                             "qwen_trace*_blksz_16); the simulated engines' KV block size follows it")
    parser.add_argument("--trace-time-unit", choices=tuple(_MS_PER), default="ms",
                        help="unit of the trace's timestamps (default ms, Mooncake's; s for Alibaba's Qwen traces)")


def format_of(args: argparse.Namespace) -> TraceFormat:
    return TraceFormat(args.trace_block_tokens, args.trace_time_unit)


def implied_block_sizes(input_tokens: int, ids: int) -> tuple[int, float]:
    """The block sizes B (lowest, highest; inf: no bound) for which ``ids`` ids fit a prompt of ``input_tokens``:
    ``input_tokens // B <= ids <= ceil(input_tokens / B)``; lowest > highest when none does."""
    lowest = input_tokens // (ids + 1) + 1
    highest = math.inf if ids <= 1 else -(-input_tokens // (ids - 1)) - 1
    return lowest, highest


def _implied(input_tokens: int, ids: int) -> str:
    lowest, highest = implied_block_sizes(input_tokens, ids)
    if lowest == highest:
        return f"its ids imply {lowest}-token blocks; replay with --trace-block-tokens {lowest}"
    if lowest > highest:
        return "no block size gives that many ids"
    sizes = f"at least {lowest}" if highest == math.inf else f"{lowest} to {highest}"
    return f"its ids imply blocks of {sizes} tokens; replay with --trace-block-tokens set to the trace's block size"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_ms: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]

    def validate(self, block_tokens: int = TRACE_BLOCK_TOKENS) -> TraceRequest:
        """Raises ValueError naming the trace field at fault; returns self. ``block_tokens``: tokens per hash id."""
        if not math.isfinite(self.arrival_ms) or self.arrival_ms < 0:
            raise ValueError(f"timestamp: must be a finite number >= 0, got {self.arrival_ms!r}")
        if self.input_tokens < 1:
            raise ValueError(f"input_length: must be >= 1 (a prompt of at least one token), got {self.input_tokens}")
        if self.output_tokens < 0:
            raise ValueError(f"output_length: must be >= 0, got {self.output_tokens}")
        for k, h in enumerate(self.hash_ids):
            if not 0 <= h < _MAX_HASH_ID:
                raise ValueError(f"hash_ids[{k}]: must be an integer in [0, 2**64), got {h}")
        low, high = self.input_tokens // block_tokens, -(-self.input_tokens // block_tokens)
        if not low <= len(self.hash_ids) <= high:
            expected = high if low == high else f"{low} or {high}"
            raise ValueError(f"hash_ids: {len(self.hash_ids)} ids for input_length {self.input_tokens}, not one per "
                             f"{block_tokens}-token block (that is {expected}): "
                             f"{_implied(self.input_tokens, len(self.hash_ids))}")
        return self


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_row(text: str, fmt: TraceFormat = TraceFormat()) -> TraceRequest:
    """One line of a trace -> a validated request (arrival in ms); ValueError naming the field (or "not a JSON
    object")."""
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
        raise ValueError(f"timestamp: must be a number ({fmt.time_unit}), got {ts!r}")
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
        arrival = float(ts) * fmt.ms_per_unit
    except OverflowError:
        raise ValueError(f"timestamp: too large a number ({str(ts)[:20]}...)") from None
    return TraceRequest(arrival, row["input_length"], row["output_length"], tuple(ids)).validate(fmt.block_tokens)


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


def _parse(path: Path, lineno: int, text: str, fmt: TraceFormat) -> TraceRequest:
    try:
        return parse_row(text, fmt)
    except ValueError as exc:
        raise TraceError(f"{path}, line {lineno}: {exc} ({FORMAT_HELP})") from None


@dataclass(frozen=True, slots=True)
class TraceInfo:
    path: Path
    requests: int     # non-blank lines
    lines: int        # the last non-blank line's number
    largest_tokens: int = 0   # the largest request's prompt and output tokens together
    largest_line: int = 0     # its line

    def check_fits(self, kv_blocks: int, block_tokens: int, flag: str, given: int | None = None) -> None:
        """TraceError when the largest request needs more than ``kv_blocks`` blocks of ``block_tokens``: an
        engine could never admit it (nor, behind it, the requests after it on that engine). ``given``: the
        ``flag``'s value, where it counts other blocks than ``kv_blocks`` does."""
        need = -(-self.largest_tokens // block_tokens)
        if need > kv_blocks:
            holds = f"{flag} {kv_blocks}" if given in (None, kv_blocks) else \
                f"{flag} {given}: {kv_blocks} blocks of {block_tokens} tokens"
            raise TraceError(f"{self.path}, line {self.largest_line}: a request of {self.largest_tokens} tokens "
                             f"(prompt and output) needs {need} KV blocks of {block_tokens} tokens, more than an "
                             f"engine holds ({holds}): raise {flag}, or leave the request out")


def scan(path: Path, fmt: TraceFormat = TraceFormat()) -> TraceInfo:
    """Checks every row; TraceError at the first bad one, or for a trace without requests."""
    requests = last = largest = largest_line = 0
    for lineno, text in _rows(path):
        r = _parse(path, lineno, text, fmt)
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


def load_window(path: Path, start: int, count: int, time_scale: float = 1.0,
                fmt: TraceFormat = TraceFormat()) -> list[TraceRequest]:
    """Requests ``start`` to ``start + count - 1``, sorted by arrival, arrivals (in ms) shifted to 0 and divided by
    ``time_scale``. TraceError for a bad row in the window or a trace that ends before it does."""
    out: list[TraceRequest] = []
    seen = 0
    for index, (lineno, text) in enumerate(_rows(path)):
        if index >= start + count:
            break
        seen = index + 1
        if index >= start:
            out.append(_parse(path, lineno, text, fmt))
    if len(out) < count:
        raise TraceError(f"{path}: a window of {count} requests from request {start} does not fit: the trace has "
                         f"{seen} requests")
    out.sort(key=lambda r: r.arrival_ms)
    t0 = out[0].arrival_ms
    if out[-1].arrival_ms - t0 > MAX_WINDOW_SPAN_MS:
        raise TraceError(f"{path}: requests {start} to {start + count - 1} arrive over "
                         f"{(out[-1].arrival_ms - t0) / 3.6e6:.3g} hours (first at {t0:.0f} ms, last at "
                         f"{out[-1].arrival_ms:.0f} ms), more than a day: timestamps must count from one origin "
                         f"(a row in epoch time among relative ones?) in the --trace-time-unit ({fmt.time_unit})")
    return [TraceRequest((r.arrival_ms - t0) / time_scale, r.input_tokens, r.output_tokens, r.hash_ids)
            for r in out]


@dataclass(frozen=True, slots=True)
class Arrivals:
    """How fast a window's requests arrive, at time scale 1."""
    rate_rps: float | None   # its requests over its span (None: all at one time)
    peak_per_s: int          # the most of them arriving within one second


def arrivals(window: list[TraceRequest]) -> Arrivals:
    """``window``: sorted by arrival (as :func:`load_window` gives it)."""
    span_s = (window[-1].arrival_ms - window[0].arrival_ms) / 1000.0
    peak = first = 0
    for last, r in enumerate(window):
        while r.arrival_ms - window[first].arrival_ms >= 1000.0:
            first += 1
        peak = max(peak, last - first + 1)
    return Arrivals(len(window) / span_s if span_s else None, peak)


def check_arrivals(path: Path, start: int, window: list[TraceRequest], fmt: TraceFormat) -> Arrivals:
    """The window's :class:`Arrivals`; TraceError when more than :data:`MAX_REQUESTS_PER_S` arrive in a second."""
    found = arrivals(window)
    if found.peak_per_s > MAX_REQUESTS_PER_S:
        fix = ("--trace-time-unit s if its timestamps are seconds" if fmt.time_unit == "ms"
               else "check its timestamps")
        raise TraceError(f"{path}: {found.peak_per_s} of requests {start} to {start + len(window) - 1} arrive within "
                         f"one second (timestamps read as {fmt.time_unit}), more than {MAX_REQUESTS_PER_S} a second, "
                         f"far above any real deployment's trace: {fix}")
    return found


class BlockHashes:
    """Maps a request's hash ids to chained 32-byte block hashes (memoised by chain). ``block_tokens``: the
    tokens of one hash id (the trace's, or fewer in a scaled-down window)."""

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
