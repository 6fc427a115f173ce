"""The vLLM ZMQ event adapter, fed arbitrary multipart messages and msgpack batches shaped like vLLM's.

Whatever arrives, ``handle`` returns (an undecodable or ill-typed event is refused and counted, with an error
log and no traceback) and only well-formed events reach the publisher. The publisher here records calls; the
real publisher path is tests/control_plane/test_vllm_events.py.
"""

from __future__ import annotations

import logging

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.namespace import CacheConfig, Namespace

from control_plane.model import Medium
from control_plane.vllm_events import VllmEventAdapter

NS = Namespace("acme", "tiny-llama", "v1", CacheConfig(block_size=32))
FUZZ = settings(max_examples=300, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def stored(self, ns, hashes, medium) -> None:
        self.calls.append(("stored", ns, hashes, medium))

    def removed(self, ns, hashes, medium) -> None:
        self.calls.append(("removed", ns, hashes, medium))

    def cleared(self, ns) -> None:
        self.calls.append(("cleared", ns))


leaves = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=8),
                   st.binary(max_size=40), st.binary(min_size=32, max_size=32))
anything = st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                        max_leaves=12)
hashes = st.one_of(st.lists(st.binary(min_size=32, max_size=32), max_size=3), anything)
medium = st.one_of(st.sampled_from(["GPU", "CPU", "DISK", "STORAGE", None]), anything)
stored = st.builds(lambda h, p, t, bs, lora, m: ["BlockStored", h, p, t, bs, lora, m],
                   hashes, anything, anything, st.one_of(st.just(32), anything), anything, medium)
removed = st.builds(lambda h, m: ["BlockRemoved", h, m], hashes, medium)
as_dict = st.one_of(stored, removed).map(
    lambda e: {"type": e[0], **dict(zip(("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                         "medium") if e[0] == "BlockStored" else ("block_hashes", "medium"), e[1:]))})
event = st.one_of(stored, removed, as_dict, st.just(["AllBlocksCleared"]), anything)
batch = st.one_of(st.builds(lambda ts, events, rank: [ts, events, rank], anything, st.lists(event, max_size=4),
                            anything),
                  st.builds(lambda events: {"ts": 0.0, "events": events}, st.one_of(st.lists(event), anything)),
                  anything)
seq = st.one_of(st.integers(-1, 5).map(lambda n: n.to_bytes(8, "big", signed=True)), st.binary(max_size=12))
message = st.one_of(
    st.builds(lambda topic, s, payload: [topic, s, msgspec.msgpack.encode(payload)], st.binary(max_size=8), seq,
              batch),
    st.lists(st.binary(max_size=24), max_size=5))


def _well_formed(call) -> bool:
    if call[0] == "cleared":
        return call[1] == NS
    _, ns, block_hashes, med = call
    return (ns == NS and isinstance(block_hashes, list) and all(isinstance(h, bytes) and len(h) == 32
                                                                for h in block_hashes)
            and isinstance(med, int) and (med == 0 or med in {int(m) for m in Medium}))


@FUZZ
@given(messages=st.lists(message, min_size=1, max_size=4))
def test_any_message_is_handled_or_refused(messages, caplog):
    publisher = Recorder()
    adapter = VllmEventAdapter(publisher, NS)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="control_plane.vllm_events"):
        for frames in messages:
            adapter.handle(frames)
    assert all(_well_formed(call) for call in publisher.calls), publisher.calls
    assert not [r for r in caplog.records if r.exc_info], "a refused message left a traceback"


def test_a_well_formed_batch_is_published():
    """Positive control: the shapes drawn above include vLLM's real one, which reaches the publisher."""
    publisher = Recorder()
    adapter = VllmEventAdapter(publisher, NS)
    h = [bytes([i]) * 32 for i in range(3)]
    payload = [0.0, [["BlockStored", h, None, list(range(96)), 32, None, "CPU"], ["BlockRemoved", h[2:], "CPU"]], 0]
    adapter.handle([b"", (0).to_bytes(8, "big"), msgspec.msgpack.encode(payload)])
    assert publisher.calls == [("stored", NS, h, int(Medium.CPU)), ("removed", NS, h[2:], int(Medium.CPU))]
    assert adapter.stats.refused == 0
