"""Which replica holds which LoRA adapter, which adapters it is running, as one router sees it,
and what a request for an adapter costs on each replica before its prefill can start.

Two things delay a request for adapter A on a replica, besides the queue every request sees:
- **the load.** vLLM keeps at most `max_cpu_loras` adapters loaded per engine and evicts the
  least recently used. A replica tells every gateway the adapters its engine holds, least
  recently used first, whenever that changes (the data channel's ADAPTERS frame), and reports
  the median time its loads took about once a second. Between two frames this router counts
  its own dispatches: A becomes the most recently used there, and those beyond the capacity
  drop out, as in vLLM's cache.
- **the slot.** One engine batch runs at most `max_loras` adapters. Where that many other
  adapters have requests running, A's request waits until every request of one of them has
  finished. With each request at a uniformly random point of a request's duration D, a group
  of k requests has ended by a share t of D with probability t^k, so the first of the groups
  holding the slots ends after D x integral over [0, 1] of prod_g (1 - t^k_g) dt (D / 3 for two
  groups of one request). D is the mean duration of this router's adapter requests on the pool,
  from dispatch to the end of the reply.
  The requests running on a replica are, per adapter, the larger of this router's count and
  the replica's own (its ADAPTERS frames count every gateway's requests, a few milliseconds
  late; this router's count has its latest dispatches at once). Counts a second old, as the
  registry's reports would give, sent requests away from replicas whose slots had long freed
  (docs/analysis/lora-notes.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from router.index import ReplicaId

DEFAULT_LOAD_S = 0.05  # a load's cost before any replica of the pool has measured one
DEFAULT_DURATION_S = 1.0  # a request's duration before this router has seen one end
DURATION_WEIGHT = 0.1  # of each new request in the mean duration (an exponential average)
MAX_TRACKED = 100_000  # requests dispatched and not yet finished that are followed


def _first_end(groups: Sequence[int]) -> float:
    """The expected share of a request's duration until the first of `groups` (each a count
    of requests at uniformly random points of their duration) has no request left: the
    integral over [0, 1] of prod_g (1 - t^k_g) dt, by expanding the product.

    Example: [1] -> 1/2; [1, 1] -> 1 - 1/2 - 1/2 + 1/3 = 1/3."""
    terms: dict[int, float] = {0: 1.0}  # exponent -> coefficient
    for k in groups:
        product = dict(terms)
        for exponent, coefficient in terms.items():
            product[exponent + k] = product.get(exponent + k, 0.0) - coefficient
        terms = product
    return sum(coefficient / (exponent + 1) for exponent, coefficient in terms.items())


class AdapterResidency:
    """One pool's adapters per replica. Owned by the pool's routing service (one event loop).
    `capacity` is the adapters an engine keeps loaded, `slots` those one batch runs."""

    def __init__(self, capacity: int, slots: int | None = None,
                 prior_load_s: float = DEFAULT_LOAD_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = max(1, capacity)
        self.slots = max(1, slots or capacity)
        self._prior_load_s, self._clock = prior_load_s, clock
        self._held: dict[ReplicaId, list[str]] = {}  # least recently used first
        self._load_s: dict[ReplicaId, float] = {}
        self._running: dict[ReplicaId, dict[str, int]] = {}  # this router's, per adapter
        self._said: dict[ReplicaId, dict[str, int]] = {}  # the replica's (every gateway's)
        self._requests: dict[str, tuple[ReplicaId, str, float]] = {}
        self.duration_s = DEFAULT_DURATION_S

    def reported(self, replica: ReplicaId, held: Sequence[str], load_s: float) -> None:
        """The replica's registry report: its measured load time (0: none measured), and the
        adapters it holds, used until it tells them over the channel (`observed`)."""
        if replica not in self._said:
            self._held[replica] = list(held)[-self.capacity:]
        if load_s > 0:
            self._load_s[replica] = load_s

    def observed(self, replica: ReplicaId, held: Sequence[str],
                 running: dict[str, int]) -> None:
        """What the replica told just now: the adapters it holds (least recently used first),
        and its requests in flight per adapter, from every gateway."""
        self._held[replica] = list(held)[-self.capacity:]
        self._said[replica] = dict(running)

    def forget(self, replica: ReplicaId) -> None:
        self._held.pop(replica, None)
        self._load_s.pop(replica, None)
        self._running.pop(replica, None)
        self._said.pop(replica, None)

    def dispatched(self, replica: ReplicaId, adapter: str, request_id: str) -> None:
        """A request for `adapter` went to `replica`: it holds it now, as most recently used,
        and runs it until `finished(request_id)`."""
        held = self._held.setdefault(replica, [])
        if adapter in held:
            held.remove(adapter)
        held.append(adapter)
        del held[:-self.capacity]
        running = self._running.setdefault(replica, {})
        running[adapter] = running.get(adapter, 0) + 1
        self._requests.pop(request_id, None)
        self._requests[request_id] = (replica, adapter, self._clock())
        if len(self._requests) > MAX_TRACKED:  # never finished (a caller's bug): forget it
            self._end(next(iter(self._requests)), count=False)

    def finished(self, request_id: str) -> None:
        """The request's reply ended (or it failed): its adapter's slot may free."""
        self._end(request_id, count=True)

    def _end(self, request_id: str, count: bool) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        replica, adapter, started = entry
        running = self._running.get(replica, {})
        if running.get(adapter, 0) <= 1:
            running.pop(adapter, None)
        else:
            running[adapter] -= 1
        if count:
            elapsed = self._clock() - started
            self.duration_s += DURATION_WEIGHT * (elapsed - self.duration_s)

    def load_cost_s(self, replica: ReplicaId, adapter: str | None) -> float:
        """Seconds loading the request's adapter adds on `replica`: 0 where it is held (or for
        the base model), else the replica's measured load time, or the pool's median one where
        the replica has measured none yet.

        Example: a holds [x, y], measured 0.02 s; b holds [y], measured nothing; pool median
        0.02 -> x on a: 0.0; x on b: 0.02."""
        if adapter is None or adapter in self._held.get(replica, ()):
            return 0.0
        measured = self._load_s.get(replica)
        if measured is not None:
            return measured
        times = sorted(self._load_s.values())
        return times[len(times) // 2] if times else self._prior_load_s

    def slot_wait_s(self, replica: ReplicaId, adapter: str | None) -> float:
        """Seconds the request waits for a batch slot on `replica`: 0 where the adapter is
        running there or a slot is free, else until the first of the groups in the slots ends
        (module docstring). Where more adapters have requests in flight than there are slots,
        the largest groups are taken as those running (the wait is not understated).

        Example (2 slots, D = 2 s): running {x: 3, y: 1} -> x or y: 0; z: 2 x (1 - 1/4 - 1/2
        + 1/5) = 0.9 s; running {x: 1, y: 1} -> z: 2 x 1/3."""
        running = self.running(replica)
        if adapter is None or not running or adapter in running or len(running) < self.slots:
            return 0.0
        groups = sorted(running.values(), reverse=True)[:self.slots]
        return self.duration_s * _first_end(groups)

    def running(self, replica: ReplicaId) -> dict[str, int]:
        """Requests in flight on `replica` per adapter: per adapter, the larger of this
        router's count and the replica's latest.

        Example: this router sent x twice; the replica said {x: 1, y: 2} -> {x: 2, y: 2}."""
        own, said = self._running.get(replica, {}), self._said.get(replica, {})
        if not said:
            return own
        merged = dict(said)
        for adapter, count in own.items():
            merged[adapter] = max(count, merged.get(adapter, 0))
        return merged

    def snapshot(self) -> dict[str, dict[str, object]]:
        """Each replica's adapters as this router believes them (for admin views)."""
        replicas = self._held.keys() | self._running.keys() | self._said.keys()
        return {replica: {"held": list(self._held.get(replica, ())),
                          "running": self.running(replica)}
                for replica in replicas}
