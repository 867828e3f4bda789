"""Wires the router into one gateway process: a routing service per routed pool, fed by the
replica registry, registered for Ray Serve's request-router hook, and the per-request plumbing
(route key before the call, first token and end after it).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray
from prometheus_client import CollectorRegistry

from orchestrator.config import Topology, pool_deployment_name, routing_policy
from pools.registry import ReplicaReport, get_registry
from pools.tokenizer import PromptTokenCounter
from router import local_services
from router.index import ReplicaId
from router.metrics import RouterMetrics
from router.policies import DEFAULT_WEIGHTS, build_policy
from router.service import ReplicaSource, RoutingService
from router.wire import ReplicaView, RouteKey

REGISTRY_TIMEOUT_S = 5.0


def view_of(report: ReplicaReport) -> ReplicaView:
    load = report.load
    return ReplicaView(
        replica=ReplicaId(report.replica_id), pool=report.pool, state=report.state,
        kv_events_endpoint=report.kv_events_endpoint, kv_replay_endpoint=report.kv_replay_endpoint,
        block_size=report.block_size, in_flight=load.in_flight, waiting=load.waiting,
        kv_usage=load.kv_cache_usage, engine_cached_tokens=load.prompt_tokens_local_hit,
        engine_prompt_tokens=load.prompt_tokens_computed + load.prompt_tokens_local_hit
        + load.prompt_tokens_transferred,
    )


def registry_source(app: str) -> ReplicaSource:
    """Blocking read of the replica registry; the routing service calls it on its own thread."""

    def source() -> list[ReplicaView]:
        reports = ray.get(get_registry(app).snapshot.remote(), timeout=REGISTRY_TIMEOUT_S)
        return [view_of(report) for report in reports]

    return source


def _hasher_factory(hash_algo: str):
    def factory(block_size: int):
        from pools.block_hasher import VllmBlockHasher

        return VllmBlockHasher(block_size, hash_algo)

    return factory


class PoolRouters:
    """The routing services of this gateway process, one per pool routed by a tokenfab policy."""

    def __init__(self, topology: Topology, serve_app: str, registry: CollectorRegistry) -> None:
        self._serve_app, self._counter = serve_app, None
        self.services: dict[str, RoutingService] = {}
        spec = topology.router
        hash_algo = str(topology.engine_args.get("prefix_caching_hash_algo", "sha256"))
        metrics = None
        for pool in topology.pools:
            policy = routing_policy(topology, pool)
            if policy not in DEFAULT_WEIGHTS:
                continue  # routed by Ray Serve's own or a baseline router
            metrics = metrics or RouterMetrics(registry)
            service = RoutingService(
                pool.name,
                build_policy(policy, spec.weights, max_in_flight=spec.max_in_flight,
                             tolerance=spec.tie_tolerance),
                registry_source(topology.name), _hasher_factory(hash_algo), metrics,
                max_index_entries=spec.max_index_entries, history_ttl_s=spec.history_ttl_s,
                prior_tokens_per_s=spec.prefill_tokens_per_s,
                in_flight_cost_tokens=spec.in_flight_cost_tokens)
            service.start()
            local_services.register(serve_app, pool_deployment_name(pool.name), service)
            self.services[pool.name] = service
        if self.services:
            self._counter = PromptTokenCounter(topology.model.resolved_path)

    async def key(self, pool: str, endpoint: str, body: dict[str, Any],
                  tokens: list[int] | None = None) -> RouteKey | None:
        """The request's route key for `pool` (tokenised here unless `tokens` are given)."""
        service = self.services.get(pool)
        if service is None or not service.block_size():
            return None
        return await asyncio.to_thread(self._key, service, endpoint, body, tokens)

    def _key(self, service: RoutingService, endpoint: str, body: dict[str, Any],
             tokens: list[int] | None) -> RouteKey | None:
        if tokens is None:
            try:
                tokens = self._counter.tokens(endpoint, body)
            except Exception:  # unreadable prompt: the engine will answer the error itself
                return None
        if tokens is None:
            return None
        salt = body.get("cache_salt")
        return service.route_key(uuid.uuid4().hex, tokens, salt if isinstance(salt, str) else None)

    def first_token(self, pool: str, key: RouteKey | None) -> None:
        if key is not None and pool in self.services:
            self.services[pool].first_token(key.request_id)

    def finished(self, pool: str, key: RouteKey | None) -> None:
        if key is not None and pool in self.services:
            self.services[pool].finished(key.request_id)

    async def tracked(self, pool: str, key: RouteKey | None,
                      replies: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """Pass a reply stream through, telling the router when the first token came back (the
        first event of a streamed reply) and when the request ended."""
        try:
            streaming, seen = False, 0
            async for item in replies:
                seen += 1
                if seen == 1:
                    streaming = bool(getattr(item, "streaming", False))
                elif seen == 2 and streaming:
                    self.first_token(pool, key)
                yield item
        finally:
            self.finished(pool, key)
            cancel = getattr(replies, "cancel", None)
            if cancel is not None:
                cancel()
            else:
                await replies.aclose()

    def status(self) -> dict[str, Any]:
        return {pool: {"policy": s.policy.name, "block_size": s.block_size(),
                       "index_entries": s.index_entries(), "replicas": s.replicas()}
                for pool, s in self.services.items()}

    def close(self) -> None:
        for pool, service in self.services.items():
            local_services.unregister(self._serve_app, pool_deployment_name(pool))
            service.stop()
