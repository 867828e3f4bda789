"""Per-tenant Prometheus series of one ingress replica. Labels carry tenant names, endpoints,
status codes, reasons and the model or adapter a request named, never prompt text. Requests
without a valid key count as tenant `-`, those whose model was not read as model `-`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from channel.frames import Usage
from orchestrator.gateway.connection_limits import LIMIT_REASONS

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
REJECTION_REASONS = ("invalid_api_key", "model_not_allowed", "requests_per_minute",
                     "tokens_per_minute", "concurrency_limit", "prompt_too_long",
                     "max_tokens_too_large", "queue_full", "queue_timeout")
UNKNOWN_TENANT = "-"
UNKNOWN_MODEL = "-"


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry, tenants: list[str],
                 models: list[str] | None = None) -> None:
        self.requests = Counter("tokenfab_gateway_requests", "Requests answered, by status code "
                                "and the model or adapter named", ["tenant", "endpoint", "code",
                                                                    "model"], registry=registry)
        self.rejections = Counter("tokenfab_gateway_rejections",
                                  "Requests refused by auth, limits or admission, by reason",
                                  ["tenant", "reason"], registry=registry)
        self.tokens = Counter("tokenfab_gateway_tokens",
                              "Tokens served, as the engines reported them: prompt, completion, "
                              "and cached (prompt tokens served from the prefix cache), by the "
                              "model or adapter named", ["tenant", "kind", "model"],
                              registry=registry)
        self.ttft = Histogram("tokenfab_gateway_ttft_seconds",
                              "Time to first token of streamed requests, queueing included",
                              ["tenant"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("tokenfab_gateway_itl_seconds", "Time between streamed tokens",
                             ["tenant"], buckets=_ITL_BUCKETS, registry=registry)
        self.latency = Histogram("tokenfab_gateway_request_seconds",
                                 "Whole request, from arrival to the last byte",
                                 ["tenant", "endpoint"], buckets=_LATENCY_BUCKETS,
                                 registry=registry)
        self.queue = Histogram("tokenfab_gateway_queue_seconds",
                               "Time waiting in the fair queue for capacity", ["tenant"],
                               buckets=_LATENCY_BUCKETS, registry=registry)
        self.in_flight = Gauge("tokenfab_gateway_in_flight", "Requests admitted, not finished",
                               ["tenant"], registry=registry)
        self.queued = Gauge("tokenfab_gateway_queued", "Requests waiting for capacity",
                            ["tenant"], registry=registry)
        self.connection_limits = Counter(
            "tokenfab_gateway_connection_limits", "Connections closed by a timeout of a "
            "request's phase or refused over a connection cap, by reason", ["reason"],
            registry=registry)
        for reason in LIMIT_REASONS:
            self.connection_limits.labels(reason)
        for tenant in tenants:  # every series exists from the start, at 0
            for kind in ("prompt", "completion", "cached"):
                for model in models or [UNKNOWN_MODEL]:
                    self.tokens.labels(tenant, kind, model)
            for reason in REJECTION_REASONS:
                self.rejections.labels(tenant, reason)
            self.in_flight.labels(tenant)
            self.queued.labels(tenant)
            self.queue.labels(tenant)
            self.ttft.labels(tenant)
            self.itl.labels(tenant)
        self.rejections.labels(UNKNOWN_TENANT, "invalid_api_key")

    def served(self, tenant: str, usage: Usage, model: str = UNKNOWN_MODEL) -> None:
        self.tokens.labels(tenant, "prompt", model).inc(usage.prompt_tokens)
        self.tokens.labels(tenant, "completion", model).inc(usage.completion_tokens)
        self.tokens.labels(tenant, "cached", model).inc(usage.cached_tokens)

    def connection_limit(self, reason: str) -> None:
        self.connection_limits.labels(reason).inc()
