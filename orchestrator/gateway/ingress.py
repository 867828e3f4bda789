"""The gateway as a Ray Serve deployment: each replica serves HTTP itself, on the topology's
address (the replicas on one node share the port), with no Serve proxy in between.

Serve places, health-checks, restarts and scales gateway replicas; requests reach pool replicas
over the data channel (gateway.dispatch), not through Serve handles.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import ray
from prometheus_client import CollectorRegistry, generate_latest
from ray import serve
from ray.serve.handle import DeploymentHandle

from channel.local import LocalLink
from channel.secret import channel_secret, event_keys
from orchestrator.gateway.adapters import AdapterCatalog
from orchestrator.gateway.admin import Admin
from orchestrator.gateway.admission import Admission
from orchestrator.gateway.dispatch import PoolDispatcher, ReplicaDirectory
from orchestrator.gateway.flows import DisaggregatedFlow, Flow, UnifiedFlow
from orchestrator.gateway.http import HttpServer
from orchestrator.gateway.connection_limits import Limits
from orchestrator.gateway.metrics import GatewayMetrics
from orchestrator.gateway.peers import IngressPeers
from orchestrator.gateway.routes import Routes
from orchestrator.gateway.tenancy import Tenants, salt_key
from kvtransfer.metrics import TransferMetrics
from orchestrator.config import PoolSpec, Topology, routing_policy
from pools.registry import ReplicaReport
from pools.tokenizer import PromptTokenCounter
from router.adapters import AdapterResidency
from router.breaker import CircuitBreakers
from router.event_sync import EventCredentials
from router.hashing import PrefixBlockHasher
from router.metrics import RouterMetrics
from router.policies import build_policy
from router.service import RoutingService
from router.turn import shared_turn
from tokenfab.ray_compat import bind_serve_grpc_to_node_address

logger = logging.getLogger("ray.serve").getChild("tokenfab.gateway")
bind_serve_grpc_to_node_address()  # before Serve starts this replica's gRPC server

GATEWAY_DRAIN_TIMEOUT_S = 60.0


def routing_service(topology: Topology, pool: PoolSpec, metrics: RouterMetrics,
                    credentials: EventCredentials | None = None) -> RoutingService:
    spec = topology.router
    target = topology.targets(pool).ttft_p90_s if spec.ttft_target_s is None \
        else spec.ttft_target_s
    name = routing_policy(topology, pool)
    policy = build_policy(name, spec.weights,
                          max_in_flight=spec.max_in_flight, ttft_target_s=target,
                          tolerance=spec.tie_tolerance,
                          max_candidates=spec.max_candidates,
                          turn=shared_turn(topology.name, pool.name) if name == "round_robin"
                          else None)
    hash_algo = str(topology.engine_args.get("prefix_caching_hash_algo", "sha256"))

    def hasher(block_size: int) -> PrefixBlockHasher:
        return PrefixBlockHasher(block_size, hash_algo)

    lora = topology.model_of(pool).lora
    adapters = AdapterResidency(lora.resident, lora.max_loras) \
        if lora and spec.adapters == "aware" else None
    return RoutingService(
        pool.name, policy, hasher, metrics, adapters=adapters,
        follow_events=topology.kv_events.enabled,
        max_index_entries=spec.max_index_entries, history_ttl_s=spec.history_ttl_s,
        max_history_entries=spec.max_history_entries,
        prior_tokens_per_s=spec.prefill_tokens_per_s,
        in_flight_cost_tokens=spec.in_flight_cost_tokens, event_credentials=credentials,
        breakers=CircuitBreakers(spec.breaker_failures, spec.breaker_window_s,
                                 spec.breaker_open_s))


def event_credentials(app: str) -> EventCredentials:
    """What the router presents to the replicas' event relays. Blocking (a GCS round trip)."""
    keys = event_keys(app)
    return EventCredentials(keys.server_public, keys.client_public, keys.client_secret)


def colocated_ingresses(reports: list[ReplicaReport], own_id: str) -> int | None:
    """How many replicas of a colocated pool serve the gateway now: this one and those listed
    ready. None when the registry does not list this replica (restarted, or it has not reported
    yet): then nothing is known, and the share stays as it was.

    Example: reports of self (ready), r2 (ready), r3 (draining) -> 2; reports without self -> None.
    """
    if not any(report.replica_id == own_id for report in reports):
        return None
    return len({r.replica_id for r in reports if r.state == "ready"} | {own_id})


def ready_replicas(reports: list[ReplicaReport]) -> int | None:
    """How many of a fixed pool's replicas are ready (at least 1: one is on its way); None when
    the registry lists none of them, a read that says nothing new.

    Example: reports ready, ready, draining -> 2; one starting -> 1; none -> None."""
    if not reports:
        return None
    return max(1, sum(report.state == "ready" for report in reports))


def _waker(handle: DeploymentHandle[Any]) -> Callable[[], Awaitable[None]]:
    async def wake() -> None:
        await handle.wake.remote()

    return wake


class Ingress:
    """One process's gateway: its HTTP server, routes, flow, the pools' dispatchers and its part
    of the shared `/metrics`. Runs on the process's event loop; `start` makes one."""

    def __init__(self, topology: Topology, replica_id: str,
                 wakers: Mapping[str, Callable[[], Awaitable[None]]],
                 local: Mapping[str, LocalLink]) -> None:
        self._topology, self._replica_id = topology, replica_id
        self._wakers, self._local = wakers, local

    @classmethod
    async def start(cls, topology: Topology, replica_id: str,
                    wakers: Mapping[str, Callable[[], Awaitable[None]]],
                    local: Mapping[str, LocalLink] | None = None) -> Ingress:
        """Serve the topology's gateway from this process. `wakers[pool]` asks Serve for a
        replica of a pool that has none; `local` are the links to replicas in this process."""
        ingress = cls(topology, replica_id, wakers, local or {})
        await ingress._start()
        return ingress

    async def _start(self) -> None:
        topology_, replica_id = self._topology, self._replica_id
        registry = CollectorRegistry()
        tenants = Tenants.from_topology(topology_, await asyncio.to_thread(salt_key, topology_))
        metrics = GatewayMetrics(registry, tenants.names, [m.name for m in topology_.served])
        admission = Admission(topology_, metrics, tenants)
        secret = await asyncio.to_thread(channel_secret, topology_.name)
        counters = {model.name: await asyncio.to_thread(PromptTokenCounter, model.resolved_path)
                    for model in topology_.served}
        self._directory = ReplicaDirectory(topology_.name)
        router_metrics = RouterMetrics(registry)
        credentials = await asyncio.to_thread(event_credentials, topology_.name) \
            if topology_.kv_events.transport == "tcp" else None
        self._pools = {pool.name: PoolDispatcher(
            pool.name, routing_service(topology_, pool, router_metrics, credentials),
            pool.max_ongoing_requests, secret, replica_id, self._wakers[pool.name],
            self._directory, topology_.gateway.retries, pool.shed_waiting,
            topology_.gateway.migrate, topology_.router.dp_ranks == "route", self._local)
            for pool in topology_.pools}
        disaggregated = any(pool.role != "unified" for pool in topology_.pools)
        transfers = TransferMetrics(registry) if disaggregated else None
        flows = {model.name: self._flow(model.name, transfers) for model in topology_.served}
        gateway = topology_.gateway

        def own_series() -> bytes:
            """This ingress replica's series (requests, queues, block maps), as of now."""
            for pool in self._pools.values():
                pool.service.record_metrics()
            return generate_latest(registry)

        self._peers = IngressPeers(replica_id, secret, own_series, self._directory)
        await self._peers.start(ray.util.get_node_ip_address())
        catalog = AdapterCatalog(topology_.served, {t.name for t in topology_.tenants})
        if catalog.enabled:
            self._directory.listen_adapters(catalog.update)
            try:
                catalog.update(await self._directory.adapters())
            except Exception as exc:  # noqa: BLE001 - the next read of the registry brings them
                logger.warning("gateway %s: adapter registry unavailable: %r", replica_id, exc)
        admin = Admin(topology_.name, self._pools, self._directory, self._peers, replica_id,
                      gateway.route_prefix, transfers, tenants.authenticate_admin, catalog)
        self._routes = routes = Routes(topology_, admission, flows, metrics, admin, counters,
                                       catalog)
        limits = Limits(gateway.header_timeout_s, gateway.body_timeout_s, gateway.idle_timeout_s,
                        gateway.max_connections, gateway.max_connections_per_client,
                        gateway.stalled_client_timeout_s)
        self._server = HttpServer(routes.handle, gateway.max_body_bytes, limits,
                                  metrics.connection_limit)
        # the deployed document does not say how many replicas a fixed pool has: the registry
        # does. Its pools' capacity bounds admission; with colocate, the first pool's replicas
        # are the ingresses sharing the limits
        def follow(pool: PoolSpec) -> Callable[[list[ReplicaReport]], None] | None:
            fixed = not topology_.autoscaled(pool)
            ingresses = gateway.colocate and pool is topology_.pools[0]
            if not (fixed or ingresses):
                return None

            def heard(reports: list[ReplicaReport]) -> None:
                if fixed and (ready := ready_replicas(reports)) is not None:
                    admission.set_replicas(pool.name, ready)
                if ingresses and (count := colocated_ingresses(reports, replica_id)) is not None:
                    admission.set_ingresses(count)
            return heard

        listeners = {pool.name: heard for pool in topology_.pools
                     if (heard := follow(pool)) is not None}
        for name, listener in listeners.items():
            self._directory.listen(name, listener)
        if listeners:
            try:
                reports = await self._directory.snapshot()
                for name, listener in listeners.items():
                    listener([r for r in reports if r.pool == name])
            except Exception as exc:  # noqa: BLE001 - the next read of the registry brings them
                logger.warning("gateway %s: replica registry unavailable: %r", replica_id, exc)
        self._directory_task = asyncio.create_task(self._directory.run(), name="replica-directory")
        await self._server.start(gateway.host, gateway.port)
        logger.info("gateway %s serving on %s:%d", replica_id, gateway.host, gateway.port)

    def _flow(self, model: str, transfers: TransferMetrics | None) -> Flow:
        """Where a request for `model` goes: its unified pool, or its prefill and decode pools
        (the first of each role, in topology order)."""
        pools = {pool.role: self._pools[pool.name]
                 for pool in reversed(self._topology.pools_of(model))}
        if "unified" in pools:
            return UnifiedFlow(pools["unified"])
        prefill, decode = pools["prefill"], pools["decode"]
        assert transfers is not None  # made when a pool is not unified, as these two are
        return DisaggregatedFlow(prefill, decode, self._topology.disaggregation, transfers)

    def check_health(self) -> None:
        if self._directory_task.done():
            raise RuntimeError(f"replica directory stopped: {self._directory_task!r}")

    @property
    def in_flight(self) -> int:
        """Requests this ingress is answering or has received and will answer."""
        return self._routes.in_flight + self._server.waiting()

    def stop_accepting(self) -> None:
        """Take no new connection (the port's other listeners get them)."""
        self._server.close()

    async def drain(self, timeout_s: float = GATEWAY_DRAIN_TIMEOUT_S) -> None:
        """Stop taking connections and let the requests in flight finish (within `timeout_s`)."""
        self.stop_accepting()
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        """Let go of the replicas and leave the registry (after `drain`)."""
        self._directory_task.cancel()
        self._peers.close()
        try:  # the others stop asking it for its series (else its entry expires)
            await self._directory.forget_ingress(self._replica_id)
        except Exception:  # noqa: BLE001 - the registry may be gone with the application
            pass
        for pool in self._pools.values():
            pool.close()


class Gateway:
    """Serve deployment class of the ingress in processes of its own. Holds no state that
    another replica needs."""

    # Serve awaits an async constructor, which typing cannot say (__init__ must return None)
    async def __init__(self, topology: dict[str, Any],  # type: ignore[misc]
                       pools: dict[str, DeploymentHandle[Any]]) -> None:
        self._ingress = await Ingress.start(
            Topology.model_validate(topology), serve.get_replica_context().replica_id.unique_id,
            {name: _waker(handle) for name, handle in pools.items()})

    async def check_health(self) -> None:
        self._ingress.check_health()

    async def __del__(self) -> None:
        """Stop taking connections, let the requests in flight finish (within the drain
        timeout), then let go of the replicas."""
        await self._ingress.drain()
        await self._ingress.close()
