"""Admission of one request: who sends it, may it, and when it may enter the pools.

In order: the API key names a tenant (401), the tenant may use the model (403), the prompt and
output fit the tenant's size limits (400), its rate and concurrency allowance covers the request
(429 with Retry-After), and the fair queue gives it a slot (429 if the tenant's queue is full, 503
after the queue timeout). The body leaves with the tenant's cache salt and, if the client set no
output length, the tenant's `max_output_tokens`. `finish` gives back what the request did not use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

from channel.frames import Usage
from orchestrator.gateway.errors import GatewayError
from orchestrator.gateway.fair_queue import FairQueue
from orchestrator.gateway.limits import Charge, TenantLimiter
from orchestrator.gateway.metrics import REJECTION_REASONS, UNKNOWN_TENANT, GatewayMetrics
from orchestrator.gateway.tenancy import Tenants
from orchestrator.config import Topology
from orchestrator.pool_config import PoolSpec
from orchestrator.tenant_config import TenantSpec

DEFAULT_OUTPUT_ESTIMATE = 256  # tokens charged up front when a request sets no max_tokens
_OUTPUT_FIELDS = {"completions": "max_tokens", "chat": "max_completion_tokens"}


@dataclass
class Ticket:
    """An admitted request: what it was charged, to settle when it ends."""

    tenant: TenantSpec
    charge: Charge
    cost: float
    queued_s: float
    model: str = "-"  # the model or adapter the request named
    settled: bool = False


def requested_output(endpoint: str, body: dict[str, Any]) -> int | None:
    """max_tokens (or, for chat, max_completion_tokens) if the request sets a number."""
    for name in (_OUTPUT_FIELDS[endpoint], "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def choices(body: dict[str, Any]) -> int:
    """How many completions each prompt asks for (`n`, or `best_of` when larger)."""
    counts = [body.get(name) for name in ("n", "best_of")]
    return max([c for c in counts if isinstance(c, int) and not isinstance(c, bool) and c > 0],
               default=1)


def cost_tokens(prompt_lengths: list[int], output: int | None, choices: int,
                max_model_len: int) -> int:
    """Tokens charged up front: every prompt, plus for each its outputs (`output`, or
    DEFAULT_OUTPUT_ESTIMATE when unset, at most what fits beside the prompt) times `choices`.

    Example: prompts of 100 and 300 tokens, max_tokens 50, n 2, max_model_len 2048 ->
    400 + 2 x (50 + 50) = 600. Without counted prompts ([]), one output: 50 x 2 = 100.
    """
    per_output = DEFAULT_OUTPUT_ESTIMATE if output is None else max(0, output)
    outputs = [min(max(0, max_model_len - length), per_output) for length in prompt_lengths]
    return sum(prompt_lengths) + choices * (sum(outputs) if prompt_lengths else per_output)


def pool_capacity(topology: Topology, live: Mapping[str, int] | None = None) -> int:
    """Requests the pools take at once at their largest (admission.max_in_flight: auto): per
    served model, its unified and prefill pools' replicas times their max_ongoing_requests, the
    prefill pools' share no more than its decode pools' (a P/D request holds a place in both);
    summed over the models. An autoscaled pool counts its max_replicas; a fixed one the replicas
    `live` lists for it (the registry's), else its `replicas`. A running application needs
    `live`: its deployed document carries every fixed pool at one replica, the counts travelling
    beside it (orchestrator.deploy).

    Example: a unified pool of 2 replicas taking 64 each, and a model with prefill 1 x 64 and
    decode 4 x 8 (max_replicas 4) -> 128 + min(64, 32) = 160."""
    live = live or {}

    def largest(pool: PoolSpec) -> int:
        if topology.autoscaled(pool) and pool.max_replicas:
            return pool.max_replicas
        return live.get(pool.name, pool.replicas)

    total = 0
    for model in topology.served:
        takes = {role: sum(largest(p) * p.max_ongoing_requests
                           for p in topology.pools_of(model.name) if p.role == role)
                 for role in ("unified", "prefill", "decode")}
        total += takes["unified"] + min(takes["prefill"], takes["decode"] or takes["prefill"])
    return total


def _share(capacity: int, ingresses: int) -> int:
    """One ingress replica's part of `capacity` (at least 1)."""
    return max(1, -(-capacity // max(1, ingresses)))


class Admission:
    """One per ingress replica; runs on its event loop. The caller counts the prompt's tokens
    (off the loop) when `needs_tokens` says the tenants' limits read them."""

    def __init__(self, topology: Topology, metrics: GatewayMetrics, tenants: Tenants) -> None:
        self.tenants, self.metrics = tenants, metrics
        # each model's (and its declared adapters'); an adapter loaded at run time: the largest
        self._max_model_len = {name: model.max_model_len for model in topology.served
                               for name in (model.name, *(a.name for a in model.adapters))}
        self._longest = max(self._max_model_len.values())
        share = 1.0 / topology.ingress_replicas()
        now = time.monotonic()
        self._limiters = {name: TenantLimiter(tenants.spec(name).limits, share, now)
                          for name in tenants.names}
        spec = topology.admission
        # "auto": the pools' capacity, shared among the ingress replicas, both as their counts
        # change (set_ingresses, set_replicas)
        self._topology, self._live = topology, dict[str, int]()
        self._ingresses = topology.ingress_replicas()
        self._capacity = pool_capacity(topology) if spec.max_in_flight == "auto" else None
        in_flight = spec.max_in_flight if isinstance(spec.max_in_flight, int) else None
        if self._capacity is not None:
            in_flight = _share(self._capacity, self._ingresses)
        self.queue = FairQueue(in_flight, spec.max_queued_per_tenant, spec.queue_timeout_s)
        self.needs_tokens = isinstance(spec.max_in_flight, int) or any(
            t.limits.tokens_per_minute or t.limits.max_prompt_tokens for t in topology.tenants)

    def authenticate(self, authorization: str | None) -> TenantSpec:
        try:
            return self.tenants.authenticate(authorization)
        except GatewayError as exc:
            self.metrics.rejections.labels(UNKNOWN_TENANT, "invalid_api_key").inc()
            raise exc from None

    def shape(self, tenant: TenantSpec, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        """The body as the pools get it: the tenant's cache salt, its default output length.
        Raises 403 if the tenant may not use the model."""
        try:
            self.tenants.authorize(tenant, body["model"])
        except GatewayError as exc:
            self._count_rejection(tenant, exc)
            raise
        return self._shaped(tenant, endpoint, body)

    def set_ingresses(self, count: int) -> None:
        """`count` ingress replicas share the tenants' limits now (gateway.colocate: the pool's
        replicas, as they come and go)."""
        self._ingresses = count
        share, now = 1.0 / max(1, count), time.monotonic()
        for limiter in self._limiters.values():
            if limiter.share != share:
                limiter.rescale(share, now)
        if self._capacity is not None:
            self.queue.set_capacity(_share(self._capacity, count))

    def set_replicas(self, pool: str, count: int) -> None:
        """`count` replicas of the fixed-size `pool` are ready now (the registry's): the pools'
        capacity follows (admission.max_in_flight: auto)."""
        if self._capacity is None or self._live.get(pool) == count:
            return
        self._live[pool] = count
        self._capacity = pool_capacity(self._topology, self._live)
        self.queue.set_capacity(_share(self._capacity, self._ingresses))

    async def admit(self, tenant: TenantSpec, endpoint: str, body: dict[str, Any],
                    prompts: list[list[int]] | None) -> Ticket:
        """Admit the (shaped) request or raise the GatewayError that refuses it. `prompts` are
        the token ids of each of its prompts (None where no limit reads them)."""
        try:
            return await self._admit(tenant, endpoint, body, prompts)
        except GatewayError as exc:
            self._count_rejection(tenant, exc)
            raise

    def _count_rejection(self, tenant: TenantSpec, exc: GatewayError) -> None:
        if exc.code in REJECTION_REASONS:
            self.metrics.rejections.labels(tenant.name, exc.code).inc()

    async def _admit(self, tenant: TenantSpec, endpoint: str, body: dict[str, Any],
                     prompts: list[list[int]] | None) -> Ticket:
        limiter = self._limiters[tenant.name]
        output = requested_output(endpoint, body)
        lengths = [len(ids) for ids in prompts] if prompts is not None else []
        limiter.check_sizes(max(lengths) if prompts is not None else None, output,
                            "messages" if endpoint == "chat" else "prompt")
        model = body.get("model")  # a string (Routes.read_body checked it)
        max_model_len = self._max_model_len.get(model, self._longest) \
            if isinstance(model, str) else self._longest
        cost = cost_tokens(lengths, output, choices(body), max_model_len)
        charge = limiter.admit(cost, time.monotonic())
        self.metrics.queued.labels(tenant.name).inc()
        try:
            waited = await self.queue.acquire(tenant.name, cost, tenant.weight, tenant.priority)
        except BaseException:
            limiter.refund(charge, time.monotonic())
            raise
        finally:
            self.metrics.queued.labels(tenant.name).dec()
        self.metrics.queue.labels(tenant.name).observe(waited)
        self.metrics.in_flight.labels(tenant.name).inc()
        return Ticket(tenant, charge, cost, waited, str(body.get("model", "-")))

    def finish(self, ticket: Ticket, usage: Usage | None, refund: bool = False) -> None:
        """The request ended (answered, failed or abandoned); idempotent. `refund`: no engine
        ever took it (so there is no usage), and it costs the tenant nothing."""
        if ticket.settled:
            return
        ticket.settled = True
        name = ticket.tenant.name
        used = usage.prompt_tokens + usage.completion_tokens if usage is not None else None
        if refund:
            used = 0
            self._limiters[name].refund(ticket.charge, time.monotonic())
        else:
            self._limiters[name].release(ticket.charge, used, time.monotonic())
        self.queue.release(name, ticket.cost, ticket.cost if used is None else used,
                           ticket.tenant.weight)
        self.metrics.in_flight.labels(name).dec()
        if usage is not None:
            self.metrics.served(name, usage, ticket.model)

    def _shaped(self, tenant: TenantSpec, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        """The body with the tenant's cache salt and default output length."""
        client_salt = body.get("cache_salt")
        if client_salt is not None and not isinstance(client_salt, str):
            raise GatewayError(400, "cache_salt must be a string", "cache_salt")
        salt = self.tenants.cache_salt(tenant, client_salt)
        body = body if salt is None else body | {"cache_salt": salt}
        limit = tenant.limits.max_output_tokens
        if limit is not None and requested_output(endpoint, body) is None:
            body = body | {_OUTPUT_FIELDS[endpoint]: limit}
        return body
