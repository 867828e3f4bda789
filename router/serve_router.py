"""Ray Serve's request-router hook, delegating to the pool's routing service in this process.

Serve builds one request router per deployment handle, in the process that holds the handle (the
gateway). The gateway registers the routing service of each pool here; the router ranks the
replicas Serve offers with it, without leaving the process, and reports each placement back so
the service counts the load. A handle in a process without a service (a script holding a handle)
routes at random.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from router import local_services
from router.index import ReplicaId
from router.service import RoutingService

ROUTER_CLASS = "router.serve_router:ServiceRequestRouter"


def _route_key(pending_request: PendingRequest | None) -> Any:
    return pending_request.kwargs.get("route") if pending_request is not None else None


class ServiceRequestRouter(RequestRouter):
    """Ranks with the pool's RoutingService: one rank per replica, best first, so Serve falls
    back to the next replica only when the preferred one is at `max_ongoing_requests`."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._rng = random.Random()

    def _service(self) -> RoutingService | None:
        # Serve pickles this class by value: module state lives in `local_services`.
        return local_services.lookup(self._deployment_id.app_name, self._deployment_id.name)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        service = self._service()
        if service is None:
            return [[self._rng.choice(candidate_replicas)]]
        by_id = {ReplicaId(r.replica_id.unique_id): r for r in candidate_replicas}
        order = service.rank(_route_key(pending_request), list(by_id))
        return [[by_id[replica]] for replica in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        service = self._service()
        if service is not None:
            service.dispatched(_route_key(pending_request), ReplicaId(replica_id.unique_id))
