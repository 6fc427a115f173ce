"""Configuration of one node's data plane (env prefix ``KVMESH_DP_``, or ``--flags``)."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import replace
from pathlib import Path
from typing import Literal

from pydantic import ByteSize, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvmesh.addresses import check_address, split_host_port
from kvmesh.channels import ClientTLS
from kvmesh.errors import InvalidArgument
from kvmesh.metrics import METRICS_LISTEN_HELP, MetricsListen
from kvmesh.namespace import validate_node_id
from tenancy import api_keys

MIB = 1 << 20


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


class DataPlaneConfig(BaseSettings):
    """Every field can be set as ``KVMESH_DP_<FIELD>`` or a ``--<field>`` flag."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_DP_", extra="forbid")

    node_id: str = Field(default_factory=socket.gethostname, description="this node's id in the fleet")
    listen: str = Field("127.0.0.1:0", description="host:port the gRPC server binds (port 0: any free port)")
    advertise_address: str = Field(
        "", description="host[:port] peers and the control plane use to reach this node (default: the listen "
        "host; required when listening on a wildcard address); the port defaults to the bound one")
    block_bytes: int = Field(2 * MIB, ge=1, description="bytes of one KV block (one slot); every peer must agree")
    capacity_bytes: ByteSize = Field(ByteSize(1 << 30), description="size of the CPU tier, e.g. 8GiB")
    block_tokens: int = Field(0, ge=0, description="tokens per block; namespaces with another block_size are "
                              "rejected (0: accept any)")
    shm_dir: Path = Field(Path("/dev/shm"), description="tmpfs directory of the shared-memory region file")
    lock_memory: bool = Field(True, description="mlock the CPU tier (warns and continues when not permitted)")
    eviction_policy: str = Field("lru", description="CPU-tier policy: lru, arc, cost_aware or an installed one")
    disk_dir: Path | None = Field(None, description="directory of the disk tier's file (unset: no disk tier)")
    disk_capacity_bytes: ByteSize = Field(ByteSize(0), description="size of the disk tier (required with disk_dir)")
    disk_eviction_policy: str = Field("lru", description="disk-tier policy")
    lease_ms: int = Field(10_000, ge=1, description="default pin lease of a Lookup or Acquire")
    max_lease_ms: int = Field(60_000, ge=1, description="longest lease a caller may ask for")
    pending_wait_ms: int = Field(200, ge=0, description="wait on HIT_PENDING blocks: a Lookup's default here, and "
                                 "what this node asks a source for when it pulls")
    max_pending_wait_ms: int = Field(2_000, ge=0, description="longest such wait a caller may ask for")
    pull_timeout_ms: int = Field(10_000, ge=1, description="default overall bound of a Pull")
    max_pull_timeout_ms: int = Field(60_000, ge=1, description="longest Pull bound a caller may ask for")
    max_hashes_per_request: int = Field(4096, ge=1, description="most block hashes one request may carry")
    serve_peer_reads: bool = Field(False, description="hand peers this node's NIXL metadata so they READ blocks "
                                   "one-sided (ungated: a peer that once handshook can read every tenant's blocks "
                                   "until restart; trusted single-tenant fleets only). Off: this node WRITEs each "
                                   "block a peer's grant covers into the peer's landing slots")
    landing_bytes_per_source: ByteSize = Field(
        ByteSize(0), description="memory each source node this node pulls from WRITEs into (its landing arena, "
        "apart from the CPU tier; taken only as it is written); a pull brings at most what is free there, the rest "
        "is recomputed (0: an eighth of capacity_bytes, at least 256 MiB, at most capacity_bytes)")
    max_landing_sources: int = Field(64, ge=1, description="source nodes this node keeps a landing arena for; a "
                                     "pull from one more answers MISS and has the node replace its NIXL agent once "
                                     "no pull or send runs (every arena goes with it; peers handshake again)")
    landing_renewals_per_source: int = Field(
        4, ge=0, description="times one source's landing arena is replaced by a fresh one when its failed transfers "
        "hold half of it or more (transfers that may still write, e.g. timed out on a cut path), per NIXL agent; "
        "the old arena's pages go back to the OS; then the source is pulled from again only once it proves them "
        "over")
    verify_pulls: bool = Field(True, description="check each pulled block's CRC-32C before committing it")
    verify_threads: int = Field(0, ge=0, description="threads that share the copy and CRC-32C check of one pull "
                                "(or Acquire); 0: one per CPU this process may run on, at most 4")
    transfer_lanes: int = Field(1, ge=1, le=16, description="NIXL transfer requests (each on a UCX worker of its "
                                "own, posted at once from as many threads) one pull's or send's blocks are split into")
    transfer_piece_bytes: int = Field(0, ge=0, description="a send's WRITE goes in pieces of at most this many "
                                      "bytes, each reported landed to the consumer, which checks it while the rest "
                                      "moves if its own transfer_piece_bytes is set too (0: one request per lane, "
                                      "checked once it all landed; pieces cost more than they save on a host "
                                      "without an idle core: docs/data_plane.md)")
    nixl_progress_wait_ms: int = Field(
        100, ge=1, le=10_000, description="longest sleep of NIXL's progress thread between checks when no UCX "
        "event wakes it (it wakes at once on one); small values cost idle CPU")
    lease_sweep_ms: int = Field(250, ge=1, description="how often expired leases are released")
    reclaim_retry_ms: int = Field(1_000, ge=1, description="first wait before asking a source whether slots "
                                  "of its landing arena held after its transfer failed can be reused; doubles "
                                  "per answer that does not prove it")
    reclaim_max_retry_ms: int = Field(60_000, ge=1, description="longest such wait")
    reclaim_timeout_ms: int = Field(2_000, ge=1, description="bound of one such question")
    control_plane_address: str = Field("", description="host:port of the control plane (unset: publish nothing)")
    control_plane_timeout_ms: int = Field(
        2_000, ge=1, description="longest wait for one control-plane answer (tenant limits, a pull grant)")
    control_plane_refresh_ms: int = Field(
        10_000, ge=1, description="tenant limits stay fresh this long (then are revalidated in the background "
        "while the old answer is served); a failed control-plane call is not retried for this long; also how often "
        "the node asks for the epoch of every tenant it holds blocks of (the bound on a re-created tenant's local "
        "access to old blocks)")
    pool: str = Field("", description="pool this node registers in")
    api_key: str | None = Field(None, description="this node's API key (role node): local callers must present it, "
                                                  "and it authenticates the node to the control plane and to peers")
    api_key_file: str | None = Field(None, description="file holding the API key, if api_key is unset")
    max_calls_in_flight_per_key: int = Field(1024, ge=1, description="calls (a stream: until it ends) one API key, "
                                             "or one peer (its client certificate with mutual TLS, else its host), "
                                             "may have in flight here; past it a call answers "
                                             "RESOURCE_EXHAUSTED (every engine of the node calls with the node's "
                                             "key, one task per request)")
    max_connections: int = Field(4096, ge=1, description="connections served at once; past it a new one is "
                                 "closed as it arrives (the process's open-file limit is raised to fit, or the "
                                 "cap lowered to it); a connection with no call for 60 s is closed")
    max_request_bytes: int = Field(2**20, ge=2**20, le=64 * 2**20, description="largest request message "
                                   "accepted (gRPC refuses a larger one as it arrives, RESOURCE_EXHAUSTED); the "
                                   "largest the protocol needs is a request of max_hashes_per_request hashes")
    max_request_bytes_in_flight_per_key: int = Field(2**30, ge=2**20, description="bytes of requests the node's "
                                                     "own key, or one peer host, may have being read or served here "
                                                     "(each call sets aside max_request_bytes while its request is "
                                                     "read); past it a call waits, then answers RESOURCE_EXHAUSTED")
    metrics_listen: MetricsListen = Field("", description=METRICS_LISTEN_HELP)
    tls_cert_file: str | None = Field(None, description="this node's certificate (PEM): serve TLS, and present it "
                                      "to peers and the control plane that require mutual TLS")
    tls_key_file: str | None = Field(None, description="its private key (PEM)")
    tls_client_ca_file: str | None = Field(None, description="CA for client certificates: require mutual TLS")
    tls_ca_file: str | None = Field(None, description="CA that signs the control plane's and peers' certificates: "
                                    "connect to them over TLS (unset: plaintext)")
    tls_server_name: str | None = Field(None, description="name to check in the control plane's certificate "
                                        "(and, with peer_tls_name address, peers') instead of the host in the address")
    peer_tls_name: Literal["node-id", "address"] = Field(
        "node-id", description="what a peer's certificate must name (a DNS name): node-id, the node id this node "
        "dials it as (a node's certificate answers for that node alone); address: the host in its address, or "
        "tls_server_name (any certificate of the CA naming it answers as every node)")
    grant_public_key: str = Field("", description="base64 Ed25519 key that verifies pull grants (unset: fetched "
                                                  "from the control plane)")
    require_route_token: bool = Field(False, description="pull only from sources a request names with a route "
                                      "token signed by the control plane's Route (kv_transfer_params."
                                      "remote_kv_source.route_token); off: any registered node may be named")
    grant_keys_refresh_s: float = Field(60.0, gt=0, description="how often the grant keys fetched from the control "
                                        "plane are refreshed (a rotation's overlap must be longer)")
    prefetch_enabled: bool = Field(True, description="start the pulls Route decided for this node's engine when the "
                                   "scheduler hands its order over (Prefetch); off: answer DISABLED")
    prefetch_timeout_ms: int = Field(10_000, ge=1, description="bound of a prefetch's pull: by then its slots are "
                                     "settled (committed as ordinary evictable cache, or freed)")
    prefetch_max_inflight_bytes: int = Field(0, ge=0, description="most bytes of prefetches running at once on this "
                                             "node (0: a quarter of capacity_bytes); beyond: OVER_CAP, not started; "
                                             "one tenant takes at most an equal share among the tenants asking "
                                             "(alone: all)")
    prefetch_use_window_ms: int = Field(30_000, ge=1, description="prefetched bytes no local engine acquired within "
                                        "this long after they landed are counted wasted (they stay ordinary cache)")

    def node_key(self) -> str:
        """The node's API key; ValueError when neither api_key nor api_key_file gives one."""
        key = api_keys.key_from_setting(self.api_key, self.api_key_file)
        if key:
            return key
        raise ValueError("no API key: set KVMESH_DP_API_KEY or --api-key-file (an admin issues node keys: "
                         "`kvmesh admin keys issue --role node --node <node_id>`)")

    def client_tls(self) -> ClientTLS | None:
        """TLS for this node's calls to the control plane (and to peers: :meth:`peer_tls`; None: plaintext)."""
        if not self.tls_ca_file:
            return None
        return ClientTLS(self.tls_ca_file, self.tls_cert_file, self.tls_key_file, self.tls_server_name)

    def peer_tls(self, node_id: str) -> ClientTLS | None:
        """TLS for calls to the peer ``node_id``: its certificate must name ``node_id`` (peer_tls_name node-id)."""
        tls = self.client_tls()
        if tls is None or self.peer_tls_name == "address":
            return tls
        return replace(tls, server_name=node_id)

    @property
    def num_slots(self) -> int:
        return int(self.capacity_bytes) // self.block_bytes

    @property
    def landing_slots(self) -> int:
        """Blocks of one source's landing arena."""
        if self.landing_bytes_per_source:
            return max(1, int(self.landing_bytes_per_source) // self.block_bytes)
        return min(self.num_slots, max(self.num_slots // 8, (256 * MIB) // self.block_bytes, 1))

    @property
    def prefetch_cap_bytes(self) -> int:
        return self.prefetch_max_inflight_bytes or int(self.capacity_bytes) // 4

    @property
    def disk_slots(self) -> int:
        return int(self.disk_capacity_bytes) // self.block_bytes if self.disk_dir else 0

    @property
    def shm_path(self) -> Path:
        return self.shm_dir / f"kvmesh-dp-{self.node_id}.tier"

    def advertised(self, bound_port: int) -> str:
        """The address peers use, with the bound port filled in."""
        host, port = split_host_port(self.advertise_address or self.listen)
        if not self.advertise_address or port is None:
            port = bound_port
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @model_validator(mode="after")
    def _check(self) -> "DataPlaneConfig":
        try:
            validate_node_id(self.node_id)  # as the control plane checks it; it also names the tier's file
        except InvalidArgument as exc:
            raise ValueError(str(exc)) from None
        if self.tls_ca_file and self.peer_tls_name == "node-id" and ":" in self.node_id:
            raise ValueError(f"node_id {self.node_id!r} cannot be a certificate's DNS name, which peers check "
                             "(peer_tls_name node-id): use a node id without ':'")
        if self.num_slots < 1:
            raise ValueError(f"capacity_bytes ({int(self.capacity_bytes)}) holds no block of {self.block_bytes}")
        if self.disk_dir is not None and self.disk_slots < 1:
            raise ValueError("disk_dir is set but disk_capacity_bytes holds no block")
        for low, high in (("lease_ms", "max_lease_ms"), ("pending_wait_ms", "max_pending_wait_ms"),
                          ("pull_timeout_ms", "max_pull_timeout_ms")):
            if getattr(self, low) > getattr(self, high):
                raise ValueError(f"{low} must not exceed {high}")
        check_address("listen", self.listen, port="any")
        if self.advertise_address:
            check_address("advertise_address", self.advertise_address, port="optional")
        if self.control_plane_address:
            check_address("control_plane_address", self.control_plane_address)
        self._check_advertised(split_host_port(self.listen)[0])
        return self

    def _check_advertised(self, listen_host: str) -> None:
        """Refuses an address peers cannot use: a wildcard, multicast, or loopback seen from elsewhere."""
        host, _ = split_host_port(self.advertise_address or self.listen)
        ip, listen_ip = _ip(host), _ip(listen_host)
        source = "advertise_address" if self.advertise_address else "listen (no advertise_address set)"
        if not host or (ip is not None and (ip.is_unspecified or ip.is_multicast or ip.is_reserved)):
            raise ValueError(f"{source} {host!r} is not an address peers can reach; set advertise_address")
        listen_is_loopback = listen_host == "localhost" or (listen_ip is not None and listen_ip.is_loopback)
        if (ip is not None and ip.is_loopback or host == "localhost") and not listen_is_loopback:
            raise ValueError(
                f"advertise_address {host!r} is loopback but the server listens on {listen_host!r}: peers on "
                "other hosts could not reach it; advertise a routable address")
