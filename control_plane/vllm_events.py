"""Feeds a stock vLLM's KV events into the control plane: ``kvmesh vllm-events``.

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557"}'``) publishes ZMQ multipart messages
``[topic, seq (8 bytes, big-endian), msgpack(KVEventBatch)]``. This adapter
subscribes, translates BlockStored / BlockRemoved / AllBlocksCleared into
kvmesh events for one node and namespace, and publishes them through an
:class:`~control_plane.publisher.EventPublisher`, so an unmodified vLLM
populates the global block map.

Limits, by design: vLLM must publish byte hashes (the default; with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` hashes are truncated to 64 bits and
can never match a lookup, so such events are refused with an error log). A gap
in vLLM's sequence numbers means events were lost: the adapter then clears
everything it published for the node (stale entries are worse than missing
ones; the next stores repopulate it). vLLM cannot be asked for a snapshot, so a
resync after a control-plane fence starts empty for the same reason.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from kvmesh.command_line import Parser, host_port, positive_int
from kvmesh.hashing import HashAlgo
from kvmesh.namespace import CacheConfig, Namespace

from control_plane.model import Medium, NodeInfo
from control_plane.publisher import EventPublisher

log = logging.getLogger(__name__)

_MEDIA = {"GPU": Medium.GPU, "CPU": Medium.CPU, "STORAGE": Medium.DISK, "DISK": Medium.DISK}


@dataclass
class AdapterStats:
    batches: int = 0
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    gaps: int = 0
    refused: int = 0


class VllmEventAdapter:
    """Translates one vLLM engine's event stream. Call ``handle`` per ZMQ message, or ``run``."""

    def __init__(self, publisher: EventPublisher, namespace: Namespace) -> None:
        self._publisher = publisher
        self._ns = namespace
        self._digest = namespace.cache_config.hash_algo.digest_size
        self._last_seq: int | None = None
        self.stats = AdapterStats()

    def handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            log.error("refusing a message of %d frames (expected topic, seq, payload)", len(frames))
            self.stats.refused += 1
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if seq < 0:  # vLLM's end-of-stream marker
            return
        if self._last_seq is not None and seq != self._last_seq + 1:
            log.warning("vLLM event gap: %d -> %d; clearing this node's entries", self._last_seq, seq)
            self.stats.gaps += 1
            self._publisher.cleared(self._ns)
        self._last_seq = seq
        try:
            batch = msgspec.msgpack.decode(frames[2])
            events = batch[1] if isinstance(batch, list) else batch["events"]
        except (msgspec.DecodeError, IndexError, KeyError, TypeError):
            events = None
        if not isinstance(events, list):
            log.error("refusing an undecodable event batch (seq %d)", seq)
            self.stats.refused += 1
            return
        self.stats.batches += 1
        for event in events:
            self._event(event)

    @staticmethod
    def _fields(event) -> tuple[str, dict]:
        if isinstance(event, dict):
            return event.get("type", ""), event
        if isinstance(event, list) and event and isinstance(event[0], str):  # array-like tagged form
            names = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                     "medium"),
                     "BlockRemoved": ("block_hashes", "medium")}
            return event[0], dict(zip(names.get(event[0], ()), event[1:]))
        return "", {}

    def _hashes(self, raw) -> list[bytes] | None:
        if not isinstance(raw, list) or not all(isinstance(h, bytes) and len(h) == self._digest for h in raw):
            log.error("refusing events with non-byte or %s-incompatible block hashes (is "
                      "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES set?)", self._ns.cache_config.hash_algo.value)
            self.stats.refused += 1
            return None
        return list(raw)

    def _event(self, event) -> None:
        kind, f = self._fields(event)
        named = f.get("medium") or "GPU"
        medium = _MEDIA.get(named) if isinstance(named, str) else None
        if kind == "BlockStored":
            if f.get("block_size") != self._ns.cache_config.block_size:
                log.error("refusing BlockStored with block_size %s (namespace has %d)", f.get("block_size"),
                          self._ns.cache_config.block_size)
                self.stats.refused += 1
                return
            hashes = self._hashes(f.get("block_hashes", []))
            if hashes and medium is not None:
                self._publisher.stored(self._ns, hashes, int(medium))
                self.stats.stored += len(hashes)
        elif kind == "BlockRemoved":
            hashes = self._hashes(f.get("block_hashes", []))
            if hashes:
                self._publisher.removed(self._ns, hashes, int(medium) if medium else 0)
                self.stats.removed += len(hashes)
        elif kind == "AllBlocksCleared":
            self._publisher.cleared(self._ns)
            self.stats.cleared += 1
        else:
            log.debug("ignoring vLLM event %r", kind)

    async def run(self, endpoint: str, topic: str = "") -> None:
        """Subscribes to ``endpoint`` and handles messages until cancelled."""
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.connect(endpoint)
        sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        try:
            while True:
                self.handle(await sock.recv_multipart())
        finally:
            sock.close(linger=0)


def main(argv: list[str]) -> int:
    parser = Parser(prog="kvmesh vllm-events", description=__doc__.split("\n\n")[0])
    parser.add_argument("--zmq", required=True, help="vLLM's KV event endpoint, e.g. tcp://127.0.0.1:5557")
    parser.add_argument("--topic", default="")
    parser.add_argument("--control-plane", type=host_port, required=True, help="host:port of the control plane")
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--data-plane-address", required=True, help="host:port peers pull this node's blocks from")
    parser.add_argument("--tenant", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--weight-version", default="")
    parser.add_argument("--block-size", type=positive_int, required=True)
    parser.add_argument("--kv-dtype", default="bfloat16")
    parser.add_argument("--parallel-layout", default="tp1-pp1")
    parser.add_argument("--hash-algo", default="sha256_cbor", choices=[a.value for a in HashAlgo])
    parser.add_argument("--hash-seed", default="", help="vLLM's PYTHONHASHSEED, if set")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ns = Namespace(args.tenant, args.model, args.weight_version, CacheConfig(
        block_size=args.block_size, kv_dtype=args.kv_dtype, parallel_layout=args.parallel_layout,
        hash_algo=HashAlgo.parse(args.hash_algo), hash_seed=args.hash_seed)).validate()

    async def run() -> None:
        publisher = EventPublisher(args.control_plane, NodeInfo(args.node_id, args.data_plane_address),
                                   snapshot=lambda: [])
        await publisher.start()
        task = asyncio.create_task(VllmEventAdapter(publisher, ns).run(args.zmq, args.topic))
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        task.cancel()
        await publisher.flush(2.0)
        await publisher.stop()

    asyncio.run(run())
    return 0
