"""Redis keys of the tenant registry (hash tag ``{<prefix>-ten}``) and tenant ACL users."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TenantKeys:
    prefix: str = "kvm"

    @property
    def _ten(self) -> str:
        return f"{self.prefix}:{{{self.prefix}-ten}}"

    def tenant(self, tenant_id: str) -> str:
        return f"{self._ten}:tenant:{tenant_id}"

    @property
    def tenants(self) -> str:
        return f"{self._ten}:tenants"

    def api_key(self, key_id: str) -> str:
        return f"{self._ten}:key:{key_id}"

    @property
    def api_keys(self) -> str:
        return f"{self._ten}:keys"

    @property
    def legacy_grant_signing_key(self) -> str:
        """Where earlier versions kept the grant-signing key: deleted at start (the key lives in a file)."""
        return f"{self._ten}:grant-signing-key"

    @property
    def changes(self) -> str:
        """Pub/sub channel announcing revoked keys and changed tenants (tenancy.key_cache)."""
        return f"{self._ten}:changes"

    @property
    def audit(self) -> str:
        return f"{self._ten}:audit"

    def redis_user(self, tenant_id: str) -> str:
        return f"{self.prefix}-t-{tenant_id}"
