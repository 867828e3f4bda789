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

from router.events import EngineBlockHash
from router.index import ReplicaId
from router.slots import ReplicaSlots, prefix_depths
from router.ttft_model import TTFTModel, TTFTParams

GENERATIONS = 8  # a full history's generations: the eviction order's granularity


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
        self._streaming: dict[ReplicaId, int] = {}  # in flight, past their first token

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
        self._streaming[request.replica] = self._streaming.get(request.replica, 0) + 1
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
        if request.prefilled:
            self._streaming[request.replica] -= 1
        else:
            self._queued[request.replica] -= request.prefill_tokens
        self._in_flight[request.replica] -= 1

    def queued_prefill_tokens(self, replica: ReplicaId) -> int:
        return self._queued.get(replica, 0)

    def in_flight(self, replica: ReplicaId) -> int:
        return self._in_flight.get(replica, 0)

    def streaming(self, replica: ReplicaId) -> int:
        """Requests in flight on the replica whose first token has come back."""
        return self._streaming.get(replica, 0)

    def ttft_params(self, replica: ReplicaId, now: float | None = None) -> TTFTParams:
        return self.model.params(replica, now)

    def load(self, replica: ReplicaId) -> tuple[int, int]:
        """(queued prefill tokens, requests in flight) on the replica, in one call."""
        return self._queued.get(replica, 0), self._in_flight.get(replica, 0)

    def forget(self, replica: ReplicaId) -> None:
        """The replica is gone: its requests will end with errors; stop counting them."""
        for request_id in [k for k, r in self._requests.items() if r.replica == replica]:
            del self._requests[request_id]
        for table in (self._queued, self._in_flight, self._streaming):
            table.pop(replica, None)
        self.model.forget(replica)


class DispatchHistory:
    """Which block-hash prefixes this router sent to each replica lately, bounded to `capacity`
    (block, replica) pairs. Where the engines' events are followed, an eviction they report
    removes the entry (`forget_blocks`); otherwise the TTL bounds how long a stale entry can
    mislead.

    Kept by block, like the engine-fed map (router/index.py), with the replicas sent a block as
    one integer's bits: one walk answers for every replica at once, and a full collection of
    the garbage collector does not walk the tables. Only every `stride`-th block of a prompt and
    its last one are kept (hashes are chained, so a block stands for the prefix up to it):
    recording and a lookup cost O(blocks / stride), and a match is reported to the last such
    block it reaches, at most `stride - 1` blocks short. An engine's eviction of a block that
    is not kept goes unseen until one that is kept goes too (engines evict a prompt's tail
    first, so that is soon). The engine-fed map stays exact; this is the router's own guess.

    Each pair is in the generation it was last sent in; a generation spans `ttl_s / 2`, or
    `capacity / 8` pairs where that comes first. A pair counts for at least `ttl_s` and at most
    1.5 x `ttl_s` (expired generations are emptied a few blocks per call, as fast as pairs
    come in). Past `capacity`, the oldest generation's pairs leave first, the last sent of them
    first. A lookup reads one table: the union of the generations.

    Example (stride 4): a 10-block prompt keeps blocks 4, 8 and 10; a later prompt sharing its
    first 9 blocks matches 8 of them.
    """

    def __init__(self, ttl_s: float = 300.0, capacity: int = 1_000_000, stride: int = 4,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl, self._capacity, self._stride, self._clock = ttl_s, capacity, stride, clock
        self._span, self._generation_size = ttl_s / 2, max(1, capacity // GENERATIONS)
        self._slots = ReplicaSlots()
        self._sent: dict[EngineBlockHash, int] = {}  # block -> replicas: all generations
        self._generations: list[_Generation] = []  # oldest first
        self._entries = 0

    def _kept(self, hashes: Sequence[EngineBlockHash]) -> Sequence[EngineBlockHash]:
        """The blocks kept: every `stride`-th, and the last (the k-th kept is at depth
        min(k x stride, len(hashes)))."""
        stride = self._stride
        kept = hashes[stride - 1::stride]
        if len(hashes) % stride:
            kept = [*kept, hashes[-1]]
        return kept

    def _expire(self, now: float, budget: int) -> None:
        """Up to `budget` pairs of generations past the TTL leave, then any past capacity."""
        generations, sent = self._generations, self._sent
        ended, entries, capacity = now - self._ttl - self._span, self._entries, self._capacity
        while generations:
            oldest = generations[0]
            if entries <= capacity and (budget <= 0 or oldest.start > ended):
                break
            if not oldest.sent:
                generations.pop(0)
                continue
            block, mask = oldest.sent.popitem()
            held = sent[block]
            if held == mask:
                del sent[block]
            else:
                sent[block] = held ^ mask
            count = mask.bit_count()
            oldest.records -= count
            entries -= count
            budget -= 1
        self._entries = entries

    def _drop(self, block: EngineBlockHash, bit: int) -> None:
        held = self._sent[block] ^ bit
        if held:
            self._sent[block] = held
        else:
            del self._sent[block]
        self._entries -= 1

    def record(self, replica: ReplicaId, hashes: Sequence[EngineBlockHash]) -> None:
        now, bit, kept = self._clock(), self._slots.bit(replica), self._kept(hashes)
        generations = self._generations
        if not generations or generations[-1].start + self._span <= now \
                or generations[-1].records >= self._generation_size:
            generations.append(_Generation(now))
        current, older = generations[-1], generations[-2::-1]  # newest first: likelier
        sent, here = self._sent, current.sent
        sent_get, here_get, new, moved = sent.get, here.get, 0, 0
        for block in kept:
            mask = sent_get(block, 0)
            if not mask & bit:
                sent[block] = mask | bit
                new += 1
            elif here_get(block, 0) & bit:
                continue  # sent in this generation already: it keeps its place
            else:  # sent in an older one: it moves here
                self._take(block, bit, older)
                moved += 1
            here[block] = here_get(block, 0) | bit
        current.records += new + moved
        self._entries += new
        self._expire(now, 2 * len(kept) + 64)

    def longest_prefix(self, hashes: Sequence[EngineBlockHash]) -> dict[ReplicaId, int]:
        """Leading blocks of `hashes` sent to each replica within the TTL, to the last kept
        block matched; replicas with none are left out.

        Example (stride 1): a was sent [h1, h2] 10 s ago, b [h1] 500 s ago (TTL 300 s); for
        [h1, h2, h3] -> {a: 2}.
        """
        if not hashes:
            return {}
        kept = self._kept(hashes)
        self._expire(self._clock(), 2 * len(kept) + 64)
        stride, count = self._stride, len(hashes)
        masks = map(self._sent.get, kept, repeat(0))
        return {replica: min(depth * stride, count)
                for replica, depth in prefix_depths(masks, self._slots).items()}

    def forget_blocks(self, replica: ReplicaId, hashes: Sequence[EngineBlockHash]) -> None:
        """The replica evicted these blocks: a prefix through a kept one of them is gone."""
        bit = self._slots.known(replica)
        if not bit:
            return
        sent = self._sent
        for block in hashes:
            if sent.get(block, 0) & bit:
                self._take(block, bit, self._generations)
                self._drop(block, bit)

    def forget(self, replica: ReplicaId) -> None:
        """The replica left: forget every pair of it (and free its slot)."""
        bit = self._slots.known(replica)
        if bit:
            self.forget_blocks(replica, [b for b, mask in self._sent.items() if mask & bit])
        self._slots.release(replica)

    def _take(self, block: EngineBlockHash, bit: int, generations: list[_Generation]) -> None:
        """Take the pair (block, bit) out of the generation holding it."""
        for generation in generations:
            mask = generation.sent.get(block, 0)
            if mask & bit:
                if mask == bit:
                    del generation.sent[block]
                else:
                    generation.sent[block] = mask ^ bit
                generation.records -= 1
                return

    def __len__(self) -> int:
        """(block, replica) pairs held."""
        return self._entries


@dataclass(slots=True)
class _Generation:
    start: float
    sent: dict[EngineBlockHash, int] = field(default_factory=dict)  # block -> replicas
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
