"""A pool replica that also serves the gateway (`gateway.colocate`): the request path in one
process per replica, as vLLM's own server has it, instead of a gateway process before it.

The replica's HTTP server is the gateway's, whole (auth, tenants, limits, fair queue, routing,
metrics): a request it places on its own engine is served by a call, one it places on another
replica goes over that replica's data channel. Serve still places, checks, and drains it as any
pool replica.
"""

from __future__ import annotations

from typing import Any

from orchestrator.config import Topology
from orchestrator.gateway.ingress import Ingress
from pools.deployment import PoolReplica, ReplicaSettings
from pools.engine import EngineSpec


async def _no_wake() -> None:
    """The pool needs no waking: this replica is one of its replicas."""


class PoolReplicaWithIngress(PoolReplica):
    """Serve deployment class of a pool whose replicas serve the gateway."""

    # Serve awaits an async constructor, which typing cannot say (__init__ must return None)
    async def __init__(self, spec: EngineSpec, settings: ReplicaSettings,  # type: ignore[misc]
                       topology: dict[str, Any]) -> None:
        await super().__init__(spec, settings)
        assert self._channel is not None  # started by the replica
        local = {self._replica_id: self._channel.local_link(self._replica_id)}
        self._ingress = await Ingress.start(Topology.model_validate(topology), self._replica_id,
                                            {settings.pool: _no_wake}, local)

    async def check_health(self) -> None:
        self._ingress.check_health()
        if self._engine.dead:  # new connections go to the other replicas' listeners
            self._ingress.stop_accepting()
        await super().check_health()

    def _busy(self) -> bool:
        """The engine's requests, and the ones this ingress took: those whose replica failed are
        retried or continued on others from here, so the process ends only after them."""
        return super()._busy() or self._ingress.in_flight > 0

    async def __del__(self) -> None:
        """Tell the other ingresses to send nothing more here, stop taking connections, let
        the requests this ingress took finish (here or on other replicas), then drain the
        engine as any replica."""
        self._stop_taking()
        await self._ingress.drain()
        await self._ingress.close()
        await self._finish()
