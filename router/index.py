"""The global KV block map: which replica holds which engine-reported block, on which medium.

One owner applies events in order per replica (`apply`); lookups answer, for a request's block
hashes, how many leading blocks each replica holds. Memory is bounded: past `max_entries`
(block, replica) pairs, the least recently stored blocks are forgotten first, which can only make
the map under-report what is cached, never over-report it.

Every table holds only hashes and integers (a block's holders are a bit mask of replica slots),
which CPython's cyclic garbage collector does not track: a full collection in the ingress process
does not walk the map. Kept as dicts of dicts and sets, a map of a million pairs added 140-170 ms
to each full collection: a stall of every request on the event loop. The masks also make a lookup
one `&` per block while several replicas hold the prefix, and a C loop over the last holder's
own table once one does.

Each (block, replica) pair costs about `BYTES_PER_ENTRY` bytes of Python heap (measured with
tracemalloc by tests/unit/test_kv_index.py: 32-byte hashes, each held by one replica, the
hashes themselves included): the default bound of a million pairs is about 0.3 GB per pool in
each ingress process at most; only blocks the replicas hold count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import islice, repeat, takewhile
from operator import not_

from router.events import AllBlocksCleared, BlockRemoved, BlockStored, EngineBlockHash, KVEventBatch
from router.slots import ReplicaId, ReplicaSlots, bits

__all__ = ["BYTES_PER_ENTRY", "DEFAULT_MAX_ENTRIES", "KVBlockIndex", "ReplicaId"]

BYTES_PER_ENTRY = 300  # 180-335 measured from 20k to 1M pairs, replica slots 0 to 255
DEFAULT_MAX_ENTRIES = 1_000_000
GPU = "GPU"
GENERATIONS = 16  # the eviction order's granularity: 1/16 of the bound
MAX_GENERATIONS = 4 * GENERATIONS  # past this many, the two oldest merge


class KVBlockIndex:
    """Not thread-safe: one task applies events and answers lookups (others read snapshots).

    Eviction order: blocks are kept in generations of about `max_entries / 16` blocks (or new
    pairs, where blocks have many holders) by the time they were last stored (by any replica);
    past the bound, blocks of the oldest generation go first, each with all its holders, the
    last stored of them first (a prompt's tail before its head, as the engines evict).
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES,
                 on_removed: Callable[[ReplicaId, list[EngineBlockHash]], None] | None = None,
                 ) -> None:
        self._max_entries, self._on_removed = max_entries, on_removed
        self._holders: dict[EngineBlockHash, int] = {}  # block -> mask of replica slots
        self._media: dict[str, dict[EngineBlockHash, int]] = {}  # other than GPU: block -> mask
        self._slots = ReplicaSlots()
        self._blocks: dict[ReplicaId, dict[EngineBlockHash, None]] = {}
        self._stored: dict[ReplicaId, int] = {}  # blocks each replica ever stored (new entries)
        self._entries = 0
        self._generation_size = max(1, max_entries // GENERATIONS)
        self._age: dict[EngineBlockHash, int] = {}  # block -> generation it was last stored in
        self._generations: dict[int, dict[EngineBlockHash, None]] = {0: {}}  # oldest first
        self._current = 0
        self._generation_pairs = 0  # pairs new in the current generation

    def apply(self, replica: ReplicaId, batch: KVEventBatch) -> None:
        """Apply one replica's batch; batches of a replica must arrive in publication order."""
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.add(replica, event.block_hashes, event.medium or GPU)
            elif isinstance(event, BlockRemoved):
                self.remove(replica, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.clear(replica)

    def add(self, replica: ReplicaId, hashes: Iterable[EngineBlockHash], medium: str) -> None:
        bit = self._slots.bit(replica)
        owned = self._blocks.setdefault(replica, {})
        table, age = self._holders, self._age
        generation, generations = self._current, self._generations
        current, new = generations[generation], 0
        media = self._media if self._media or medium != GPU else None
        hashes = hashes if isinstance(hashes, list | tuple) else list(hashes)
        fresh = _fresh_tail(table, hashes) if media is None else {}
        get = table.get
        for block in islice(hashes, len(hashes) - len(fresh)):
            mask = get(block, 0)
            if not mask & bit:
                table[block] = mask | bit
                owned[block] = None
                new += 1
            if not mask:  # a block new to the map
                current[block] = None
                age[block] = generation
            elif (was := age[block]) != generation:
                self._leave(was, block)
                current[block] = None
                age[block] = generation
            if media is not None:
                self._set_medium(block, bit, medium)
        if fresh:  # what the loop would do with blocks new to the map, in C
            table.update(dict.fromkeys(fresh, bit))
            owned.update(fresh)
            current.update(fresh)
            age.update(dict.fromkeys(fresh, generation))
            new += len(fresh)
        self._entries += new
        self._stored[replica] = self._stored.get(replica, 0) + new
        self._generation_pairs += new
        if max(len(current), self._generation_pairs) >= self._generation_size:
            self._next_generation()
        self._shrink()

    def remove(self, replica: ReplicaId, hashes: Iterable[EngineBlockHash]) -> None:
        """The replica no longer holds these blocks; `on_removed` hears of those it held."""
        bit = self._slots.known(replica)
        if not bit:
            return
        owned, table, removed = self._blocks[replica], self._holders, []
        for block in hashes:
            mask = table.get(block, 0)
            if not mask & bit:
                continue
            if mask == bit:
                self._forget_block(block)
            else:
                table[block] = mask ^ bit
            del owned[block]
            removed.append(block)
        if self._media:
            for block in removed:
                self._set_medium(block, bit, GPU)
        self._entries -= len(removed)
        if removed and self._on_removed is not None:
            self._on_removed(replica, removed)

    def clear(self, replica: ReplicaId) -> None:
        """Forget everything a replica holds (cache reset, restart, or a lost event stream)."""
        self.remove(replica, list(self._blocks.get(replica, ())))

    def drop_replica(self, replica: ReplicaId) -> None:
        self.clear(replica)
        self._blocks.pop(replica, None)
        self._stored.pop(replica, None)
        self._slots.release(replica)  # it holds nothing now: the slot is free for the next

    def longest_prefix(self, hashes: Sequence[EngineBlockHash]) -> dict[ReplicaId, int]:
        """Leading blocks of `hashes` each replica holds; replicas holding none are left out.

        Example: replica a holds [h1, h2], b holds [h1, h3]; for [h1, h2, h3] -> {a: 2, b: 1}.
        """
        matched: dict[ReplicaId, int] = {}
        if not hashes:
            return matched
        get, count = self._holders.get, len(hashes)
        alive, depth = get(hashes[0], 0), 1
        while alive and depth < count:
            if not alive & (alive - 1):  # one holder left: its own table, walked in C
                owned = self._blocks[self._slots.name(alive)]
                depth += len(list(takewhile(owned.__contains__, islice(hashes, depth, None))))
                break
            kept = alive & get(hashes[depth], 0)
            if kept != alive:  # some holders stop here
                self._slots.assign(alive ^ kept, depth, matched)
                alive = kept
            depth += 1
        self._slots.assign(alive, depth, matched)
        return matched

    def medium(self, replica: ReplicaId, block: EngineBlockHash) -> str | None:
        bit = self._slots.known(replica)
        if not self._holders.get(block, 0) & bit:
            return None
        return next((m for m, masks in self._media.items() if masks.get(block, 0) & bit), GPU)

    def blocks_of(self, replica: ReplicaId) -> int:
        return len(self._blocks.get(replica, ()))

    def stored_by(self, replica: ReplicaId) -> int:
        """Blocks the replica has stored since it was first seen (a counter: its cache's churn)."""
        return self._stored.get(replica, 0)

    def __len__(self) -> int:
        """(block, replica) pairs held."""
        return self._entries

    def _set_medium(self, block: EngineBlockHash, bit: int, medium: str) -> None:
        """The (block, replica) pair is on `medium` now (GPU: in no table of other media)."""
        for name, masks in self._media.items():
            mask = masks.get(block, 0)
            if mask & bit and name != medium:
                if mask == bit:
                    del masks[block]
                else:
                    masks[block] = mask ^ bit
        if medium != GPU:
            masks = self._media.setdefault(medium, {})
            masks[block] = masks.get(block, 0) | bit

    def _forget_block(self, block: EngineBlockHash) -> None:
        """Drop a block from the holder, age and generation tables."""
        del self._holders[block]
        self._leave(self._age.pop(block), block)

    def _leave(self, generation: int, block: EngineBlockHash) -> None:
        members = self._generations[generation]
        del members[block]
        if not members and generation != self._current:
            del self._generations[generation]

    def _next_generation(self) -> None:
        generations = self._generations
        self._current += 1
        self._generation_pairs = 0
        generations[self._current] = {}
        if len(generations) > MAX_GENERATIONS:  # many nearly emptied: fold the oldest two
            (old, members), (into, _) = list(generations.items())[:2]
            del generations[old]
            generations[into].update(members)
            age = self._age
            for block in members:
                age[block] = into

    def _shrink(self) -> None:
        while self._entries > self._max_entries:
            generation = next(iter(self._generations))
            oldest = self._generations[generation]
            block, _ = oldest.popitem()  # not `del`: that leaves a hole for the next to skip
            if not oldest and generation != self._current:
                del self._generations[generation]
            del self._age[block]
            mask = self._holders.pop(block)
            self._entries -= mask.bit_count()
            for bit in bits(mask):
                del self._blocks[self._slots.name(bit)][block]
                if self._media:
                    self._set_medium(block, bit, GPU)


def _fresh_tail(holders: dict[EngineBlockHash, int],
                hashes: Sequence[EngineBlockHash]) -> dict[EngineBlockHash, None]:
    """The longest tail of `hashes` that no replica holds, as a dict in order, if its blocks are
    distinct and none is also in the head (else {}: the caller's loop takes every block).

    A prompt's new blocks are stored after the head it shares with others, if any: most of a
    batch is new to the map, and storing it in C costs a fraction of the per-block loop.
    Only the tail and the last held block before it are looked up (from the end).
    Example: holders {h1: 0b1}; [h1, h2, h3] -> {h2: None, h3: None}."""
    count = len(list(takewhile(not_, map(holders.get, reversed(hashes), repeat(0)))))
    if not count:
        return {}
    head = len(hashes) - count
    fresh = dict.fromkeys(islice(hashes, head, None))
    if len(fresh) != count or not fresh.keys().isdisjoint(islice(hashes, head)):
        return {}
    return fresh
