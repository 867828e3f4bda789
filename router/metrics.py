"""Prometheus metrics of one pool's router; recorded by the routing service, never by plugins."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class RouterMetrics:
    """One instance per process and registry; every series is labelled with the pool."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter("tokenfab_router_decisions", "Routing decisions",
                                 ["pool", "policy"], registry=registry)
        self.prompt_tokens = Counter("tokenfab_router_prompt_tokens",
                                     "Prompt tokens of routed requests", ["pool"],
                                     registry=registry)
        self.predicted_cached = Counter(
            "tokenfab_router_predicted_cached_tokens",
            "Prompt tokens the block map said the chosen replica held", ["pool"], registry=registry)
        self.realised_cached = Gauge(
            "tokenfab_router_engine_cached_tokens",
            "Prompt tokens the engine reports it served from its prefix cache (since start)",
            ["pool", "replica"], registry=registry)
        self.cached_blocks = Gauge("tokenfab_router_cached_blocks",
                                   "Blocks the block map holds per replica", ["pool", "replica"],
                                   registry=registry)
        self.index_entries = Gauge("tokenfab_router_index_entries",
                                   "(block, replica) pairs in the block map", ["pool"],
                                   registry=registry)
        self.index_bytes = Gauge(
            "tokenfab_router_index_bytes",
            "Memory of the block map: entries times router.index.BYTES_PER_ENTRY (measured)",
            ["pool"], registry=registry)
        self.event_lag = Gauge("tokenfab_router_event_lag_seconds",
                               "Age of the newest applied KV event batch when applied (max over "
                               "replicas)", ["pool"], registry=registry)
        self.event_batches = Counter("tokenfab_router_event_batches", "KV event batches applied",
                                     ["pool"], registry=registry)
        self.gaps = Counter("tokenfab_router_event_gaps",
                            "Sequence gaps in KV event streams, by how they were closed",
                            ["pool", "outcome"], registry=registry)
        self.failures = Counter(
            "tokenfab_router_replica_failures",
            "Requests whose replica failed or went away before answering them (each was sent to "
            "another replica, or answered 503 when none was left to try)", ["pool", "replica"],
            registry=registry)
        self.migrations = Counter(
            "tokenfab_router_migrations",
            "Streams whose replica failed after tokens reached the client, by outcome: resumed "
            "on another replica, or ended in-stream (not_resumable: the request cannot be "
            "continued; exhausted: no retry or replica left; failed: the continuation failed)",
            ["pool", "outcome"], registry=registry)
        self.breaker_trips = Counter(
            "tokenfab_router_breaker_trips",
            "Times a replica's circuit breaker opened (router.breaker)", ["pool", "replica"],
            registry=registry)
        self.breaker_open = Gauge(
            "tokenfab_router_breaker_open",
            "1 while a replica's circuit breaker keeps the router from choosing it",
            ["pool", "replica"], registry=registry)
        self.replicas = Gauge("tokenfab_router_followed_replicas",
                              "Replicas whose KV event streams are followed now", ["pool"],
                              registry=registry)
        self.unfollowed = Gauge(
            "tokenfab_router_unfollowed_replicas",
            "Replicas publishing KV events whose stream is not followed now (restarting)",
            ["pool"], registry=registry)
