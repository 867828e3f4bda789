"""The gateway's own routes: health, readiness, metrics and introspection (`/tokenfab/...`).

None of these is on the request path of a completion; they read the replica registry and the
routing services when asked. With auth on, those that name tenants or show the cluster's inside
(`ADMIN_ONLY`) answer only an admin key.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST

from orchestrator.gateway import pool_metrics
from orchestrator.gateway.adapters import AdapterCatalog, not_found
from orchestrator.gateway.dispatch import PoolDispatcher, ReplicaDirectory
from orchestrator.gateway.errors import GatewayError, send_error
from orchestrator.gateway.responder import HttpRequest, Responder
from orchestrator.gateway.peers import IngressPeers
from kvtransfer.metrics import TransferMetrics

logger = logging.getLogger("ray.serve").getChild("tokenfab.admin")

Explain = Callable[[str, HttpRequest], Awaitable[dict[str, Any]]]  # raises GatewayError
Guard = Callable[[str | None], None]  # the Authorization header; raises GatewayError to refuse
# Routes that name tenants or show the cluster's inside: with auth on, an admin key only. The
# probes (/health, /ready, /-/healthz, /-/routes) stay open; the explain route takes a tenant key.
ADMIN_ONLY = frozenset({"/metrics", "/tokenfab/pd", "/tokenfab/replicas", "/tokenfab/autoscaler",
                        "/tokenfab/router"})
ADAPTERS = "/tokenfab/adapters"  # GET: list; POST: load one; DELETE /tokenfab/adapters/<name>
_encode = msgspec.json.encode


class Admin:
    def __init__(self, app: str, pools: Mapping[str, PoolDispatcher], directory: ReplicaDirectory,
                 peers: IngressPeers, replica_id: str, route_prefix: str,
                 transfers: TransferMetrics | None, guard: Guard,
                 catalog: AdapterCatalog | None = None) -> None:
        self._app, self._pools, self._directory, self._guard = app, pools, directory, guard
        self._catalog = catalog
        self._peers, self._replica_id = peers, replica_id
        self._route_prefix, self._transfers = route_prefix, transfers
        self._gets: dict[str, Callable[[Responder], Awaitable[None]]] = {
            "/health": self._health, "/-/healthz": self._healthz, "/-/routes": self._routes,
            "/ready": self._ready, "/metrics": self._metrics, "/tokenfab/pd": self._pd,
            "/tokenfab/replicas": self._replicas, "/tokenfab/autoscaler": self._autoscaler,
            "/tokenfab/router": self._router,
        }

    async def handle(self, path: str, request: HttpRequest, responder: Responder,
                     explain: Explain) -> None:
        route = self._gets.get(path)
        if route is not None:
            if request.method != "GET":
                return send_error(responder, 405, "Method Not Allowed")
            if path in ADMIN_ONLY:
                try:
                    self._guard(request.headers.get("authorization"))
                except GatewayError as exc:
                    return exc.send(responder)
            return await route(responder)
        if path == ADAPTERS or path.startswith(ADAPTERS + "/"):
            try:
                self._guard(request.headers.get("authorization"))
                return await self._adapters(path.removeprefix(ADAPTERS).strip("/"), request,
                                            responder)
            except GatewayError as exc:
                return exc.send(responder)
        if path.startswith("/tokenfab/route/"):
            if request.method != "POST":
                return send_error(responder, 405, "Method Not Allowed")
            return await self._explain(path.removeprefix("/tokenfab/route/"), request, responder,
                                       explain)
        send_error(responder, 404, "Not Found")

    async def _health(self, responder: Responder) -> None:
        responder.send(200, b'{"status": "ok"}')

    async def _healthz(self, responder: Responder) -> None:  # KubeRay's probe of Serve's proxy
        responder.send(200, b"success", content_type="text/plain")

    async def _routes(self, responder: Responder) -> None:
        responder.send(200, _encode({self._route_prefix: self._app}))

    async def _ready(self, responder: Responder) -> None:
        """200 when every pool has a ready replica; 503 naming the pools that have none. The
        KV event streams followed per pool are reported; one that stopped (restarted shortly)
        does not make the gateway unready: routing degrades to load meanwhile."""
        try:
            reports = await self._directory.snapshot()
        except Exception:  # noqa: BLE001 - any failure of the registry means not ready
            return send_error(responder, 503, "replica registry unavailable")
        ready = Counter(report.pool for report in reports if report.state == "ready")
        missing = [pool for pool in self._pools if not ready[pool]]
        if missing:
            return send_error(responder, 503, f"no ready replica in pool(s): {', '.join(missing)}")
        streams = {name: p.service.stream_health() for name, p in self._pools.items()}
        responder.send(200, _encode({"status": "ready", "ready_replicas": dict(ready),
                                     "kv_event_streams": streams}))

    async def _metrics(self, responder: Responder) -> None:
        """Every ingress replica's series, each labelled `ingress` (see peers), then every pool
        replica's (see pool_metrics)."""
        body = await self._peers.exposition()
        try:
            reports = await self._directory.snapshot()
        except Exception:  # noqa: BLE001 - a scrape without pool series beats a failed scrape
            logger.warning("replica registry unavailable; /metrics without pool series")
        else:
            body += pool_metrics.render(reports)
        responder.send(200, body, content_type=CONTENT_TYPE_LATEST)

    async def _pd(self, responder: Responder) -> None:
        """Counters of the prefill/decode flow (empty for unified topologies)."""
        responder.send(200, _encode(dict(self._transfers.tally) if self._transfers else {}))

    async def _replicas(self, responder: Responder) -> None:
        """Every pool replica's self-report (state, cores, load), for `tokenfab status`."""
        reports = await self._directory.snapshot()
        responder.send(200, _encode([msgspec.to_builtins(report) for report in reports]))

    async def _autoscaler(self, responder: Responder) -> None:
        """The autoscaler's latest decision per autoscaled pool."""
        records = await self._directory.scaling()
        responder.send(200, _encode([msgspec.to_builtins(record) for record in records]))

    async def _router(self, responder: Responder) -> None:
        """This ingress replica, and per pool: policy, block map size, and per replica the
        blocks the map holds, the state of its event stream and the requests held."""
        pools = {name: {"policy": p.service.policy.name, "block_size": p.service.block_size(),
                        "index_entries": p.service.index_entries(),
                        "index_bytes": p.service.index_bytes(),
                        "kv_event_streams": p.service.stream_health(), "held": p.held,
                        "replicas": p.service.replicas(),
                        "adapters": p.service.adapters.snapshot() if p.service.adapters else {}}
                 for name, p in self._pools.items()}
        responder.send(200, _encode({"ingress": {"pid": os.getpid(), "replica": self._replica_id},
                                     "pools": pools}))

    async def _adapters(self, name: str, request: HttpRequest, responder: Responder) -> None:
        """The model's adapters (admin only): GET lists them, each with the replicas that hold
        it now; POST {"name", "path", "tenants"} loads one at run time (every ingress replica
        serves it within a read of the registry, about a second; engines load it when a
        request first needs it there); DELETE .../<name> unloads one loaded at run time."""
        catalog, method = self._catalog, request.method
        if catalog is None:
            return send_error(responder, 404, "Not Found")
        if method == "GET" and not name:
            return responder.send(200, _encode(await self._adapter_list(catalog)))
        if method == "POST" and not name:
            try:
                body = msgspec.json.decode(request.body)
            except msgspec.DecodeError as exc:
                raise GatewayError(400, f"request body is not valid JSON: {exc}") from None
            record = await asyncio.to_thread(catalog.check_new, body)  # reads its config file
            await self._directory.add_adapter(record)
            catalog.add(record)
            logger.info("adapter %s loaded from %s (tenants: %s)", record.name, record.path,
                        record.tenants or "all")
            return responder.send(200, _encode(msgspec.to_builtins(record)))
        if method == "DELETE" and name:
            if catalog.declared(name):
                raise GatewayError(409, f"adapter {name!r} is declared in the topology: remove "
                                   "it there", "name", code="adapter_declared")
            if name not in {r.name for r in await self._directory.adapters()}:
                raise not_found(name)
            await self._directory.remove_adapter(name)
            catalog.remove(name)
            logger.info("adapter %s unloaded", name)
            return responder.send(200, _encode({"name": name, "unloaded": True}))
        send_error(responder, 405, "Method Not Allowed")

    async def _adapter_list(self, catalog: AdapterCatalog) -> list[dict[str, Any]]:
        reports = await self._directory.snapshot()
        declared = {a.name for model in catalog.models.values() for a in model.adapters}
        return [msgspec.to_builtins(record) | {
            "declared": record.name in declared,
            "held_by": [r.replica_id for r in reports if record.name in r.adapters]}
            for record in catalog.records()]

    async def _explain(self, endpoint: str, request: HttpRequest, responder: Responder,
                       explain: Explain) -> None:
        """How each pool would place this completions or chat request now (nothing is sent to
        an engine): the request's block hashes and every replica's score; with auth on, the
        caller's own cache on each replica only (routes.tenant_view)."""
        if endpoint not in ("completions", "chat"):
            return send_error(responder, 404, f"unknown endpoint {endpoint!r}: completions or chat")
        try:
            explained = await explain(endpoint, request)
        except GatewayError as exc:
            return exc.send(responder)
        responder.send(200, _encode(explained))
