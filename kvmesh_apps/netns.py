"""Hosts on one machine as Linux network namespaces, and the faults a real network has (root only).

:class:`Network` builds a switch (a bridge inside its own namespace, so the host's firewall never sees the
bridged traffic), a leg from this (root) namespace to it, and one namespace per host with one veth
(``kv0``) on the switch. Processes run in a host with :meth:`Network.prefix` (``ip netns exec``). Faults:
:meth:`delay` (``tc netem``, or NFQUEUE and :mod:`kvmesh_apps.netdelay` where the kernel has no netem),
:meth:`limit_rate` (``tc tbf``), :meth:`lose` and :meth:`drop` (iptables rules in the host's namespace).
:meth:`close` removes everything and runs however the caller ends (context manager and ``atexit``);
namespaces left by a killed run (its pid is in their names) are removed by the next one.

    with Network() as net:
        n1 = net.add_host("n1")                 # Host(name="n1", ip="10.213.K.11", netns="kf1234n1")
        subprocess.Popen([*net.prefix(n1), "python", ...])
        net.limit_rate(n1, "100mbit")           # egress of n1
        net.drop(n1, "INPUT", ["-p", "tcp", "--dport", "7000"])
"""

from __future__ import annotations

import atexit
import os
import random
import re
import subprocess
import sys
from dataclasses import dataclass, field

IFACE = "kv0"
_NAME = re.compile(r"^kf(\d+)[a-z]")


def _delay_rule(op: str) -> list[str]:
    """The iptables rule handing the host's arriving packets to netdelay (mangle table: :meth:`Network.undrop`
    flushes the filter table's chains, and must not take the delay with them)."""
    return ["-t", "mangle", op, "PREROUTING", "-i", IFACE, "-j", "NFQUEUE", "--queue-num", "7", "--queue-bypass"]


@dataclass(frozen=True)
class Host:
    name: str
    ip: str
    netns: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Deletes namespaces (and host legs) that a run whose process is gone left behind."""
    removed = []
    for line in _ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = _NAME.match(name)
        if match and not _alive(int(match.group(1))):
            _ip("netns", "delete", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show").stdout.splitlines():
        match = re.search(r"^\d+: (kh(\d+))[@:]", line)
        if match and not _alive(int(match.group(2))):
            _ip("link", "delete", match.group(1), check=False)
    return removed


@dataclass
class Network:
    """A /24 of hosts behind one switch; this namespace is ``host_ip`` (.1) on it."""

    hosts: dict[str, Host] = field(default_factory=dict)
    octet: int = field(default_factory=lambda: random.randint(16, 250))

    def __post_init__(self) -> None:
        self._tag = f"kf{os.getpid()}"
        self.switch = f"{self._tag}sw"
        self.leg = f"kh{os.getpid()}"
        self._open = False
        self._delayers: dict[str, subprocess.Popen] = {}

    @property
    def host_ip(self) -> str:
        return f"10.213.{self.octet}.1"

    def open(self) -> "Network":
        if os.geteuid() != 0:
            raise PermissionError("network namespaces need root")
        remove_stale()
        atexit.register(self.close)
        self._open = True
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        _ip("link", "add", self.leg, "type", "veth", "peer", "name", "h0", "netns", self.switch)
        _ip("addr", "add", f"{self.host_ip}/24", "dev", self.leg)
        _ip("link", "set", self.leg, "up")
        _ip("-n", self.switch, "link", "set", "h0", "master", "br0")
        _ip("-n", self.switch, "link", "set", "h0", "up")
        return self

    def add_host(self, name: str) -> Host:
        if not re.fullmatch(r"[a-z][a-z0-9]{0,3}", name) or name in self.hosts:
            raise ValueError(f"host name {name!r}: 1-4 lowercase letters/digits, unique")
        host = Host(name, f"10.213.{self.octet}.{10 + len(self.hosts)}", f"{self._tag}{name}")
        port = f"p{len(self.hosts)}"
        _ip("netns", "add", host.netns)
        _ip("-n", host.netns, "link", "set", "lo", "up")
        _ip("link", "add", IFACE, "netns", host.netns, "type", "veth", "peer", "name", port, "netns", self.switch)
        _ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", IFACE)
        _ip("-n", host.netns, "link", "set", IFACE, "up")
        _ip("-n", self.switch, "link", "set", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", port, "up")
        self.hosts[name] = host
        return host

    @staticmethod
    def prefix(host: Host) -> list[str]:
        """Command prefix that runs a program inside ``host``."""
        return ["ip", "netns", "exec", host.netns]

    def run(self, host: Host, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix(host), *args], check=True, capture_output=True, text=True)

    def shape(self, host: Host, netem: str) -> None:
        """``tc netem`` on the host's egress, e.g. "delay 20ms". NotImplementedError where the kernel has no
        sch_netem (this machine's Firecracker kernel has none: loss and rate then come from :meth:`lose` and
        :meth:`limit_rate`, and delay cannot be injected)."""
        result = subprocess.run([*self.prefix(host), "tc", "qdisc", "replace", "dev", IFACE, "root", "netem",
                                 *netem.split()], capture_output=True, text=True)
        if result.returncode != 0:
            raise NotImplementedError(f"tc netem: {result.stderr.strip()}")

    def delay(self, host: Host, ms: float) -> None:
        """Adds ``ms`` to the host's link: ``tc netem`` on its egress where the kernel has it, else an NFQUEUE
        rule on its ingress and :mod:`kvmesh_apps.netdelay` holding each packet's verdict for ``ms``. Either
        way two delayed hosts are ``2 * ms`` RTT apart.

        Ingress, not egress: a packet held on the sender's output path still counts against its socket
        (TCP Small Queues), so the sender sees a slow local queue rather than a long link: TSQ lets only
        a few packets out per hold, BBR measures that as the path's bandwidth and paces to it, and a 2 MiB
        transfer over "40 ms" ran at ~2.5 Mbit/s (netem avoids this by orphaning the packets it holds). A
        packet held on arrival belongs to no local socket."""
        try:
            self.shape(host, f"delay {ms}ms")
            return
        except NotImplementedError:
            pass
        proc = subprocess.Popen([*self.prefix(host), sys.executable, "-m", "kvmesh_apps.netdelay", "--queue", "7",
                                 "--delay-ms", str(ms)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = proc.stdout.readline()
        if "ready" not in line:
            proc.kill()
            raise NotImplementedError(f"netdelay did not start: {line.strip()} {proc.stdout.read()[-500:]}")
        self._delayers[host.name] = proc
        self.run(host, "iptables", "-w", *_delay_rule("-A"))

    def undelay(self, host: Host) -> None:
        subprocess.run([*self.prefix(host), "iptables", "-w", *_delay_rule("-D")], capture_output=True)
        proc = self._delayers.pop(host.name, None)
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.unshape(host)

    def limit_rate(self, host: Host, rate: str) -> None:
        """A token bucket on the host's egress, e.g. "100mbit" (sch_tbf)."""
        self.run(host, "tc", "qdisc", "replace", "dev", IFACE, "root", "tbf", "rate", rate, "burst", "64kb",
                 "latency", "500ms")

    def unshape(self, host: Host) -> None:
        subprocess.run([*self.prefix(host), "tc", "qdisc", "del", "dev", IFACE, "root"], capture_output=True)

    def lose(self, host: Host, fraction: float) -> None:
        """Drops each packet the host sends or receives with probability ``fraction`` (iptables statistic)."""
        for chain in ("INPUT", "OUTPUT"):
            self.drop(host, chain, ["-m", "statistic", "--mode", "random", "--probability", str(fraction)])

    def drop(self, host: Host, chain: str, match: list[str]) -> None:
        """Drops the packets of ``chain`` (INPUT or OUTPUT) in ``host`` that ``match`` (iptables syntax)."""
        self.run(host, "iptables", "-w", "-A", chain, *match, "-j", "DROP")

    def undrop(self, host: Host) -> None:
        for chain in ("INPUT", "OUTPUT"):
            subprocess.run([*self.prefix(host), "iptables", "-w", "-F", chain], capture_output=True)

    def tx_bytes(self, host: Host) -> int:
        """Bytes the host has sent on its network interface (proof that traffic crossed the veth)."""
        return int(self.run(host, "cat", f"/sys/class/net/{IFACE}/statistics/tx_bytes").stdout)

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        for host in list(self.hosts.values()):
            self.undelay(host)
            _ip("netns", "delete", host.netns, check=False)
        _ip("link", "delete", self.leg, check=False)
        _ip("netns", "delete", self.switch, check=False)
        self.hosts.clear()

    def __enter__(self) -> "Network":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()
