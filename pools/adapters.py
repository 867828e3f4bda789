"""Which LoRA adapters an engine holds loaded, and what loading one costs.

vLLM keeps at most `max_cpu_loras` adapters loaded per engine and evicts the least recently used
when it loads another. A replica loads an adapter itself, timed, before the first request that
needs it where it is not loaded (rather than inside an engine step, where the load would stall
every running request unseen), and mirrors vLLM's order here: the router reads this (the
replica's report) to prefer replicas that hold a request's adapter, weighed by the measured cost.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable

LOAD_SAMPLES = 32  # the latest loads' times, for the reported median


class AdapterSlots:
    """The adapters one engine holds, least recently used first. `load(name)` loads one into
    the engine (vLLM's `add_lora`: read, validate, evict the least recently used); concurrent
    requests for one adapter share its load. Runs on the replica's event loop."""

    def __init__(self, capacity: int, load: Callable[[str], Awaitable[None]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.loads = 0  # loads since start
        self._load, self._clock = load, clock
        self._held: OrderedDict[str, None] = OrderedDict()
        self._pending: dict[str, asyncio.Task] = {}
        self._times: deque[float] = deque(maxlen=LOAD_SAMPLES)

    @property
    def held(self) -> list[str]:
        """Loaded adapters, least recently used first."""
        return list(self._held)

    @property
    def load_s(self) -> float:
        """Median seconds of the latest LOAD_SAMPLES loads (0 before any)."""
        return statistics.median(self._times) if self._times else 0.0

    async def use(self, name: str) -> None:
        """Make sure `name` is loaded, loading it if not; it becomes the most recently used."""
        if name in self._held:
            self._held.move_to_end(name)
            return
        task = self._pending.get(name)
        if task is None:
            task = self._pending[name] = asyncio.ensure_future(self._timed_load(name))
            task.add_done_callback(lambda _: self._pending.pop(name, None))
        await asyncio.shield(task)

    async def _timed_load(self, name: str) -> None:
        started = self._clock()
        await self._load(name)
        self.loaded(name, self._clock() - started)

    def loaded(self, name: str, seconds: float) -> None:
        """`name` was loaded into the engine in `seconds`: it is the most recently used, and
        the least recently used beyond the capacity are gone, as vLLM's cache evicts them."""
        self._times.append(seconds)
        self.loads += 1
        self._held.pop(name, None)
        self._held[name] = None
        while len(self._held) > self.capacity:
            self._held.popitem(last=False)

    def forget(self, name: str) -> None:
        """`name` was unloaded (or replaced at a new path: its next use loads it again)."""
        self._held.pop(name, None)

    def sync(self, loaded: Iterable[str]) -> None:
        """Correct the mirror with what the engine says it holds (its order is kept)."""
        loaded = set(loaded)
        for name in [n for n in self._held if n not in loaded]:
            del self._held[name]
        for name in loaded - self._held.keys():
            self._held[name] = None
            self._held.move_to_end(name, last=False)
