"""Windows of a trace in which follow-up requests find their prefix on one engine (``kvmesh bench routing``).

A window of consecutive requests rarely asks the pull-or-recompute question: in the conversation trace a
request's follow-up turn (a later request whose hash ids extend its prefix) comes a median ~420 requests later,
so a 24-request window holds almost none. A conversation window keeps the trace's prefix structure and its
order but gathers whole conversations:

1. scan ``horizon`` requests of the trace from ``start``, each scaled to ``block_tokens`` tokens per trace block
   (a hash id: ``fmt.block_tokens`` tokens, 512 in Mooncake's traces); a request whose scaled prompt exceeds
   ``max_prompt`` is skipped (never truncated: a truncated turn would repeat its predecessor's prompt);
2. a request joins the thread of the earlier scanned request with which it shares the longest prefix of at least
   ``MIN_SHARED_BLOCKS`` trace blocks (more than the one system block every request shares), else it starts a
   thread;
3. threads with two or more requests are taken whole, in the order of their first request, until ``count``
   requests (the last one cut short); too few, and the earliest other requests fill the window;
4. the window is sorted by arrival (the trace's order and gaps; the bench rescales them to its pace), and each
   follow-up names its ``previous`` request: the latest earlier one of the window holding its longest prefix.

The bench sends a follow-up no earlier than its previous request's first token plus a think time (a user answers
a reply), so its prefix (its previous turn) was served on exactly one engine, unless a pull copied it: the router
decides to go to that engine (and wait if it is busy), to pull the prefix to another, or to recompute it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvmesh_apps.replay.trace import TRACE_BLOCK_TOKENS, TraceError, TraceFormat, TraceRequest, load_window

MIN_SHARED_BLOCKS = 2


@dataclass(frozen=True)
class ConversationWindow:
    requests: list[TraceRequest]   # scaled (``input_tokens`` in the bench's tokens), by arrival, first at 0
    follow_ups: int                # requests whose prefix an earlier request of the window held
    shared_tokens: list[int]       # per request, the prefix tokens an earlier request of the window held
    previous: list[int | None]     # per request, the index of that earlier request (None: no shared prefix)


def scaled_tokens(r: TraceRequest, block_tokens: int, trace_block_tokens: int = TRACE_BLOCK_TOKENS) -> int:
    """``r``'s prompt with each ``trace_block_tokens``-token trace block made ``block_tokens`` tokens."""
    return max(block_tokens, r.input_tokens * block_tokens // trace_block_tokens)


def conversation_window(trace: Path, start: int, horizon: int, count: int, block_tokens: int,
                        max_prompt: int, fmt: TraceFormat = TraceFormat()) -> ConversationWindow:
    """The window of ``count`` requests built from ``horizon`` requests from ``start`` (module docstring);
    TraceError when none of them fits ``max_prompt``."""
    window = load_window(trace, start, horizon, fmt=fmt)
    scanned = [r for r in window if scaled_tokens(r, block_tokens, fmt.block_tokens) <= max_prompt]
    if not scanned:
        raise TraceError(f"{trace}: no request from request {start} fits --max-prompt {max_prompt} once scaled to "
                         f"{block_tokens} tokens a trace block")
    owner: dict[tuple[int, ...], int] = {}
    thread_of: list[int] = []
    for i, r in enumerate(scanned):
        ids = r.hash_ids
        joined = next((owner[ids[:k]] for k in range(len(ids), MIN_SHARED_BLOCKS - 1, -1) if ids[:k] in owner), i)
        thread_of.append(joined)
        for k in range(MIN_SHARED_BLOCKS, len(ids) + 1):
            owner[ids[:k]] = joined
    members: dict[int, list[int]] = {}
    for i, t in enumerate(thread_of):
        members.setdefault(t, []).append(i)
    chosen: list[int] = []
    for t in sorted(members):
        if len(members[t]) >= 2 and len(chosen) < count:
            chosen += members[t][: count - len(chosen)]
    taken = set(chosen)
    chosen += [i for i in range(len(scanned)) if i not in taken][: count - len(chosen)]
    chosen.sort()
    t0 = scanned[chosen[0]].arrival_ms
    out, shared, previous, seen = [], [], [], {}
    for i in chosen:
        r = scanned[i]
        tokens = scaled_tokens(r, block_tokens, fmt.block_tokens)
        full = r.hash_ids[: tokens // block_tokens]
        held = next((k for k in range(len(full), 0, -1) if full[:k] in seen), 0)
        follows = held >= MIN_SHARED_BLOCKS
        shared.append(held * block_tokens if follows else 0)
        previous.append(seen[full[:held]] if follows else None)
        seen.update((full[:k], len(out)) for k in range(1, len(full) + 1))
        out.append(TraceRequest(r.arrival_ms - t0, tokens, 1, r.hash_ids))
    return ConversationWindow(out, sum(1 for s in shared if s), shared, previous)
