"""This router's own view of the load it put on each replica, and what it recently sent where.

Requests are tracked from dispatch to first token (their prompt is queued prefill work) and to the
end (they are in flight). Each streamed first token is a sample of the pool's TTFT model
(router/ttft_model.py): the prefill work that was ahead of it, the requests beside it, the time.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.events import EngineBlockHash
from router.index import ReplicaId
from router.ttft_model import TTFTModel, TTFTParams


@dataclass
class _InFlight:
    replica: ReplicaId
    prefill_tokens: int  # uncached prompt tokens, predicted at dispatch
    work_ahead: int  # prefill tokens queued on the replica at dispatch, this one included
    busy: int  # requests already in flight on the replica at dispatch
    dispatched_at: float
    prefilled: bool = False


class LoadTracker:
    """Not thread-safe: the routing service calls it under its lock."""

    def __init__(self, model: TTFTModel | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model or TTFTModel()
        self._clock = clock
        self._requests: dict[str, _InFlight] = {}
        self._queued: dict[ReplicaId, int] = {}
        self._in_flight: dict[ReplicaId, int] = {}

    def dispatched(self, request_id: str, replica: ReplicaId, prefill_tokens: int) -> None:
        """Count the request on `replica` (moving it there if it was counted elsewhere)."""
        previous = self._requests.get(request_id)
        if previous is not None:
            if previous.replica == replica:
                return
            self._drop(request_id)
        queued = self._queued.get(replica, 0) + prefill_tokens
        busy = self._in_flight.get(replica, 0)
        self._requests[request_id] = _InFlight(replica, prefill_tokens, queued, busy, self._clock())
        self._queued[replica] = queued
        self._in_flight[replica] = busy + 1

    def first_token(self, request_id: str) -> None:
        """The replica streamed the request's first token: its prompt is no longer queued, and
        the time it took is a sample of the TTFT model.

        Example: 1,500 tokens were queued ahead, 500 are its own, 2 requests were running there,
        the first token came 0.5 s after dispatch -> sample (work 2,000, busy 2, 0.5 s).
        """
        request = self._requests.get(request_id)
        if request is None or request.prefilled:
            return
        request.prefilled = True
        self._queued[request.replica] -= request.prefill_tokens
        elapsed = self._clock() - request.dispatched_at
        self.model.observe(request.replica, request.work_ahead, request.busy, elapsed)

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

    def ttft_params(self, replica: ReplicaId, now: float | None = None) -> TTFTParams:
        return self.model.params(replica, now)

    def forget(self, replica: ReplicaId) -> None:
        """The replica is gone: its requests will end with errors; stop counting them."""
        for request_id in [k for k, r in self._requests.items() if r.replica == replica]:
            del self._requests[request_id]
        for table in (self._queued, self._in_flight):
            table.pop(replica, None)
        self.model.forget(replica)


class DispatchHistory:
    """Which block-hash prefixes this router sent to each replica within `ttl_s`, bounded to
    `capacity` (block, replica) pairs: past it, the blocks sent least recently leave first, with
    all their replicas. Where the engines' events are followed, an eviction they report removes
    the entry (`forget_blocks`); otherwise the TTL bounds how long a stale entry can mislead.

    Kept by block, like the engine-fed map (router/index.py): one walk answers for every replica
    at once. Only every `stride`-th block of a prompt and its last one are kept (hashes are
    chained, so a block stands for the prefix up to it): recording and a lookup cost
    O(blocks / stride), and a match is reported to the last such block it reaches, at most
    `stride - 1` blocks short. An engine's eviction of a block that is not kept goes unseen
    until one that is kept goes too (engines evict a prompt's tail first, so that is soon).
    The engine-fed map stays exact; this is the router's own guess.

    Example (stride 4): a 10-block prompt keeps blocks 4, 8 and 10; a later prompt sharing its
    first 9 blocks matches 8 of them.
    """

    def __init__(self, ttl_s: float = 300.0, capacity: int = 1_000_000, stride: int = 4,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl, self._capacity, self._stride, self._clock = ttl_s, capacity, stride, clock
        self._sent: OrderedDict[EngineBlockHash, dict[ReplicaId, float]] = OrderedDict()
        self._entries = 0

    def _kept(self, hashes: Sequence[EngineBlockHash]) -> list[tuple[int, EngineBlockHash]]:
        """(depth, block) of the blocks kept: every `stride`-th, and the last."""
        n, stride = len(hashes), self._stride
        kept = [(i + 1, hashes[i]) for i in range(stride - 1, n, stride)]
        if n % stride:
            kept.append((n, hashes[-1]))
        return kept

    def record(self, replica: ReplicaId, hashes: Sequence[EngineBlockHash]) -> None:
        now, sent, new = self._clock(), self._sent, 0
        for _, block in self._kept(hashes):
            replicas = sent.get(block)
            if replicas is None:
                sent[block] = {replica: now}
                new += 1
                continue
            sent.move_to_end(block)
            new += replica not in replicas
            replicas[replica] = now
        self._entries += new
        while self._entries > self._capacity:
            _, replicas = sent.popitem(last=False)
            self._entries -= len(replicas)

    def longest_prefix(self, hashes: Sequence[EngineBlockHash]) -> dict[ReplicaId, int]:
        """Leading blocks of `hashes` sent to each replica within the TTL, to the last kept
        block matched; replicas with none are left out.

        Example (stride 1): a was sent [h1, h2] 10 s ago, b [h1] 400 s ago (TTL 300 s); for
        [h1, h2, h3] -> {a: 2}.
        """
        fresh, sent = self._clock() - self._ttl, self._sent
        matched: dict[ReplicaId, int] = {}
        alive: list[ReplicaId] = []
        reached = 0
        for depth, block in self._kept(hashes):
            replicas = sent.get(block)
            if replicas is None:
                break
            if len(alive) == 1:  # the common tail: one replica left, no list building
                at = replicas.get(alive[0])
                if at is None or at < fresh:
                    break
            else:
                kept = [r for r, at in replicas.items() if at >= fresh] if not reached else \
                    [r for r in alive if replicas.get(r, -math.inf) >= fresh]
                if not kept:
                    break
                if len(kept) < len(alive):
                    matched.update((r, reached) for r in set(alive).difference(kept))
                alive = kept
            reached = depth
        matched.update((r, reached) for r in alive)
        return matched

    def forget_blocks(self, replica: ReplicaId, hashes: Sequence[EngineBlockHash]) -> None:
        """The replica evicted these blocks: a prefix through a kept one of them is gone."""
        sent = self._sent
        for block in hashes:
            replicas = sent.get(block)
            if replicas is not None and replicas.pop(replica, None) is not None:
                self._entries -= 1
                if not replicas:
                    del sent[block]

    def forget(self, replica: ReplicaId) -> None:
        for block in [b for b, replicas in self._sent.items() if replica in replicas]:
            self.forget_blocks(replica, [block])

    def __len__(self) -> int:
        """(block, replica) pairs held."""
        return self._entries


class CacheChurn:
    """Blocks each replica stored recently, from the block map's store counters: a decayed sum
    with time constant `window_s`, about the blocks stored in the last `window_s` seconds.

    A replica whose cache turns over fast evicts its blocks young; one that stores little keeps
    them long. Where to put a new prefix costs the least future reuse is where churn is lowest.
    Example (window 60 s): 300 blocks stored at once, read 60 s later -> 300 / e = 110.4.
    """

    def __init__(self, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._window, self._clock = window_s, clock
        self._seen: dict[ReplicaId, tuple[int, float, float]] = {}  # counter, recent, at

    def recent(self, replica: ReplicaId, stored_total: int, now: float | None = None) -> float:
        now = self._clock() if now is None else now
        counter, recent, at = self._seen.get(replica, (stored_total, 0.0, now))
        recent = recent * math.exp(-(now - at) / self._window) + max(0, stored_total - counter)
        self._seen[replica] = (stored_total, recent, now)
        return recent

    def forget(self, replica: ReplicaId) -> None:
        self._seen.pop(replica, None)
