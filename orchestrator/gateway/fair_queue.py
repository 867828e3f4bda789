"""Admission into the pools when they are saturated: a fair queue on tokens served.

At most `capacity` requests are in the pools at once (per ingress replica). Beyond that, requests
wait per tenant, and a freed slot goes to the highest priority class with a request waiting, then
to the tenant with the smallest virtual token counter (VTC, Sheng et al., "Fairness in Serving
Large Language Models", OSDI 2024), first come first served within a tenant.

A tenant's counter grows by the tokens it is served divided by its weight: prompt plus max_tokens
when admitted, corrected to prompt plus generated tokens when the request ends. So, saturated,
tenants receive tokens in proportion to their weights, whatever their request rates. A tenant that
was idle does not bank credit: when it starts waiting, its counter is lifted to the smallest
counter among the tenants waiting (or, if none wait, among those with requests in the pools).

Worked example, capacity 1, equal weights, every request 100 tokens. A has been served 500
tokens and has more requests waiting; B, idle until now with counter 0, sends one: it is lifted
to 500, the smallest counter among those waiting (A's). The slot frees: A and B tie at 500 and a
tie goes to whoever has waited longer, A. A's counter becomes 600, so the next slot is B's
(500 < 600); from then on A and B alternate while both wait, however many requests A queues.

Bounded: a tenant may have `max_queued` requests waiting (beyond: 429), and a request waits at
most `timeout_s` (beyond: 503). A waiter whose client goes away leaves the queue.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from orchestrator.gateway.errors import GatewayError
from orchestrator.tenant_config import PriorityClass

_CLASS_ORDER: dict[PriorityClass, int] = {"high": 0, "normal": 1, "low": 2}


@dataclass(eq=False)
class _Waiter:
    tenant: str
    cost: float
    weight: float
    priority: int
    order: int
    granted: asyncio.Future[None] = field(repr=False)


class FairQueue:
    """One per ingress replica; every method runs on its event loop."""

    def __init__(self, capacity: int | None, max_queued: int, timeout_s: float) -> None:
        self.capacity, self._max_queued, self._timeout_s = capacity, max_queued, timeout_s
        self.in_flight = 0
        self.counters: dict[str, float] = {}
        self._waiting: dict[str, deque[_Waiter]] = {}
        self._running: dict[str, int] = {}
        self._order = itertools.count()

    def queued(self, tenant: str) -> int:
        return len(self._waiting.get(tenant, ()))

    async def acquire(self, tenant: str, cost: float, weight: float = 1.0,
                      priority: PriorityClass = "normal") -> float:
        """Wait for a slot; return the seconds waited. Raises 429 (tenant's queue full) or 503
        (waited `timeout_s`)."""
        if self.capacity is None or (self.in_flight < self.capacity and not self._any_waiting()):
            self._start(tenant, cost, weight)
            return 0.0
        queue = self._waiting.setdefault(tenant, deque())
        if len(queue) >= self._max_queued:
            raise GatewayError(429, f"tenant {tenant} already has {len(queue)} requests waiting "
                               "for capacity", code="queue_full", retry_after_s=1.0)
        if not queue:
            self._lift(tenant)
        waiter = _Waiter(tenant, cost, weight, _CLASS_ORDER[priority], next(self._order),
                         asyncio.get_running_loop().create_future())
        queue.append(waiter)
        started = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.granted), self._timeout_s)
        except TimeoutError:
            if not waiter.granted.done():
                self._remove(waiter)
                raise GatewayError(503, f"no capacity within {self._timeout_s:g} s; retry later",
                                   code="queue_timeout", retry_after_s=1.0) from None
        except BaseException:  # the client went away while waiting
            if waiter.granted.done():
                self.release(tenant, cost, 0.0, weight)  # granted, never served
            else:
                self._remove(waiter)
            raise
        return time.monotonic() - started

    def release(self, tenant: str, charged: float, served: float, weight: float = 1.0) -> None:
        """A request admitted with cost `charged` ended having been served `served` tokens."""
        if self.capacity is None:
            return
        self.counters[tenant] = self.counters.get(tenant, 0.0) + (served - charged) / weight
        self.in_flight -= 1
        self._running[tenant] -= 1
        self._dispatch()

    def set_capacity(self, capacity: int) -> None:
        """A new bound (a bounded queue's: the ingress replicas' share changed); more waiting
        requests start at once if it grew."""
        assert self.capacity is not None, "an unbounded queue stays unbounded"
        self.capacity = capacity
        self._dispatch()

    def _start(self, tenant: str, cost: float, weight: float) -> None:
        if self.capacity is None:
            return
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / weight
        self.in_flight += 1
        self._running[tenant] = self._running.get(tenant, 0) + 1

    def _any_waiting(self) -> bool:
        return any(self._waiting.values())

    def _lift(self, tenant: str) -> None:
        """A tenant starts waiting: no credit from idleness (see the module docstring)."""
        peers = [t for t, q in self._waiting.items() if q and t != tenant] or \
                [t for t, n in self._running.items() if n and t != tenant]
        if peers:
            floor = min(self.counters.get(t, 0.0) for t in peers)
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def _dispatch(self) -> None:
        capacity = self.capacity
        assert capacity is not None  # its callers return first when unbounded
        while self.in_flight < capacity and self._any_waiting():
            heads = [q[0] for q in self._waiting.values() if q]
            best = min(heads, key=lambda w: (w.priority, self.counters.get(w.tenant, 0.0),
                                             w.order))
            self._waiting[best.tenant].popleft()
            self._start(best.tenant, best.cost, best.weight)
            best.granted.set_result(None)

    def _remove(self, waiter: _Waiter) -> None:
        queue = self._waiting.get(waiter.tenant)
        if queue and waiter in queue:
            queue.remove(waiter)
