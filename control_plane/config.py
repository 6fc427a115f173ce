"""Configuration of the control-plane service (env prefix ``KVMESH_CP_``)."""

from __future__ import annotations

import hashlib
import hmac
import logging
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvmesh.addresses import check_address
from kvmesh.metrics import METRICS_LISTEN_HELP, MetricsListen

from control_plane.routing.config import RoutingSettings
from tenancy import api_keys
from tenancy.grants import GrantSigner, public_key_from_pem

log = logging.getLogger(__name__)


class ControlPlaneConfig(RoutingSettings, BaseSettings):
    """Every field can be set as ``KVMESH_CP_<FIELD>`` or a ``--<field>`` flag (``route_*``: docs/scheduling.md)."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_CP_", extra="forbid")

    listen: str = Field("127.0.0.1:50051", description="host:port the gRPC server binds (port 0: any free port)")

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        return check_address("listen", value, port="any")

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="block-map store: redis://host:port/db, or redis+cluster://host:port[,host:port...] for a "
        "Redis Cluster (name several nodes: the client rediscovers the cluster through them after a failover)",
    )
    redis_username: str | None = Field(None, description="Redis ACL user of the control plane")
    redis_password: str | None = Field(None, description="its password")
    redis_password_file: str | None = Field(None, description="file holding that password, if redis_password "
                                            "is unset (keeps it off command lines)")
    redis_acl_username: str | None = Field(None, description="Redis user allowed ACL SETUSER/DELUSER/SAVE only, "
                                           "used for tenant users (unset: the main user makes them)")
    redis_acl_password: str | None = Field(None, description="its password")
    redis_acl_password_file: str | None = Field(None, description="file holding it, if redis_acl_password is unset")
    tenant_secret_file: str | None = Field(None, description="file with the secret tenant Redis passwords are "
                                           "derived from, the same on every replica (unset: derived from the "
                                           "bootstrap admin key)")
    key_prefix: str = Field("kvm", description="prefix of every Redis key kvmesh writes")
    lease_ms: int = Field(10_000, ge=500, description="node lease; nodes heartbeat well within it")
    max_batch_blocks: int = Field(65_536, ge=1, description="most block hashes (and events) one event batch may carry")
    max_namespaces_per_tenant: int = Field(256, ge=1, description="most namespaces (model, weights, cache "
                                           "config) holding one tenant's blocks, unless its policy sets "
                                           "max_namespaces; a batch opening one more is RESOURCE_EXHAUSTED")
    max_entries_per_node: int = Field(4_194_304, ge=0, description="most blocks one node may hold in the block "
                                      "map (a block on two tiers counts once; 0: no limit); a batch storing past it "
                                      "is RESOURCE_EXHAUSTED. Bounds the map's Redis memory one node key can take")
    max_lookup_blocks: int = Field(65_536, ge=1, description="most blocks one LookupPrefix may ask about")
    max_lookup_tokens: int = Field(2_097_152, ge=1, description="most token ids one LookupPrefix or Route may "
                                   "carry (counted before they are read)")
    lookup_stream_window: int = Field(32, ge=1, le=1024, description="lookups of one LookupPrefixStream worked on at "
                                      "once (answers still go back in request order)")
    max_lookup_batch: int = Field(256, ge=1, le=65_536, description="most lookups one LookupPrefixBatches message "
                                  "may carry")
    max_calls_in_flight_per_key: int = Field(256, ge=1, description="calls (a stream: until it ends) one API key "
                                             "may have in flight here; past it a call answers RESOURCE_EXHAUSTED "
                                             "before its request is read")
    max_watches_per_key: int = Field(16, ge=1, description="WatchBlockMap streams one API key may have open here "
                                     "(each holds its namespace's snapshot, 12 bytes a block, while its reader "
                                     "does not read); past it a watch answers RESOURCE_EXHAUSTED")
    max_connections: int = Field(4096, ge=1, description="connections served at once; past it a new one is "
                                 "closed as it arrives (the process's open-file limit is raised to fit, or the "
                                 "cap lowered to it); a connection with no call for 60 s is closed")
    max_request_bytes: int = Field(16 * 2**20, ge=2**20, le=64 * 2**20, description="largest request message "
                                   "accepted (gRPC refuses a larger one as it arrives, RESOURCE_EXHAUSTED); the "
                                   "default holds a lookup of max_lookup_tokens token ids and an event batch of "
                                   "max_batch_blocks blocks with 32 token ids each")
    max_request_bytes_in_flight_per_key: int = Field(256 * 2**20, ge=2**20, description="bytes of requests one "
                                                     "API key may have being served here at once (a stream: its "
                                                     "current message); past it a call answers RESOURCE_EXHAUSTED "
                                                     "before its request is decoded")
    read_replica: bool = Field(True, description="answer lookups from an in-memory replica of the block map, "
                               "fed by Redis change streams (false: every lookup runs the Redis script)")
    gc_interval_s: float = Field(5.0, gt=0, description="how often expired leases are reaped and fenced entries swept")
    namespace_release_after_s: float = Field(600.0, ge=1.0, description="a namespace whose block map is empty and "
                                             "that no node has published to for this long stops counting against "
                                             "its tenant's namespace limit (checked every quarter of it); the "
                                             "next batch for it counts it again")
    admin_key: str | None = Field(
        None, description="bootstrap admin API key (kvm_<key_id>_<secret>; `kvmesh admin new-key` makes one)"
    )
    admin_key_file: str | None = Field(None, description="file holding the bootstrap admin key, if admin_key is unset")
    grant_ttl_ms: int = Field(30_000, ge=1000, description="lifetime of the pull grants this control plane signs")
    grant_key_file: str | None = Field(
        None, description="PEM file of the Ed25519 private key that signs pull grants (mode 0600); unset: a key "
        "generated in memory at start (grants die with the process, replicas disagree). Never stored in Redis")
    grant_previous_key_files: str = Field(
        "", description="comma-separated PEM files of earlier grant keys (public or private) still accepted during "
        "a rotation overlap")
    policy_ttl_s: float = Field(2.0, ge=0, description="how long a replica caches a tenant's policy (changes are "
                                "also pushed to every replica)")
    auth_cache_ttl_s: float = Field(5.0, ge=0, description="how long a verified API key is cached in process; "
                                    "revocations are pushed at once, this bounds a lost notification (0: no cache)")
    tls_cert_file: str | None = Field(None, description="server certificate (PEM): serve TLS")
    tls_key_file: str | None = Field(None, description="its private key (PEM)")
    tls_client_ca_file: str | None = Field(None, description="CA for client certificates: require mutual TLS")
    metrics_listen: MetricsListen = Field("", description=METRICS_LISTEN_HELP)

    def redis_secret(self) -> str | None:
        return api_keys.from_setting(self.redis_password, self.redis_password_file)

    def redis_acl_secret(self) -> str | None:
        return api_keys.from_setting(self.redis_acl_password, self.redis_acl_password_file)

    def tenant_secret(self) -> bytes:
        """What tenant Redis passwords are derived from (tenancy.redis_acl)."""
        if self.tenant_secret_file:
            return Path(self.tenant_secret_file).read_bytes().strip()
        return hmac.new(self.bootstrap_admin_key().encode(), b"kvmesh tenant redis secret", hashlib.sha256).digest()

    def grant_keys(self) -> tuple[GrantSigner, list[bytes]]:
        """The grant signer (from grant_key_file, or generated) and every public key grants may be verified
        with: the signer's first, then the previous ones. ValueError for an unreadable or exposed file."""
        if self.grant_key_file:
            signer = GrantSigner.from_file(self.grant_key_file)
        else:
            log.warning("no grant_key_file: signing pull grants with a key generated in memory")
            signer = GrantSigner.generate()
        previous = [public_key_from_pem(Path(f.strip()).read_bytes())
                    for f in self.grant_previous_key_files.split(",") if f.strip()]
        return signer, [signer.public_key, *(k for k in previous if k != signer.public_key)]

    def bootstrap_admin_key(self) -> str:
        """The admin key from admin_key or admin_key_file; ValueError when neither gives one."""
        key = api_keys.key_from_setting(self.admin_key, self.admin_key_file)
        if key:
            return key
        raise ValueError("no admin key: set KVMESH_CP_ADMIN_KEY or --admin-key-file "
                         "(`kvmesh admin new-key` prints a fresh one)")
