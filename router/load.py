"""This router's own view of the load it put on each replica, and what it recently sent where.

Requests are tracked from dispatch to first token (their prompt is queued prefill work) and to the
end (they are in flight). The time from dispatch to first token, against the prefill work that
was queued ahead plus the request's own, gives each replica's prefill throughput, measured online.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.events import EngineBlockHash
from router.index import ReplicaId


@dataclass
class _InFlight:
    replica: ReplicaId
    prefill_tokens: int  # uncached prompt tokens, predicted at dispatch
    work_ahead: int  # prefill tokens queued on the replica at dispatch, this one included
    dispatched_at: float
    prefilled: bool = False


class LoadTracker:
    """Not thread-safe: the routing service calls it under its lock."""

    def __init__(self, prior_tokens_per_s: float = 4000.0, smoothing: float = 0.2,
                 min_sample_tokens: int = 512, clock: Callable[[], float] = time.monotonic) -> None:
        self._prior, self._alpha, self._min_sample = prior_tokens_per_s, smoothing, min_sample_tokens
        self._clock = clock
        self._requests: dict[str, _InFlight] = {}
        self._queued: dict[ReplicaId, int] = {}
        self._in_flight: dict[ReplicaId, int] = {}
        self._rate: dict[ReplicaId, float] = {}

    def dispatched(self, request_id: str, replica: ReplicaId, prefill_tokens: int) -> None:
        """Count the request on `replica` (moving it there if it was counted elsewhere)."""
        previous = self._requests.get(request_id)
        if previous is not None:
            if previous.replica == replica:
                return
            self._drop(request_id)
        queued = self._queued.get(replica, 0) + prefill_tokens
        self._requests[request_id] = _InFlight(replica, prefill_tokens, queued, self._clock())
        self._queued[replica] = queued
        self._in_flight[replica] = self._in_flight.get(replica, 0) + 1

    def first_token(self, request_id: str) -> None:
        """The replica answered the request's first token: its prompt is no longer queued.

        The throughput sample is the work that had to be done before this first token (queued
        ahead plus its own) over the time it took. Example: 1,500 tokens ahead, 500 own, first
        token after 0.5 s -> 4,000 tokens/s, blended into the replica's average. Requests with
        less than `min_sample_tokens` of work are not samples: their time is mostly fixed
        overhead (the hops, one engine step), which would make a replica look slow.
        """
        request = self._requests.get(request_id)
        if request is None or request.prefilled:
            return
        request.prefilled = True
        self._queued[request.replica] -= request.prefill_tokens
        elapsed = self._clock() - request.dispatched_at
        if request.work_ahead >= self._min_sample and elapsed > 0:
            sample = request.work_ahead / elapsed
            old = self._rate.get(request.replica)
            self._rate[request.replica] = sample if old is None else \
                (1 - self._alpha) * old + self._alpha * sample

    def finished(self, request_id: str) -> None:
        """The request ended. Without a first_token before (a non-streamed reply), its time says
        nothing about prefill speed and is not a sample."""
        self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if not request.prefilled:
            self._queued[request.replica] -= request.prefill_tokens
        self._in_flight[request.replica] -= 1

    def queued_prefill_tokens(self, replica: ReplicaId) -> int:
        return self._queued.get(replica, 0)

    def in_flight(self, replica: ReplicaId) -> int:
        return self._in_flight.get(replica, 0)

    def prefill_tokens_per_s(self, replica: ReplicaId, unmeasured: float | None = None) -> float:
        """The replica's measured rate; before its first sample, the mean of its pool peers'
        (same hardware by construction), or the configured prior when none is measured yet.
        Pass `unmeasured_rate()` as `unmeasured` when asking for many replicas at once.

        Without this, a replica measured faster than the prior would take every request and its
        idle peer would never be measured.
        """
        rate = self._rate.get(replica)
        if rate is not None:
            return rate
        return self.unmeasured_rate() if unmeasured is None else unmeasured

    def unmeasured_rate(self) -> float:
        return sum(self._rate.values()) / len(self._rate) if self._rate else self._prior

    def forget(self, replica: ReplicaId) -> None:
        """The replica is gone: its requests will end with errors; stop counting them."""
        for request_id in [k for k, r in self._requests.items() if r.replica == replica]:
            del self._requests[request_id]
        for table in (self._queued, self._in_flight, self._rate):
            table.pop(replica, None)


class DispatchHistory:
    """Which block-hash prefixes this router sent to each replica within `ttl_s`, bounded to
    `capacity` entries (oldest out first). The engine's evictions are not seen; the TTL bounds
    how long a stale entry can mislead."""

    def __init__(self, ttl_s: float = 300.0, capacity: int = 1_000_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl, self._capacity, self._clock = ttl_s, capacity, clock
        self._seen: OrderedDict[tuple[ReplicaId, EngineBlockHash], float] = OrderedDict()

    def record(self, replica: ReplicaId, hashes: Sequence[EngineBlockHash]) -> None:
        now = self._clock()
        for block in hashes:
            self._seen[(replica, block)] = now
            self._seen.move_to_end((replica, block))
        while len(self._seen) > self._capacity:
            self._seen.popitem(last=False)

    def cached_blocks(self, replica: ReplicaId, hashes: Sequence[EngineBlockHash]) -> int:
        """Leading blocks of `hashes` sent to `replica` within the TTL."""
        now, count = self._clock(), 0
        for block in hashes:
            seen = self._seen.get((replica, block))
            if seen is None or now - seen > self._ttl:
                break
            count += 1
        return count

    def forget(self, replica: ReplicaId) -> None:
        for key in [k for k in self._seen if k[0] == replica]:
            del self._seen[key]
