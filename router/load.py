"""This router's own view of the load it put on each replica, and what it recently sent where.

Requests are tracked from dispatch to first token (their prompt is queued prefill work) and to the
end (they are in flight). Each streamed first token is a sample of the pool's TTFT model
(router/ttft_model.py): the prefill work that was ahead of it, the requests beside it, the time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import or_

from router.events import EngineBlockHash
from router.index import ReplicaId
from router.slots import ReplicaSlots, prefix_depths
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

    def load(self, replica: ReplicaId) -> tuple[int, int]:
        """(queued prefill tokens, requests in flight) on the replica, in one call."""
        return self._queued.get(replica, 0), self._in_flight.get(replica, 0)

    def forget(self, replica: ReplicaId) -> None:
        """The replica is gone: its requests will end with errors; stop counting them."""
        for request_id in [k for k, r in self._requests.items() if r.replica == replica]:
            del self._requests[request_id]
        for table in (self._queued, self._in_flight):
            table.pop(replica, None)
        self.model.forget(replica)


class DispatchHistory:
    """Which block-hash prefixes this router sent to each replica lately, bounded to `capacity`
    records. Where the engines' events are followed, an eviction they report removes the
    entry (`forget_blocks`); otherwise the TTL bounds how long a stale entry can mislead.

    Kept by block, like the engine-fed map (router/index.py), with the replicas sent a block as
    one integer's bits: one walk answers for every replica at once, and a full collection of
    the garbage collector does not walk the tables. Only every `stride`-th block of a prompt and
    its last one are kept (hashes are chained, so a block stands for the prefix up to it):
    recording and a lookup cost O(blocks / stride), and a match is reported to the last such
    block it reaches, at most `stride - 1` blocks short. An engine's eviction of a block that
    is not kept goes unseen until one that is kept goes too (engines evict a prompt's tail
    first, so that is soon). The engine-fed map stays exact; this is the router's own guess.

    Records are kept in generations of `ttl_s / 2`: a record counts for at least `ttl_s` and at
    most 1.5 x `ttl_s`, and a lookup reads each of the (at most 3) generations that count.
    Past `capacity` records (a pair sent in two generations is two), the oldest generation's
    blocks leave first, each with all its replicas, the last recorded of them first.

    Example (stride 4): a 10-block prompt keeps blocks 4, 8 and 10; a later prompt sharing its
    first 9 blocks matches 8 of them.
    """

    def __init__(self, ttl_s: float = 300.0, capacity: int = 1_000_000, stride: int = 4,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl, self._capacity, self._stride, self._clock = ttl_s, capacity, stride, clock
        self._span = ttl_s / 2
        self._slots = ReplicaSlots()
        # newest last: (start, block -> mask of replicas sent it in the generation, records)
        self._generations: list[_Generation] = []
        self._entries = 0

    def _kept(self, hashes: Sequence[EngineBlockHash]) -> Sequence[EngineBlockHash]:
        """The blocks kept: every `stride`-th, and the last (the k-th kept is at depth
        min(k x stride, len(hashes)))."""
        stride = self._stride
        kept = hashes[stride - 1::stride]
        if len(hashes) % stride:
            kept = [*kept, hashes[-1]]
        return kept

    def _live(self, now: float) -> list[dict[EngineBlockHash, int]]:
        """The generations that count at `now`, newest first (older ones are dropped)."""
        generations = self._generations
        while generations and generations[0].start + self._span <= now - self._ttl:
            self._entries -= generations.pop(0).records
        return [g.sent for g in reversed(generations)]

    def record(self, replica: ReplicaId, hashes: Sequence[EngineBlockHash]) -> None:
        now, bit = self._clock(), self._slots.bit(replica)
        self._live(now)
        generations = self._generations
        if not generations or generations[-1].start + self._span <= now:
            generations.append(_Generation(now))
        current = generations[-1]
        kept = self._kept(hashes)
        masks = list(map(current.sent.get, kept, repeat(0)))
        new = len(kept) - sum(map(bool, map(bit.__and__, masks)))
        current.sent.update(zip(kept, map(bit.__or__, masks)))  # in C: a 32k-token prompt
        current.records += new                                  # keeps 500 blocks
        self._entries += new
        while self._entries > self._capacity:
            oldest = generations[0]
            if not oldest.sent:
                generations.pop(0)
                continue
            _, mask = oldest.sent.popitem()
            oldest.records -= mask.bit_count()
            self._entries -= mask.bit_count()

    def longest_prefix(self, hashes: Sequence[EngineBlockHash]) -> dict[ReplicaId, int]:
        """Leading blocks of `hashes` sent to each replica within the TTL, to the last kept
        block matched; replicas with none are left out.

        Example (stride 1): a was sent [h1, h2] 10 s ago, b [h1] 500 s ago (TTL 300 s); for
        [h1, h2, h3] -> {a: 2}.
        """
        live = self._live(self._clock())
        if not live or not hashes:
            return {}
        kept = self._kept(hashes)
        masks = map(live[0].get, kept, repeat(0))
        for sent in live[1:]:
            masks = map(or_, masks, map(sent.get, kept, repeat(0)))
        stride, count = self._stride, len(hashes)
        return {replica: min(depth * stride, count)
                for replica, depth in prefix_depths(masks, self._slots).items()}

    def forget_blocks(self, replica: ReplicaId, hashes: Sequence[EngineBlockHash]) -> None:
        """The replica evicted these blocks: a prefix through a kept one of them is gone."""
        bit = self._slots.known(replica)
        for generation in self._generations if bit else ():
            self._clear(generation, hashes, bit)

    def forget(self, replica: ReplicaId) -> None:
        """The replica left: forget every record of it (and free its slot)."""
        bit = self._slots.known(replica)
        for generation in self._generations if bit else ():
            self._clear(generation, [b for b, mask in generation.sent.items() if mask & bit], bit)
        self._slots.release(replica)

    def _clear(self, generation: _Generation, hashes: Sequence[EngineBlockHash], bit: int) -> None:
        sent, gone = generation.sent, 0
        for block in hashes:
            mask = sent.get(block, 0)
            if mask & bit:
                gone += 1
                if mask == bit:
                    del sent[block]
                else:
                    sent[block] = mask ^ bit
        generation.records -= gone
        self._entries -= gone

    def __len__(self) -> int:
        """Records held: (block, replica) pairs, once per generation they were sent in."""
        return self._entries


@dataclass(slots=True)
class _Generation:
    start: float
    sent: dict[EngineBlockHash, int] = field(default_factory=dict)
    records: int = 0


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
