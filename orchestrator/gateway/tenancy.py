"""Who is asking: API keys to tenants, what a tenant may use, and its prefix-cache salt.

Keys are stored as SHA-256 digests (`sha256:<hex>`), never in clear. A presented key is hashed
and compared with every stored digest in constant time (no early exit), so response timing says
nothing about the stored keys.

Cache isolation: vLLM hashes `cache_salt` into a prompt's first KV block, so requests with
different salts never share cached blocks. Every declared tenant's requests carry the salt of its
cache group (its own name unless it names a shared `cache_group`), joined to any salt the client
sent, so no client can choose another tenant's salt. The group's salt is an HMAC of the group's
name under the application's salt key: tenant and application names are not secret, so a salt
derived from them alone could be computed by anyone and sent to probe another tenant's cache.
The key comes from `auth.salt_key_file` or, by default, is made once per application and kept
in Ray's GCS (`salt_key`).
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import yaml

from channel.secret import cluster_secret
from orchestrator.gateway.errors import GatewayError
from orchestrator.config import Topology
from orchestrator.tenant_config import TenantSpec

DEFAULT_TENANT = "default"
MIN_SALT_KEY_BYTES = 32


def salt_key(topology: Topology) -> bytes:
    """The key under which cache salts are derived: `auth.salt_key_file`'s bytes, or else the
    application's random key in the GCS. Blocking: call it off the event loop."""
    path = topology.auth.salt_key_file
    if path is None:
        return cluster_secret(f"cache-salt-key/{topology.name}")
    key = Path(path).expanduser().read_bytes().strip()
    if len(key) < MIN_SALT_KEY_BYTES:
        raise ValueError(f"auth.salt_key_file {path}: {len(key)} bytes, at least "
                         f"{MIN_SALT_KEY_BYTES} needed")
    return key


def hash_key(key: str) -> str:
    """The digest a topology stores for an API key."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def read_admin_key_file(path: str | Path) -> list[str]:
    """An admin key file: a YAML list of key digests."""
    data = yaml.safe_load(Path(path).expanduser().read_text()) or []
    if not isinstance(data, list) or not all(isinstance(k, str) and k.startswith("sha256:")
                                             for k in data):
        raise ValueError(f"{path}: expected a list of admin key digests (sha256:<hex>)")
    return list(data)


def read_key_file(path: str | Path) -> dict[str, list[str]]:
    """A key file: a YAML mapping of tenant name to a list of key digests."""
    data = yaml.safe_load(Path(path).expanduser().read_text()) or {}
    if not isinstance(data, dict) or not all(
            isinstance(keys, list) and all(isinstance(k, str) for k in keys)
            for keys in data.values()):
        raise ValueError(f"{path}: expected a mapping of tenant name to a list of key digests")
    return {str(name): list(keys) for name, keys in data.items()}


def _bearer_digest(authorization: str) -> str | None:
    """The digest of the key an `Authorization: Bearer <key>` header presents; None if it
    presents none."""
    scheme, _, key = authorization.partition(" ")
    return hash_key(key.strip()) if scheme.lower() == "bearer" and key.strip() else None


class Tenants:
    """The tenants of one topology, with their keys (topology and key file merged)."""

    def __init__(self, topology: Topology, extra_keys: dict[str, list[str]] | None = None,
                 salt_key: bytes | None = None, extra_admin_keys: list[str] | None = None
                 ) -> None:
        self.auth = topology.auth.enabled
        self._salt_key = salt_key
        self._admin_digests = [*topology.auth.admin_keys, *(extra_admin_keys or [])]
        self._app = topology.name
        self._by_name = {tenant.name: tenant for tenant in topology.tenants}
        self._implicit_default = DEFAULT_TENANT not in self._by_name
        self.default = self._by_name.get(DEFAULT_TENANT) or TenantSpec(name=DEFAULT_TENANT)
        self._by_digest: dict[str, TenantSpec] = {}
        for tenant in topology.tenants:
            for digest in tenant.api_keys:
                self._by_digest[digest] = tenant
        for name, digests in (extra_keys or {}).items():
            if name not in self._by_name:
                raise ValueError(f"key file names tenant {name!r}, which the topology lacks")
            for digest in digests:
                self._by_digest[digest] = self._by_name[name]

    @classmethod
    def from_topology(cls, topology: Topology, salt_key: bytes) -> Tenants:
        auth = topology.auth
        keys = read_key_file(auth.key_file) if auth.key_file else None
        admin = read_admin_key_file(auth.admin_key_file) if auth.admin_key_file else None
        return cls(topology, keys, salt_key, admin)

    def spec(self, name: str) -> TenantSpec:
        return self._by_name.get(name, self.default)

    @property
    def names(self) -> list[str]:
        return sorted({*self._by_name, self.default.name})

    def authenticate(self, authorization: str | None) -> TenantSpec:
        """The tenant an `Authorization: Bearer <key>` header names; 401 if none does."""
        if not self.auth:
            return self.default
        if not authorization:
            raise GatewayError(401, "missing API key: send Authorization: Bearer <key>",
                               code="invalid_api_key")
        digest = _bearer_digest(authorization)
        if digest is None:
            raise GatewayError(401, "malformed Authorization header: expected Bearer <key>",
                               code="invalid_api_key")
        found = self._tenant_of(digest)
        if found is None:
            raise GatewayError(401, "invalid API key", code="invalid_api_key")
        return found

    def authenticate_admin(self, authorization: str | None) -> None:
        """Pass a request that presents an admin key (`auth.admin_keys`); with auth off, every
        request. 401 without a key or with an unknown one, 403 with a tenant's key."""
        if not self.auth:
            return
        digest = _bearer_digest(authorization or "")
        if digest is None:
            raise GatewayError(401, "missing admin key: send Authorization: Bearer <admin key>",
                               code="invalid_api_key")
        admin = False
        for stored in self._admin_digests:  # every digest, each in constant time
            admin |= hmac.compare_digest(stored, digest)
        if admin:
            return
        if self._tenant_of(digest) is not None:
            hint = "" if self._admin_digests else " (none is configured: auth.admin_keys)"
            raise GatewayError(403, f"this route needs an admin key, not a tenant's{hint}",
                               code="admin_key_required")
        raise GatewayError(401, "invalid admin key", code="invalid_api_key")

    def _tenant_of(self, digest: str) -> TenantSpec | None:
        found = None
        for stored, tenant in self._by_digest.items():  # every digest, each in constant time
            if hmac.compare_digest(stored, digest):
                found = tenant
        return found

    def authorize(self, tenant: TenantSpec, model: str) -> None:
        """403 unless the tenant may use `model`."""
        if tenant.models is not None and model not in tenant.models:
            raise GatewayError(403, f"tenant {tenant.name} may not use model {model!r}",
                               "model", code="model_not_allowed")

    def cache_salt(self, tenant: TenantSpec, client_salt: str | None) -> str | None:
        """The salt the engine sees: the tenant's cache group's, then the client's own. The
        implicit tenant of a topology without auth shares one cache, as a bare engine does."""
        if tenant is self.default and self._implicit_default:
            return client_salt
        if not self._salt_key:
            raise RuntimeError("tenant cache salts need the application's salt key")
        group = tenant.cache_group or f"tenant:{tenant.name}"
        salt = hmac.new(self._salt_key, f"tokenfab/{self._app}/{group}".encode(),
                        hashlib.sha256).hexdigest()[:32]
        return f"{salt}.{client_salt}" if client_salt else salt
