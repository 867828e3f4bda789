"""Circuit breakers, one per replica: a replica whose requests keep failing before they are
answered is not chosen for a while.

closed -> open: `failures` failures within `window_s`. The router then chooses other replicas.
open -> half_open: after `open_s`; the next request may go there again, as a probe.
half_open -> closed: a request there was answered. half_open -> open: it failed again, for
twice as long as the last time (up to 8x `open_s`).

A replica whose engine died also reports itself unhealthy in the registry and leaves the
candidates at the next refresh; the breaker covers the second in between, and failures that no
health check sees.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from router.index import ReplicaId

MAX_BACKOFF = 8


@dataclass
class _Breaker:
    failures: deque[float] = field(default_factory=deque)
    open_until: float = 0.0
    backoff: int = 1
    state: str = "closed"  # closed, open, half_open
    trips: int = 0


class CircuitBreakers:
    def __init__(self, failures: int = 3, window_s: float = 30.0, open_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._threshold, self._window_s, self._open_s = failures, window_s, open_s
        self._clock = clock
        self._breakers: dict[ReplicaId, _Breaker] = {}

    def failed(self, replica: ReplicaId) -> bool:
        """A request on `replica` failed before it was answered; True if that opened its
        breaker."""
        now = self._clock()
        breaker = self._breakers.setdefault(replica, _Breaker())
        if breaker.state == "half_open":
            breaker.backoff = min(MAX_BACKOFF, breaker.backoff * 2)
            return self._open(breaker, now)
        if breaker.state == "open":
            return False
        breaker.failures.append(now)
        while breaker.failures and breaker.failures[0] < now - self._window_s:
            breaker.failures.popleft()
        if len(breaker.failures) >= self._threshold:
            return self._open(breaker, now)
        return False

    def _open(self, breaker: _Breaker, now: float) -> bool:
        breaker.state, breaker.open_until = "open", now + self._open_s * breaker.backoff
        breaker.failures.clear()
        breaker.trips += 1
        return True

    def answered(self, replica: ReplicaId) -> None:
        """A request on `replica` was answered (its head came)."""
        breaker = self._breakers.get(replica)
        if breaker is not None and breaker.state == "half_open":
            self._breakers[replica] = _Breaker(trips=breaker.trips)

    def allows(self, replica: ReplicaId) -> bool:
        breaker = self._breakers.get(replica)
        if breaker is None or breaker.state == "closed":
            return True
        if breaker.state == "open" and self._clock() >= breaker.open_until:
            breaker.state = "half_open"
        return breaker.state == "half_open"

    def state(self, replica: ReplicaId) -> str:
        self.allows(replica)  # an open breaker past its time reads half_open
        breaker = self._breakers.get(replica)
        return breaker.state if breaker else "closed"

    def trips(self, replica: ReplicaId) -> int:
        breaker = self._breakers.get(replica)
        return breaker.trips if breaker else 0

    def forget(self, replica: ReplicaId) -> None:
        self._breakers.pop(replica, None)
