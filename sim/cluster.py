"""A simulated pool behind a simulated gateway that routes with tokenfab's real router.

The gateway does what `orchestrator.gateway.dispatch.PoolDispatcher` does with the same
`router.service.RoutingService` (unchanged, on the simulated clock): it ranks the ready replicas
that have room, dispatches to the first, reports first tokens and ends, and holds a request while
no replica has room. The service learns the replicas from a registry refresh every `refresh_s`
(load, KV usage, capacity, as `ReplicaView`s) and the blocks from each engine step's KV events,
delivered after `event_lag_s`. The wall time of each decision (`rank` and `dispatched`) and of
applying the events is measured: it is the real code's cost at this scale. A cluster is one pool;
`sim.pd` joins a prefill and a decode one.

A policy named in `sim.baselines` (another router's, ported) chooses instead of the service's
`rank`; the service still counts each replica's requests in flight, which is the load that port
reads, and that router's engines' events go to the port. Those routers bound no replica, so
`max_ongoing_requests` does not apply to them.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from router.events import NO_TOKENS, BlockRemoved, BlockStored, KVEventBatch
from router.index import ReplicaId
from router.policies import build_policy
from router.service import RoutingService
from router.wire import ReplicaView, RouteKey
from sim.baselines import BaselineRouter, build_baseline, is_baseline
from sim.engine import PullTime, SimEngine, SimRequest
from sim.loop import EventLoop
from sim.params import EngineParams

POOL = "main"


@dataclass
class SimReplica:
    name: ReplicaId
    engine: SimEngine
    state: str  # starting, ready, draining
    started_at: float


class SimCluster:
    """One pool (unified, unless `sim.pd` makes it a prefill or decode one: `pull_s` and
    `on_pulled` go to its engines, `on_finished` hears of each request it ends). Owned by the
    loop's callbacks; nothing here is thread-safe."""

    def __init__(self, loop: EventLoop, params: EngineParams, policy: str, replicas: int, *,
                 weights: Mapping[str, float] | None = None, seed: int = 0,
                 max_ongoing_requests: int = 256, event_lag_s: float = 0.002,
                 refresh_s: float = 1.0, max_index_entries: int | None = None,
                 max_history_entries: int | None = None, max_in_flight: int | None = None,
                 ttft_target_s: float = 0.0, pool: str = POOL,
                 prefix: str = "r", pull_s: PullTime | None = None,
                 on_pulled: Callable[[SimRequest], None] | None = None,
                 on_finished: Callable[[SimRequest], None] | None = None) -> None:
        self.loop, self.params, self.pool = loop, params, pool
        self._prefix, self._pull_s, self._on_pulled = prefix, pull_s, on_pulled
        self._on_finished = on_finished
        self.baseline: BaselineRouter | None = None
        if is_baseline(policy):
            self.baseline = build_baseline(policy, params.block_size, loop.clock,
                                           random.Random(seed))
            policy = "round_robin"  # the service then only counts requests in flight
        # `router.max_in_flight` (None: each engine's max_num_seqs, as the views report it)
        self.policy = build_policy(policy, weights, max_in_flight=max_in_flight,
                                   ttft_target_s=ttft_target_s, rng=random.Random(seed))
        bounds = {"max_index_entries": max_index_entries,
                  "max_history_entries": max_history_entries}
        extra = {name: value for name, value in bounds.items() if value is not None}
        # its engines' events reach it through `apply_events` (the views name no endpoint to
        # follow); `follow_events` says that a policy reading the block map has one fed
        self.service = RoutingService(pool, self.policy, _no_hasher, follow_events=True,
                                      clock=loop.clock, **extra)
        self.max_ongoing, self.event_lag_s, self.refresh_s = (max_ongoing_requests, event_lag_s,
                                                              refresh_s)
        self.replicas: dict[ReplicaId, SimReplica] = {}
        self.held: deque[SimRequest] = deque()
        self.decision_ns: list[int] = []
        self.apply_ns = 0  # wall time the router spent applying KV events
        self.finished: list[SimRequest] = []
        self.peak_index_entries = self.peak_history_entries = 0
        self._serial = 0
        self._outstanding = 0
        self._ticking = False
        for _ in range(replicas):
            self.add_replica(ready=True)

    # -- replicas -----------------------------------------------------------------------------

    def add_replica(self, ready: bool = False) -> ReplicaId:
        """A new replica; ready at once, or after the profile's start latency."""
        name = ReplicaId(f"{self._prefix}{self._serial}")
        self._serial += 1
        engine = SimEngine(self.loop, self.params, name,
                           on_events=lambda events, n=name: self._events(n, events),
                           on_first_token=self._first_token, on_finished=self._finished,
                           pull_s=self._pull_s, on_pulled=self._on_pulled)
        replica = self.replicas[name] = SimReplica(name, engine, "ready" if ready else "starting",
                                                   self.loop.now)
        if not ready:
            self.loop.after(self.params.start_latency_s, lambda: self._ready(replica))
        else:
            self._refresh_views()
        return name

    def _ready(self, replica: SimReplica) -> None:
        if replica.state == "starting":
            replica.state = "ready"
            self._refresh_views()
            self._retry_held()

    def drain_replica(self) -> ReplicaId | None:
        """Stop sending to the newest replica (those still starting first); it leaves when its
        requests are done."""
        order = sorted(self.replicas.values(),
                       key=lambda r: (r.state != "starting", -r.started_at))
        for replica in order:
            if replica.state in ("starting", "ready"):
                replica.state = "draining"
                self._leave_if_idle(replica)
                self._refresh_views()
                return replica.name
        return None

    def _leave_if_idle(self, replica: SimReplica) -> None:
        """A draining replica with nothing left leaves: nothing on its engine, nor sent there
        and on its way (the request overhead). Once: requests that end in the same step each
        ask."""
        if replica.state == "draining" and replica.engine.load() == 0 \
                and self.service.in_flight(replica.name) == 0 \
                and self.replicas.get(replica.name) is replica:
            del self.replicas[replica.name]

    def ready_replicas(self) -> list[ReplicaId]:
        return [r.name for r in self.replicas.values() if r.state == "ready"]

    def count(self, *states: str) -> int:
        return sum(r.state in states for r in self.replicas.values())

    # -- requests -----------------------------------------------------------------------------

    def submit(self, requests: Iterable[SimRequest]) -> None:
        for request in requests:
            self._outstanding += 1
            self.loop.at(request.arrival, lambda r=request: self._route(r))
        self._tick()

    def route_now(self, request: SimRequest) -> None:
        """A request that reaches this pool now (a leg of a disaggregated one)."""
        self._outstanding += 1
        self._tick()
        self._route(request)

    def _route(self, request: SimRequest) -> bool:
        """Dispatch `request`, or hold it (False) while no ready replica has room."""
        service, baseline = self.service, self.baseline
        bound = self.max_ongoing if baseline is None else math.inf
        available = [r for r in self.ready_replicas() if service.in_flight(r) < bound]
        if not available:
            self.held.append(request)
            return False
        hashes = list(request.block_hashes) if self.policy.uses_prefixes else []
        key = RouteKey(request.request_id, request.prompt_tokens, self.params.block_size, hashes)
        began = time.perf_counter_ns()
        if baseline is None:
            target = service.rank(key, available)[0]
        else:
            target = baseline.choose(request.request_id, request.block_hashes,
                                     request.prompt_tokens, available,
                                     {r: service.in_flight(r) for r in available})
        service.dispatched(key, target)
        self.decision_ns.append(time.perf_counter_ns() - began)
        self.peak_history_entries = max(self.peak_history_entries, service.history_entries())
        request.replica = target
        engine = self.replicas[target].engine
        self.loop.after(self.params.overhead_s(engine.load()), lambda: engine.add(request))
        return True

    def _first_token(self, request: SimRequest) -> None:
        self.service.first_token(request.request_id)
        if self.baseline is not None:
            self.baseline.first_token(request.request_id)

    def _finished(self, request: SimRequest) -> None:
        self.service.finished(request.request_id)
        if self.baseline is not None:
            self.baseline.finished(request.request_id)
        self.finished.append(request)
        self._outstanding -= 1
        if self._on_finished is not None:
            self._on_finished(request)
        replica = self.replicas.get(ReplicaId(request.replica))
        if replica is not None:
            self.loop.after(0.0, lambda: self._leave_if_idle(replica))
        self._retry_held()

    def _retry_held(self) -> None:
        """Place held requests, oldest first, until no replica has room (then none would: room
        does not depend on the request; trying each one made an overloaded pool quadratic)."""
        while self.held:
            if not self._route(self.held.popleft()):
                self.held.appendleft(self.held.pop())  # back at the head, where it waited
                return

    def _events(self, replica: ReplicaId, events: list[tuple[bool, int]]) -> None:
        baseline = self.baseline
        if baseline is not None and baseline.reads_events:
            self.loop.after(self.event_lag_s, lambda: self._to_baseline(baseline, replica, events))
        if not self.policy.reads_block_map:  # the gateway follows no events then
            return
        batch = KVEventBatch(self.loop.now, _events(events))
        self.loop.after(self.event_lag_s, lambda: self._apply(replica, batch))

    def _to_baseline(self, baseline: BaselineRouter, replica: ReplicaId,
                     events: list[tuple[bool, int]]) -> None:
        if replica in self.replicas:
            began = time.perf_counter_ns()
            baseline.kv_events(replica, events)
            self.apply_ns += time.perf_counter_ns() - began

    def _apply(self, replica: ReplicaId, batch: KVEventBatch) -> None:
        if replica in self.replicas:  # a replica that left was dropped from the map
            began = time.perf_counter_ns()
            self.service.apply_events(replica, batch)
            self.apply_ns += time.perf_counter_ns() - began
            self.peak_index_entries = max(self.peak_index_entries, self.service.index_entries())

    # -- the registry -------------------------------------------------------------------------

    def _tick(self) -> None:
        if self._ticking:
            return
        self._ticking = True
        self.loop.after(self.refresh_s, self._on_tick)

    def _on_tick(self) -> None:
        self._ticking = False
        self._refresh_views()
        if self._outstanding:
            self._tick()

    def _refresh_views(self) -> None:
        p = self.params
        self.service.set_replicas([
            ReplicaView(replica=r.name, pool=self.pool, block_size=p.block_size,
                        kv_blocks=p.kv_blocks, max_num_seqs=p.max_num_seqs,
                        in_flight=r.engine.load(),
                        waiting=len(r.engine.waiting), kv_usage=r.engine.kv_usage())
            for r in self.replicas.values() if r.state == "ready"])


def _events(events: list[tuple[bool, int]]) -> list[BlockStored | BlockRemoved]:
    """Runs of stored and removed hashes, in order, as vLLM's events."""
    out: list[BlockStored | BlockRemoved] = []
    run: list[int] = []
    for k, (stored, block) in enumerate(events):
        run.append(block)
        if k + 1 == len(events) or events[k + 1][0] != stored:
            out.append(BlockStored(run, None, NO_TOKENS, 0, None, None, None) if stored
                       else BlockRemoved(run, None))
            run = []
    return out


def _no_hasher(block_size: int):
    raise AssertionError("the simulated gateway passes block hashes; nothing is hashed here")
