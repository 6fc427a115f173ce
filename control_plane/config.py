"""Configuration of the control-plane service (env prefix ``KVMESH_CP_``)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ControlPlaneConfig(BaseSettings):
    """Every field can be set as ``KVMESH_CP_<FIELD>`` or a ``--<field>`` flag."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_CP_", extra="forbid")

    listen: str = Field("127.0.0.1:50051", description="host:port the gRPC server binds (port 0: any free port)")
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="block-map store: redis://host:port/db, or redis+cluster://host:port for a Redis Cluster",
    )
    redis_username: str | None = Field(None, description="Redis ACL user of the control plane")
    redis_password: str | None = Field(None, description="its password")
    key_prefix: str = Field("kvm", description="prefix of every Redis key kvmesh writes")
    lease_ms: int = Field(10_000, ge=500, description="node lease; nodes heartbeat well within it")
    max_batch_blocks: int = Field(65_536, ge=1, description="most block hashes one event batch may carry")
    max_lookup_blocks: int = Field(65_536, ge=1, description="most blocks one LookupPrefix may ask about")
    gc_interval_s: float = Field(5.0, gt=0, description="how often expired leases are reaped and fenced entries swept")
