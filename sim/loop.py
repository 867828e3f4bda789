"""Simulated time: a heap of (time, sequence, callback). One owner; nothing here sleeps."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventLoop:
    """Callbacks run in time order, ties in the order they were scheduled.

    Example: at(2.0, f); at(1.0, g); run() -> g at 1.0, then f at 2.0; `now` is 2.0 after."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def clock(self) -> float:
        """The current simulated time (what the router and autoscaler get as their clock)."""
        return self.now

    def at(self, when: float, callback: Callable[[], None]) -> None:
        if when < self.now:
            raise ValueError(f"cannot schedule at {when} before now ({self.now})")
        heapq.heappush(self._heap, (when, next(self._seq), callback))

    def after(self, delay: float, callback: Callable[[], None]) -> None:
        self.at(self.now + max(0.0, delay), callback)

    def run(self, until: float = float("inf")) -> None:
        heap = self._heap
        while heap and heap[0][0] <= until:
            when, _, callback = heapq.heappop(heap)
            self.now = when
            callback()
        if until != float("inf"):
            self.now = max(self.now, until)

    def pending(self) -> int:
        return len(self._heap)
