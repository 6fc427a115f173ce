"""Adds a fixed delay to a network namespace's packets where the kernel has no ``sch_netem``.

``python -m kvmesh_apps.netdelay --queue N --delay-ms D`` (run inside the namespace, as root) takes the packets
an iptables ``NFQUEUE --queue-num N`` rule hands it and gives each back to the kernel D ms after it arrived, in
order. Packets stay on the kernel's network path (the kernel holds them; this process only times the
verdicts and copies no payload). :meth:`kvmesh_apps.netns.Network.delay` starts it and installs the rule, on
the host's ingress (it says why).
"""

from __future__ import annotations

import argparse
import collections
import os
import select
import socket
import sys
import time

from netfilterqueue import COPY_META, NetfilterQueue


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvmesh_apps.netdelay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--queue", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, required=True)
    args = parser.parse_args(argv)
    delay = args.delay_ms / 1000
    held: collections.deque = collections.deque()  # (due, packet): one delay for all, so arrival order is due order

    def arrived(packet) -> None:
        held.append((time.monotonic() + delay, packet))

    try:  # it plays the wire: a busy host must not stretch the delay (falls back to a normal priority)
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (PermissionError, OSError):
        pass
    queue = NetfilterQueue()  # metadata only: a verdict needs no payload copied to this process
    queue.bind(args.queue, arrived, max_len=65536, mode=COPY_META, range=0)
    sock = socket.fromfd(queue.get_fd(), socket.AF_NETLINK, socket.SOCK_RAW)
    sock.setblocking(False)
    print("netdelay ready", flush=True)
    try:
        while True:
            timeout = max(0.0, held[0][0] - time.monotonic()) if held else 1.0
            readable, _, _ = select.select([sock], [], [], timeout)
            if readable:
                queue.run(block=False)
            now = time.monotonic()
            while held and held[0][0] <= now:
                held.popleft()[1].accept()
    except KeyboardInterrupt:
        pass
    finally:
        for _, packet in held:
            packet.accept()
        queue.unbind()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
