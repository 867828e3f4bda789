"""Where a request goes: this ingress process's view of the pools' replicas and, per pool, the
routing service that ranks them and the channel links that carry requests to them.

The replica registry is read once a second by one task (`ReplicaDirectory`); each pool's
`PoolDispatcher` keeps a link to every ready replica, asks the pool's routing service for an
order, opens the request on the first replica that takes it, and holds the request while none
can (all full, draining, or none yet), telling the pool's replicas how many it holds so that the
autoscaler sees them. A pool with no replica at all is woken through Serve (see `PoolReplica.wake`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial

import msgspec

from autoscaler.records import ScaleRecord
from channel.client import ReplicaLink, ReplyStream
from channel.frames import Head, Refused, Request
from channel.local import LocalLink
from orchestrator.gateway.errors import GatewayError, ReplicaFailed
from pools.engine import LoadSnapshot
from pools.registry import AdapterRecord, IngressReport, Registry, ReplicaReport
from router.index import ReplicaId
from router.service import RoutingService
from router.wire import ReplicaView, RouteKey, target_id
from tokenfab.errors import LinkLost, ReplyFailed

logger = logging.getLogger("ray.serve").getChild("tokenfab.dispatch")

REFRESH_S = 1.0  # the registry is read this often
HOLD_RECHECK_S = 0.5  # a held request looks again at least this often
RECONNECT_S = 1.0  # a lost link to a replica still reported ready is retried after this
HELD_REPORT_DELAY_S = 0.05  # changes of the held count are told to replicas at most this often


def views_of(report: ReplicaReport, route_ranks: bool = True) -> list[ReplicaView]:
    """The routing targets of a replica: its engine, or each of its data-parallel ranks (unless
    `route_ranks` is off: then the engine's own balancer picks a rank, and the ranks' event
    streams, numbered each on its own, are not followed)."""
    if not report.ranks:
        return [_view(report, ReplicaId(report.replica_id), report.load,
                      report.kv_events_endpoint, report.kv_replay_endpoint)]
    if not route_ranks:
        return [_view(report, ReplicaId(report.replica_id), report.load, None, None)]
    return [_view(report, target_id(report.replica_id, rank.rank), rank.load,
                  rank.kv_events_endpoint, rank.kv_replay_endpoint, rank.rank)
            for rank in report.ranks]


def _view(report: ReplicaReport, target: ReplicaId, load: LoadSnapshot, events: str | None,
          replay: str | None, rank: int | None = None) -> ReplicaView:
    return ReplicaView(
        replica=target, pool=report.pool, state=report.state,
        kv_events_endpoint=events, kv_replay_endpoint=replay,
        block_size=report.block_size, kv_blocks=report.kv_blocks,
        max_num_seqs=report.max_num_seqs, in_flight=load.in_flight,
        waiting=load.waiting,
        kv_usage=load.kv_cache_usage, engine_cached_tokens=load.prompt_tokens_local_hit,
        engine_prompt_tokens=load.prompt_tokens_computed + load.prompt_tokens_local_hit
        + load.prompt_tokens_transferred,
        host=report.replica_id if rank is not None else "", rank=rank,
        adapters=tuple(report.adapters), adapter_load_s=report.adapter_load_s,
    )


class ReplicaDirectory:
    """The application's replica registry as this process last read it. One task reads it;
    listeners (one per pool) get the reports of their pool after every read."""

    def __init__(self, app: str, refresh_s: float = REFRESH_S) -> None:
        self._refresh_s = refresh_s
        self._registry = Registry(app)
        self._listeners: dict[str, list[Callable[[list[ReplicaReport]], None]]] = {}
        self._adapter_listener: Callable[[list[AdapterRecord]], None] | None = None
        self._poked: asyncio.Event | None = None

    def listen(self, pool: str, listener: Callable[[list[ReplicaReport]], None]) -> None:
        self._listeners.setdefault(pool, []).append(listener)

    def listen_adapters(self, listener: Callable[[list[AdapterRecord]], None]) -> None:
        """Hand `listener` the adapters loaded at run time after every read of the registry."""
        self._adapter_listener = listener

    async def adapters(self, timeout_s: float = 2.0) -> list[AdapterRecord]:
        return await asyncio.wait_for(self._registry.adapters(), timeout_s)

    async def add_adapter(self, record: AdapterRecord, timeout_s: float = 2.0) -> None:
        await asyncio.wait_for(self._registry.add_adapter(record), timeout_s)

    async def remove_adapter(self, name: str, timeout_s: float = 2.0) -> None:
        await asyncio.wait_for(self._registry.remove_adapter(name), timeout_s)

    async def snapshot(self, timeout_s: float = 2.0) -> list[ReplicaReport]:
        """Every replica's latest report, read now (raises if the registry does not answer)."""
        return await asyncio.wait_for(self._registry.snapshot(), timeout_s)

    async def scaling(self, timeout_s: float = 2.0) -> list[ScaleRecord]:
        return await asyncio.wait_for(self._registry.scaling(), timeout_s)

    async def announce(self, report: IngressReport, timeout_s: float = 2.0) -> None:
        await asyncio.wait_for(self._registry.announce(report), timeout_s)

    async def ingresses(self, timeout_s: float = 2.0) -> list[IngressReport]:
        return await asyncio.wait_for(self._registry.ingresses(), timeout_s)

    async def forget(self, replica_id: str, timeout_s: float = 2.0) -> None:
        await asyncio.wait_for(self._registry.forget(replica_id), timeout_s)

    async def forget_ingress(self, replica_id: str, timeout_s: float = 2.0) -> None:
        await asyncio.wait_for(self._registry.forget_ingress(replica_id), timeout_s)

    def poke(self) -> None:
        """Read the registry again now (a request found no replica that could take it)."""
        if self._poked is not None:
            self._poked.set()

    async def run(self) -> None:
        self._poked = asyncio.Event()
        while True:
            try:
                reports = await self.snapshot()
            except Exception as exc:  # noqa: BLE001 - keep routing on what we know
                logger.warning("replica registry unavailable: %r", exc)
            else:
                for pool, listeners in self._listeners.items():
                    own = [r for r in reports if r.pool == pool]
                    for listener in listeners:
                        listener(own)
            if self._adapter_listener is not None:
                try:
                    self._adapter_listener(await self.adapters())
                except Exception as exc:  # noqa: BLE001 - keep serving the adapters we know
                    logger.warning("adapter registry unavailable: %r", exc)
            self._poked.clear()
            try:
                await asyncio.wait_for(self._poked.wait(), self._refresh_s)
            except TimeoutError:
                pass


NO_REPLICA = "no_replica"  # the code of the 503 for a request no replica took (it is refunded)
OVERLOADED = "overloaded"  # the code of the 503 of load shedding (refunded too)
SHED_RETRY_AFTER_S = 1.0


class PoolDispatcher:
    """Places the requests of one pool. Runs on the ingress process's event loop."""

    def __init__(self, pool: str, service: RoutingService, max_ongoing_requests: int,
                 secret: bytes, gateway: str, wake: Callable[[], Awaitable[None]],
                 directory: ReplicaDirectory, retries: int = 0,
                 shed_waiting: int | None = None, migrate: bool = True,
                 route_ranks: bool = True, local: Mapping[str, LocalLink] | None = None) -> None:
        self.pool, self.service, self.retries, self.migrate = pool, service, retries, migrate
        self._route_ranks = route_ranks
        self._shed_waiting = shed_waiting
        self._max_ongoing, self._secret, self._gateway = max_ongoing_requests, secret, gateway
        self._wake, self._directory = wake, directory
        self._local = dict(local or {})  # replicas in this process, reached by calls
        self._links: dict[ReplicaId, ReplicaLink | LocalLink] = {}  # by replica
        # routing targets (a replica's engine, or each data-parallel rank) -> replica, rank
        self._targets: dict[ReplicaId, tuple[ReplicaId, int | None]] = {}
        self._retiring: dict[ReplicaId, ReplicaLink | LocalLink] = {}  # unlisted, still serving
        self._changed: asyncio.Future[None] | None = None
        self._held = 0
        self._held_report: asyncio.TimerHandle | None = None
        self._waking: asyncio.Task[None] | None = None
        directory.listen(pool, self.update)

    @property
    def held(self) -> int:
        return self._held

    def ready_replicas(self) -> int:
        return sum(link.state == "ready" for link in self._links.values())

    # -- replicas -----------------------------------------------------------------------------

    def update(self, reports: Sequence[ReplicaReport]) -> None:
        """The pool's replicas as the registry reports them now.

        A replica that is no longer reported ready (draining, failed, gone; or the registry was
        restarted and has not heard from it yet) gets no new request, but its link stays open
        while requests are on it: they end by themselves, or fail (and are retried or continued)
        when its connection breaks. What the registry says never cuts a reply short.
        """
        ready = {ReplicaId(r.replica_id): r.channel for r in reports
                 if r.state == "ready" and r.channel}  # -> its channel's address
        for replica in [r for r in self._links if r not in ready]:
            self._retiring[replica] = self._links.pop(replica)
        for replica, link in list(self._retiring.items()):
            if replica in ready and link.state != "closed":
                self._links[replica] = self._retiring.pop(replica)  # reported again
            elif replica in ready or not link.open_streams:
                self._retiring.pop(replica).close()
        for replica, address in ready.items():
            current = self._links.get(replica)
            if current is None or (current.state == "closed"
                                   and current.closed_for_s() > RECONNECT_S):
                self._connect(replica, address)
        views = [view for r in reports if r.state == "ready"
                 for view in views_of(r, self._route_ranks)]
        self._targets = {view.replica: (ReplicaId(view.host) if view.rank is not None
                                        else view.replica, view.rank) for view in views}
        self.service.set_replicas(views)
        for replica, link in self._links.items():  # targets may be new: what each said last
            self._adapters_said(replica, link)
        self._notify()

    def _connect(self, replica: ReplicaId, address: str) -> None:
        local = self._local.get(replica)
        if local is not None:
            local.on_state = lambda _link: self._notify()
            local.on_adapters = partial(self._adapters_said, replica)
            self._links[replica] = local
            if self._held:
                local.send_held(self._held)
            return
        host, port = address.rsplit(":", 1)
        link = ReplicaLink(replica, host, int(port), self._secret, self._gateway)
        link.on_state = lambda _link: self._notify()
        link.on_adapters = partial(self._adapters_said, replica)
        self._links[replica] = link

        async def connect() -> None:
            try:
                await link.connect()
            except LinkLost as exc:
                logger.warning("pool %s: %s", self.pool, exc)
            else:
                if self._held:
                    link.send_held(self._held)
            self._notify()

        asyncio.get_running_loop().create_task(connect(), name=f"link-{replica}")

    def _adapters_said(self, replica: ReplicaId, link: ReplicaLink | LocalLink) -> None:
        """The replica told (channel frame ADAPTERS) the adapters it holds and runs: each of
        its routing targets (its engine, or each data-parallel rank) runs those of its rank."""
        said, residency = link.adapters, self.service.adapters
        if said is None or residency is None:
            return
        for target, (host, rank) in self._targets.items():
            if host != replica:
                continue
            if rank is not None and rank < len(said.running):
                running = said.running[rank]
            else:  # the engine picks the rank: any of its batches
                running = {}
                for counts in said.running:
                    for adapter, count in counts.items():
                        running[adapter] = running.get(adapter, 0) + count
            residency.observed(target, said.held, running)

    def _available(self, skip: set[ReplicaId]) -> list[ReplicaId]:
        """Targets that can take a request now, on replicas not in `skip`. Those whose circuit
        breaker is open are left out, unless that would leave none (a pool never shuts itself
        off entirely)."""
        links = self._links
        open_ = [target for target, (replica, _) in self._targets.items()
                 if replica not in skip and (link := links.get(replica)) is not None
                 and link.state == "ready" and self.service.in_flight(target) < self._max_ongoing]
        allowed = [target for target in open_ if self.service.allows(target)]
        return allowed or open_

    def failed(self, replica: ReplicaId) -> None:
        """A request failed on `replica` before it was answered: count it against each of its
        targets (see RoutingService.failed)."""
        targets = [t for t, (host, _) in self._targets.items() if host == replica]
        for target in targets or [replica]:
            self.service.failed(target)

    # -- requests -----------------------------------------------------------------------------

    async def open(self, request: Request, key: RouteKey, deadline: float,
                   exclude: frozenset[ReplicaId] = frozenset()) -> tuple[ReplyStream, Head]:
        """Open the request on the best replica that takes it, never one in `exclude`; its head
        once it came. Waits while no replica can take it; GatewayError 503/504 when the deadline
        passes first, ReplicaFailed when the replica failed before answering."""
        if not exclude:
            self._shed_if_overloaded()
        skip: set[ReplicaId] = set(exclude)  # replicas
        while True:
            for target in self.service.rank(key, self._available(skip)):
                # the registry may have been read again while an earlier choice answered
                found = self._targets.get(target)
                if found is None:
                    continue
                replica, rank = found
                link = self._links.get(replica)
                if link is None or replica in skip:  # gone, or refused in this turn
                    continue
                try:
                    stream = link.open(request if rank is None
                                       else msgspec.structs.replace(request, rank=rank))
                except LinkLost:
                    skip.add(replica)
                    continue
                try:
                    head = await _head(stream, deadline)
                except BaseException:  # failed, timed out or cancelled: no leg to finish later
                    self.service.finished(key.request_id)
                    raise
                if isinstance(head, Head):
                    self.service.dispatched(key, target)
                    return stream, head
                skip.add(replica)  # refused (full or draining) or gone before answering
            self.service.finished(key.request_id)  # counted on a replica that did not take it
            if not await self._hold(deadline):
                raise GatewayError(503, f"no replica of pool {self.pool} could take the request "
                                        f"within the request deadline; retry", code=NO_REPLICA)
            skip = set(exclude)

    def _shed_if_overloaded(self) -> None:
        """Load shedding (pools[].shed_waiting): refuse a new request at once when every ready
        replica's engine queue is at the bound, rather than add to it."""
        bound = self._shed_waiting
        if bound is None:
            return
        links = self._links
        ready = [target for target, (replica, _) in self._targets.items()
                 if (link := links.get(replica)) is not None and link.state == "ready"]
        if ready and all(self.service.waiting(target) >= bound for target in ready):
            raise GatewayError(503, f"pool {self.pool} is overloaded: every replica has {bound} "
                               "or more requests waiting; retry later", code=OVERLOADED,
                               retry_after_s=SHED_RETRY_AFTER_S)

    def finished(self, key: RouteKey) -> None:
        """The request ended (however): its replica has room again."""
        self.service.finished(key.request_id)
        if self._held:
            self._notify()

    async def _hold(self, deadline: float) -> bool:
        """Wait for a change (a request ended, a replica came or went); False at the deadline."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        if not self._links:
            self._directory.poke()
            if self._waking is None or self._waking.done():
                self._waking = asyncio.get_running_loop().create_task(self._wake_pool())
        if self._changed is None or self._changed.done():
            self._changed = asyncio.get_running_loop().create_future()
        self._held += 1
        self._report_held()
        try:
            await asyncio.wait_for(asyncio.shield(self._changed), min(remaining, HOLD_RECHECK_S))
        except TimeoutError:
            pass
        finally:
            self._held -= 1
            self._report_held()
        return True

    async def _wake_pool(self) -> None:
        try:
            await self._wake()
        except Exception as exc:  # noqa: BLE001 - a failed wake-up is retried by the next hold
            logger.warning("could not wake pool %s: %r", self.pool, exc)

    def _notify(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)

    def _report_held(self) -> None:
        if self._held_report is None:
            self._held_report = asyncio.get_running_loop().call_later(
                HELD_REPORT_DELAY_S, self._send_held)

    def _send_held(self) -> None:
        self._held_report = None
        for link in self._links.values():
            link.send_held(self._held)

    def close(self) -> None:
        for link in [*self._links.values(), *self._retiring.values()]:
            link.close()
        self._links.clear()
        self._retiring.clear()
        self.service.stop()


async def _head(stream: ReplyStream, deadline: float) -> Head | Refused | None:
    """The stream's head; None if the replica went away before answering (try another)."""
    try:
        return await asyncio.wait_for(stream.head, max(0.0, deadline - time.monotonic()))
    except TimeoutError as exc:
        stream.cancel()
        raise GatewayError(504, "no reply from the engine within the request deadline") from exc
    except LinkLost:
        return None
    except ReplyFailed as exc:
        raise ReplicaFailed(stream.replica, f"engine replica failed: {exc}; retry") from exc
    except BaseException:
        stream.cancel()
        raise
