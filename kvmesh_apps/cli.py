"""The ``kvmesh`` command: services, benchmarks, the demo and the admin tools.

Each subcommand lives in its own module and is imported only when run, so
``kvmesh control-plane`` never imports vLLM and ``kvmesh demo`` starts fast.
Every subcommand runs through :func:`kvmesh.command_line.run_command`: whatever
stops it is one line ``kvmesh <subcommand>: error: <what>; <how to fix>``.
"""

from __future__ import annotations

import importlib
import sys

from kvmesh.command_line import UsageError, report, run_command

# name -> (module, function, help). The function takes argv (list[str]) and returns an exit code.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "control-plane": ("control_plane.server", "main", "run the control-plane gRPC service"),
    "data-plane": ("data_plane.server", "main", "run one node's data-plane gRPC service"),
    "vllm-events": ("control_plane.vllm_events", "main", "feed a stock vLLM's ZMQ KV events into the control plane"),
    "admin": ("tenancy.cli", "main", "tenant administration: tenants, keys, policies, audit"),
    "demo": ("kvmesh_apps.demo", "main", "start a local fleet on embedded defaults and run a scenario"),
    "up": ("kvmesh_apps.up", "main", "run the docker-compose topology as local processes (Ctrl-C stops it)"),
}

BENCHMARKS: dict[str, tuple[str, str, str]] = {
    "control-plane": ("kvmesh_apps.bench.control_plane", "main", "block-map lookup latency, ingest rate, Redis bytes per block"),
    "engine": ("kvmesh_apps.bench.engine", "main", "decode speed of running requests during pulls, frozen source, coalescing (vLLM)"),
    "pull": ("kvmesh_apps.bench.pull", "main", "NIXL peer pull throughput against memcpy"),
    "faults": ("kvmesh_apps.bench.faults", "main", "the fault matrix across network namespaces (root)"),
    "load": ("kvmesh_apps.bench.load", "main", "control-plane saturation, replicas, Redis Cluster, churn soak"),
    "scale": ("kvmesh_apps.bench.scale", "main", "10M blocks over 1,000 nodes on Redis and a Redis Cluster: bytes, lookups, failover"),
    "replay": ("kvmesh_apps.replay.bench", "main", "policies compared on a Mooncake trace (simulated engines), swept"),
    "sim-to-real": ("kvmesh_apps.bench.sim_to_real", "main", "the replay simulator's TTFT against real vLLM CPU engines"),
    "routing": ("kvmesh_apps.bench.routing", "main", "policies on real vLLM CPU engines over shaped links (root)"),
    "prefetch": ("kvmesh_apps.bench.prefetch", "main", "route-time prefetch vs pull-on-ask vs recompute: TTFT (vLLM, shaped link, root)"),
}


HELP = ("-h", "--help", "help")


def _bench_usage() -> list[str]:
    lines = ["  bench NAME       run a benchmark (--json ends with one JSON object):"]
    return lines + [f"    {name:<14} {help_}" for name, (_, _, help_) in BENCHMARKS.items()]


def _usage() -> str:
    lines = ["usage: kvmesh COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<16} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines + _bench_usage())


def _run(table: dict[str, tuple[str, str, str]], prog: str, name: str, argv: list[str]) -> int:
    if name not in table:
        what, lister = ("benchmark", "kvmesh bench --help") if table is BENCHMARKS else ("command", "kvmesh --help")
        return report(prog.rsplit(' ', 1)[0], UsageError(f"unknown {what} {name!r}; `{lister}` lists them"))
    module, func, _ = table[name]
    try:
        entry = getattr(importlib.import_module(module), func)
    except ImportError as exc:
        return report(prog, UsageError(f"not available in this install ({exc}); run `make setup`"))
    return run_command(prog, entry, argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in HELP:
        print(_usage())
        return 0
    if argv[0] == "bench":
        if len(argv) >= 2 and argv[1] in HELP:
            print("\n".join(["usage: kvmesh bench NAME [ARGS...]  (kvmesh bench NAME --help: its flags)", ""]
                            + _bench_usage()[1:]))
            return 0
        if len(argv) < 2:
            return report("kvmesh bench", UsageError("no benchmark named; `kvmesh bench --help` lists them"))
        return _run(BENCHMARKS, f"kvmesh bench {argv[1]}", argv[1], argv[2:])
    return _run(COMMANDS, f"kvmesh {argv[0]}", argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
