"""Which LoRA adapters an engine holds loaded, and what loading one costs.

vLLM keeps at most `max_cpu_loras` adapters loaded per engine and evicts the least recently used
when it loads another. A replica loads an adapter itself, timed, before the first request that
needs it where it is not loaded (rather than inside an engine step, where the load would stall
every running request unseen), and mirrors vLLM's order here: the router reads this (the
replica's report) to prefer replicas that hold a request's adapter, weighed by the measured cost.

The replica also tells every gateway, over the data channel and as soon as they change, the
adapters its engine holds and the requests in flight per adapter (`AdapterBoard`): a gateway
that counted only its own requests, or read reports a second old, sent requests to replicas
whose batch slots other gateways' requests had taken, or that had long freed them
(docs/analysis/lora-notes.md).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager

from channel.frames import Adapters

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
        self._pending: dict[str, asyncio.Task[None]] = {}
        self._times: deque[float] = deque(maxlen=LOAD_SAMPLES)
        self.on_change: Callable[[], None] = lambda: None  # the held adapters or their order

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
            self.on_change()
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
        self.on_change()

    def forget(self, name: str) -> None:
        """`name` was unloaded (or replaced at a new path: its next use loads it again)."""
        self._held.pop(name, None)
        self.on_change()

    def sync(self, loaded: Iterable[str]) -> None:
        """Correct the mirror with what the engine says it holds (its order is kept)."""
        loaded = set(loaded)
        for name in [n for n in self._held if n not in loaded]:
            del self._held[name]
        for name in loaded - self._held.keys():
            self._held[name] = None
            self._held.move_to_end(name, last=False)
        self.on_change()


class AdapterBoard:
    """What one replica tells the gateways of its adapters: those its engine holds (`slots`)
    and its requests in flight per adapter on each data-parallel rank. `send` gets it once per
    turn of the event loop in which it changed (a request started or ended with an adapter, one
    was loaded or used), and only if it changed. Runs on the replica's event loop."""

    def __init__(self, slots: AdapterSlots, ranks: int,
                 send: Callable[[Adapters], None]) -> None:
        self._slots, self._send = slots, send
        self._running: list[dict[str, int]] = [{} for _ in range(max(1, ranks))]
        self._last: Adapters | None = None
        self._flushing = False
        slots.on_change = self.changed

    @contextmanager
    def running(self, adapter: str | None, rank: int | None) -> Iterator[None]:
        """A request for `adapter` (None: the base model, not counted) is in flight on `rank`
        (None: the engine picks one; counted on rank 0) while the block runs."""
        if adapter is None:
            yield
            return
        counts = self._running[rank if rank is not None and 0 <= rank < len(self._running)
                               else 0]
        counts[adapter] = counts.get(adapter, 0) + 1
        self.changed()
        try:
            yield
        finally:
            if counts[adapter] <= 1:
                del counts[adapter]
            else:
                counts[adapter] -= 1
            self.changed()

    def changed(self) -> None:
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        now = Adapters(self._slots.held, [dict(counts) for counts in self._running])
        if now != self._last:
            self._last = now
            self._send(now)
