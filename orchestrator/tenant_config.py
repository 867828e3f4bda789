"""The topology's tenants, their keys and limits, and admission into the pools (the `auth`,
`tenants` and `admission` sections; see orchestrator.config for the whole document)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from orchestrator.strict import Strict as _Strict

KeyDigest = Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")]
PriorityClass = Literal["high", "normal", "low"]


class TenantLimits(_Strict):
    """Per-tenant limits, enforced by each ingress replica (null: no limit)."""

    requests_per_minute: int | None = Field(None, ge=1, description="Requests admitted per minute.")
    tokens_per_minute: int | None = Field(
        None, ge=1, description="Prompt plus completion tokens per minute. A request is charged "
        "its prompt and its max_tokens when admitted and refunded what it did not generate.")
    max_concurrent: int | None = Field(None, ge=1, description="Requests in flight at once.")
    max_prompt_tokens: int | None = Field(None, ge=1, description="Longest prompt accepted.")
    max_output_tokens: int | None = Field(
        None, ge=1, description="Largest max_tokens accepted; also the default when a request "
        "sets none.")


class TenantSpec(_Strict):
    """A customer of the gateway: its keys, what it may use, and how it shares the cluster."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$", description="Tenant name (a label).")
    api_keys: list[KeyDigest] = Field(
        default_factory=list, description="SHA-256 digests of the tenant's API keys, "
        "`sha256:<hex>` (`tokenfab hash-key` prints one); several for rotation. Keys can also "
        "come from auth.key_file.")
    models: list[str] | None = Field(None, description="Models the tenant may use; null: all.")
    weight: float = Field(1.0, gt=0, description="Share of the cluster when it is saturated.")
    priority: PriorityClass = Field(
        "normal", description="Queued requests of a higher class are admitted first.")
    cache_group: str | None = Field(
        None, pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$",
        description="Tenants naming the same group share prefix-cache hits; null: the tenant's "
        "prompts are cached apart from everyone else's.")
    limits: TenantLimits = Field(default_factory=TenantLimits)


class AuthSpec(_Strict):
    """How the gateway tells tenants apart."""

    enabled: bool = Field(
        False, description="Require an API key (Authorization: Bearer). Off: every request is "
        "tenant `default` (declare a tenant named default to give it limits).")
    key_file: str | None = Field(
        None, description="YAML mapping of tenant name to a list of key digests, read when the "
        "gateway starts (the Helm chart mounts its tenant-keys Secret here).")
    admin_keys: list[KeyDigest] = Field(
        default_factory=list, description="SHA-256 digests of admin keys (`tokenfab hash-key`). "
        "With auth enabled, /metrics and the /tokenfab/ routes (replicas, router, autoscaler, "
        "pd) answer only a request that presents one as Authorization: Bearer; `tokenfab "
        "status` sends TOKENFAB_ADMIN_KEY, the chart's ServiceMonitor its admin-key Secret. "
        "More can come from admin_key_file.")
    admin_key_file: str | None = Field(
        None, description="YAML list of admin key digests, read when the gateway starts (the "
        "Helm chart mounts its admin digests here).")
    salt_key_file: str | None = Field(
        None, description="File holding the secret (32 bytes or more) under which tenants' "
        "cache salts are derived, read when the gateway starts (the chart mounts "
        "saltKeySecret here). Null: a random key made once per application and kept in Ray's "
        "GCS, the same for every gateway until the cluster goes.")


class AdmissionSpec(_Strict):
    """Admission into the pools: beyond `max_in_flight`, requests wait in a fair queue."""

    max_in_flight: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        "auto", description="Requests one ingress replica lets into the pools at once; "
        "more wait, and tenants are served by weight on tokens (virtual token counters), higher "
        "priority classes first. auto: what the pools take at their largest (each model's "
        "unified and prefill pools' replicas times max_ongoing_requests, no more than its "
        "decode pools'), shared among the ingress replicas; a request beyond it waits at most "
        "queue_timeout_s instead of request_timeout_s, and tenants are weighed by their "
        "requests' output estimates (an int also counts their prompts' tokens). null: no queue: "
        "requests wait for a replica as long as request_timeout_s.")
    max_queued_per_tenant: int = Field(
        64, ge=0, description="Waiting requests per tenant; beyond, 429.")
    queue_timeout_s: float = Field(
        30.0, gt=0, description="Longest wait in the queue; beyond, 503.")
