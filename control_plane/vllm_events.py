"""Feeds a stock vLLM's KV events into the control plane: ``kvmesh vllm-events``.

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557"}'``) publishes ZMQ multipart messages
``[topic, seq (8 bytes, big-endian), msgpack(KVEventBatch)]``. This adapter
subscribes, translates BlockStored / BlockRemoved / AllBlocksCleared into
kvmesh events for one node and namespace, and publishes them through an
:class:`~control_plane.publisher.EventPublisher`, so an unmodified vLLM
populates the global block map. The command authenticates with a node key
(``--api-key-file``, bound to ``--node-id``) and publishes under the namespace
the engine connector would use for the same ``vllm serve`` flags
(:func:`kvmesh.namespace.engine_namespace`), where a scheduler finds them with
``SchedulerClient.namespace_for``. A refused key, a control plane that does not
answer at start, an unreadable file or a bad flag end it with one line (exit 1, or 2
for bad input).

Limits, by design: vLLM must publish byte hashes: start it with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` (vLLM 0.32's default, 1, truncates
hashes to 64 bits that can never match a lookup, so such events are refused
with an error log). A gap
in vLLM's sequence numbers means events were lost: the adapter then clears
everything it published for the node (stale entries are worse than missing
ones; the next stores repopulate it). vLLM cannot be asked for a snapshot, so a
resync after a control-plane fence starts empty for the same reason.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
import msgspec
import zmq
import zmq.asyncio

from kvmesh.channels import ClientTLS
from kvmesh.command_line import Parser, UsageError, host_port, positive_int
from kvmesh.errors import PermissionDenied, Unauthenticated, Unavailable
from kvmesh.hashing import HashAlgo
from kvmesh.namespace import VLLM_DEFAULT_HASH_ALGO, Namespace, engine_namespace

from control_plane.model import Medium, NodeInfo
from control_plane.publisher import EventPublisher
from tenancy import api_keys
from tenancy.auth import auth_metadata

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
            log.error("refusing events with non-byte or %s-incompatible block hashes: start vLLM with "
                      "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (its default, 1, publishes 64-bit integers)",
                      self._ns.cache_config.hash_algo.value)
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
        sock = subscribe(endpoint, topic)
        try:
            await self.consume(sock)
        finally:
            sock.close(linger=0)

    async def consume(self, sock: zmq.asyncio.Socket) -> None:
        """Handles the messages of a subscribed socket until cancelled."""
        while True:
            self.handle(await sock.recv_multipart())


def subscribe(endpoint: str, topic: str = "") -> zmq.asyncio.Socket:
    """A SUB socket connected to ``endpoint``; :class:`UsageError` naming --zmq when it is not an endpoint vLLM can
    publish on (zmq refuses it, or it could never connect: a tcp:// one without a host and a port in 1..65535,
    vLLM's bind address ``*``, an in-process inproc:// one)."""
    fix = "give the endpoint vLLM publishes on, as a client connects to it: tcp://HOST:PORT or ipc://PATH"
    scheme, _, address = endpoint.partition("://")
    if scheme == "tcp":
        host, colon, port = address.rpartition(":")
        if host == "*":
            raise UsageError(f"--zmq {endpoint!r}: * is the address vLLM binds, not one to connect to; give the "
                             "host vLLM runs on, e.g. tcp://127.0.0.1:5557")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"--zmq {endpoint!r}: a tcp:// endpoint needs a host and a port in 1..65535; {fix}")
    elif scheme == "inproc":
        raise UsageError(f"--zmq {endpoint!r}: an inproc:// endpoint is reachable only inside one process; {fix}")
    sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise UsageError(f"--zmq {endpoint!r}: {zmq.strerror(exc.errno)}; {fix}") from None
    sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
    return sock


# The kv_dtype values the engine connector derives from vLLM (engine_connector/config.py): the dtype served in when
# --kv-cache-dtype is auto (str(torch dtype), without "torch.": vLLM's --dtype half/float16, bfloat16, float/float32),
# else --kv-cache-dtype itself (vLLM 0.32's CacheDType, but auto; tests/control_plane/test_vllm_events_cli.py checks
# this list against the vLLM installed). Any other value publishes under a namespace nothing looks up.
SERVED_DTYPES = ("bfloat16", "float16", "float32")
KV_DTYPES = SERVED_DTYPES + (
    "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc",
    "turboquant_k3v4_nc", "turboquant_3bit_nc", "ultraquant_4bit", "int4_per_token_head", "int8_per_token_head",
    "fp8_per_token_head", "nvfp4", "nvfp4_4over6")
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vllm serve --dtype's names of served dtypes


def kv_dtype(text: str) -> str:
    """``--kv-dtype``: one of :data:`KV_DTYPES`, as the connector names it (``torch.bfloat16`` is ``bfloat16``;
    vllm serve --dtype's ``half`` and ``float`` are ``float16`` and ``float32``)."""
    name = text.removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name in KV_DTYPES:
        return name
    if name == "auto":
        raise argparse.ArgumentTypeError("auto is not a KV dtype: give the dtype the engine serves in (vllm serve "
                                         f"--dtype, resolved: one of {', '.join(SERVED_DTYPES)})")
    raise argparse.ArgumentTypeError(f"unknown KV dtype {text!r} (known: {', '.join(KV_DTYPES)})")


def _parser() -> Parser:
    p = Parser(prog=PROG, description="Feeds a stock vLLM's KV events (vllm serve --kv-events-config) into the "
                "control plane's block map, as node --node-id, under the namespace the kvmesh connector would use "
                "for the same vllm serve flags.")
    p.add_argument("--zmq", required=True, help="vLLM's KV event endpoint, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--topic", default="", help="vLLM's kv-events topic (default: every topic)")
    p.add_argument("--control-plane", type=host_port, required=True, help="host:port of the control plane")
    p.add_argument("--api-key-file", required=True, help="file holding this node's API key (role node, bound to "
                   "--node-id: kvmesh admin keys issue --role node --node NODE --secret-out FILE)")
    p.add_argument("--node-id", required=True, help="the node the engine runs on, as its key names it")
    p.add_argument("--data-plane-address", required=True, help="host:port peers pull this node's blocks from")
    p.add_argument("--tls-ca-file", help="CA of the control plane's certificate (TLS; unset: plaintext)")
    p.add_argument("--tls-cert-file", help="this client's certificate, for a control plane that requires mutual TLS")
    p.add_argument("--tls-key-file", help="the private key of --tls-cert-file")
    p.add_argument("--tls-server-name", help="name to check in the control plane's certificate instead of the host "
                   "in --control-plane (kvmesh up's: control-plane)")
    # The engine's namespace: the rule of kvmesh.namespace.engine_namespace, from vllm serve's own flags.
    p.add_argument("--model", required=True, help="the engine's served model name (--served-model-name, else the "
                   "model as given to vllm serve)")
    p.add_argument("--block-size", type=positive_int, required=True, help="vllm serve --block-size")
    p.add_argument("--kv-dtype", type=kv_dtype, required=True, help="the engine's KV dtype: --kv-cache-dtype "
                   "unless auto, else the dtype it serves in (e.g. bfloat16). One of: "
                   f"{', '.join(KV_DTYPES)}")
    p.add_argument("--tenant", default="default")
    p.add_argument("--weight-version", default="")
    p.add_argument("--tensor-parallel-size", type=positive_int, default=1)
    p.add_argument("--pipeline-parallel-size", type=positive_int, default=1)
    p.add_argument("--hash-algo", default=VLLM_DEFAULT_HASH_ALGO, choices=[a.value for a in HashAlgo],
                   help="vllm serve --prefix-caching-hash-algo (default: vLLM's, sha256)")
    p.add_argument("--hash-seed", default="", help="the engine's PYTHONHASHSEED, if set")
    return p


PROG = "kvmesh vllm-events"
START_TIMEOUT_S = 10.0


def main(argv: list[str]) -> int:
    """Bad input: ``UsageError`` / ``InvalidArgument`` (exit 2); a refused key or a control plane that does not
    answer at start: ``Unauthenticated`` / ``PermissionDenied`` / ``Unavailable`` (exit 1); one line each
    (kvmesh.command_line.run_command)."""
    return asyncio.run(_main(argv))


async def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    sock = subscribe(args.zmq, args.topic)  # a bad --zmq: one line before anything starts
    try:
        return await _serve(args, sock)
    finally:
        sock.close(linger=0)


async def _serve(args: argparse.Namespace, sock: zmq.asyncio.Socket) -> int:
    ns = engine_namespace(args.model, block_size=args.block_size, kv_dtype=args.kv_dtype, tenant=args.tenant,
                          weight_version=args.weight_version, tensor_parallel_size=args.tensor_parallel_size,
                          pipeline_parallel_size=args.pipeline_parallel_size, hash_algo=args.hash_algo,
                          hash_seed=args.hash_seed)
    node = NodeInfo(args.node_id, args.data_plane_address).validate()
    key = _read(args.api_key_file, "--api-key-file").decode(errors="replace").strip()
    api_keys.checked(key, f"--api-key-file {args.api_key_file}")
    if not key:
        raise UsageError(f"--api-key-file {args.api_key_file} is empty; write the node's API key into it")
    tls = None
    if args.tls_ca_file:
        tls = ClientTLS(args.tls_ca_file, args.tls_cert_file, args.tls_key_file, args.tls_server_name)
        for flag in ("--tls-ca-file", "--tls-cert-file", "--tls-key-file"):
            path = getattr(args, flag[2:].replace("-", "_"))
            if path:
                _read(path, flag)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.disable(logging.WARNING)  # the start's retries: its outcome is said in one line
    publisher = EventPublisher(args.control_plane, node, snapshot=lambda: [], metadata=auth_metadata(key), tls=tls,
                               stop_on_refusal=True)
    await publisher.start()
    task = None
    try:
        registered = await publisher.flush(START_TIMEOUT_S)
        if publisher.refusal is not None:
            raise _refused(args, publisher.refusal)
        if not registered:
            raise Unavailable(f"the control plane at {args.control_plane} did not answer within "
                              f"{START_TIMEOUT_S:.0f} s; check --control-plane (and --tls-* for a TLS control plane)")
        logging.disable(logging.NOTSET)
        log.info("feeding %s into the control plane at %s as node %s, namespace %s", args.zmq, args.control_plane,
                 args.node_id, ns.fingerprint)
        task = asyncio.create_task(VllmEventAdapter(publisher, ns).consume(sock))
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        while not stop.is_set():
            if publisher.refusal is not None:  # e.g. the key was revoked
                raise _refused(args, publisher.refusal)
            if task.done():  # reading vLLM's events failed: say so, not go on feeding nothing
                raise _stopped(args, task)
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
        await publisher.flush(2.0)
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # done with the socket before it is closed
        await publisher.stop()
    return 0


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {flag} {path}: {exc.strerror or exc}; check the path") from None


def _refused(args, exc: grpc.aio.AioRpcError) -> Exception:
    kind = Unauthenticated if exc.code() == grpc.StatusCode.UNAUTHENTICATED else PermissionDenied
    return kind(f"the control plane refused the key in {args.api_key_file} ({exc.code().name}: {exc.details()}); "
                f"give a node key bound to --node-id {args.node_id} (kvmesh admin keys issue --role node --node "
                f"{args.node_id} --secret-out FILE)")


def _stopped(args, task: asyncio.Task) -> BaseException:
    """What ends the command when reading vLLM's events stopped: a ZMQ failure as :class:`Unavailable` naming
    --zmq; anything else (a bug) as it is, reported in one line by run_command."""
    exc = None if task.cancelled() else task.exception()
    if exc is None:
        return Unavailable(f"reading vLLM's events from --zmq {args.zmq} stopped; restart this command")
    if isinstance(exc, zmq.ZMQError):
        return Unavailable(f"reading vLLM's events from --zmq {args.zmq} failed ({exc.strerror}); check that vLLM "
                           "publishes there (--kv-events-config), then restart this command")
    return exc
