"""The global KV block map: which replica holds which engine-reported block, on which medium.

One owner applies events in order per replica (`apply`); lookups answer, for a request's block
hashes, how many leading blocks each replica holds. Memory is bounded: past `max_entries`
(block, replica) pairs, the least recently stored blocks are forgotten first, which can only make
the map under-report what is cached, never over-report it.

Each (block, replica) pair costs about `BYTES_PER_ENTRY` bytes of Python heap (measured with
tracemalloc by tests/unit/test_kv_index.py: 32-byte hashes, each held by one replica, the
hashes themselves included): the default bound of a million pairs
is about 0.45 GB per pool in each ingress process at most; only blocks the replicas hold count.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import NewType

from router.events import AllBlocksCleared, BlockRemoved, BlockStored, EngineBlockHash, KVEventBatch

ReplicaId = NewType("ReplicaId", str)

BYTES_PER_ENTRY = 450  # hash tables grow in steps: 400-450 measured from 20k to 1M pairs
DEFAULT_MAX_ENTRIES = 1_000_000


class KVBlockIndex:
    """Not thread-safe: one task applies events and answers lookups (others read snapshots)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES,
                 on_removed: Callable[[ReplicaId, list[EngineBlockHash]], None] | None = None,
                 ) -> None:
        self._max_entries, self._on_removed = max_entries, on_removed
        self._holders: OrderedDict[EngineBlockHash, dict[ReplicaId, str]] = OrderedDict()
        self._blocks: dict[ReplicaId, set[EngineBlockHash]] = {}
        self._stored: dict[ReplicaId, int] = {}  # blocks each replica ever stored (new entries)
        self._entries = 0

    def apply(self, replica: ReplicaId, batch: KVEventBatch) -> None:
        """Apply one replica's batch; batches of a replica must arrive in publication order."""
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.add(replica, event.block_hashes, event.medium or "GPU")
            elif isinstance(event, BlockRemoved):
                self.remove(replica, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.clear(replica)

    def add(self, replica: ReplicaId, hashes: Iterable[EngineBlockHash], medium: str) -> None:
        owned, table, new = self._blocks.setdefault(replica, set()), self._holders, 0
        for block in hashes:
            holders = table.get(block)
            if holders is None:
                table[block] = {replica: medium}
            else:
                table.move_to_end(block)
                held = replica in holders
                holders[replica] = medium
                if held:
                    continue
            new += 1
            owned.add(block)
        self._entries += new
        self._stored[replica] = self._stored.get(replica, 0) + new
        self._shrink()

    def remove(self, replica: ReplicaId, hashes: Iterable[EngineBlockHash]) -> None:
        """The replica no longer holds these blocks; `on_removed` hears of those it held."""
        owned, removed = self._blocks.get(replica, set()), []
        for block in hashes:
            holders = self._holders.get(block)
            if holders is None or holders.pop(replica, None) is None:
                continue
            self._entries -= 1
            owned.discard(block)
            removed.append(block)
            if not holders:
                del self._holders[block]
        if removed and self._on_removed is not None:
            self._on_removed(replica, removed)

    def clear(self, replica: ReplicaId) -> None:
        """Forget everything a replica holds (cache reset, restart, or a lost event stream)."""
        self.remove(replica, list(self._blocks.get(replica, ())))

    def drop_replica(self, replica: ReplicaId) -> None:
        self.clear(replica)
        self._blocks.pop(replica, None)
        self._stored.pop(replica, None)

    def longest_prefix(self, hashes: Sequence[EngineBlockHash]) -> dict[ReplicaId, int]:
        """Leading blocks of `hashes` each replica holds; replicas holding none are left out.

        Example: replica a holds [h1, h2], b holds [h1, h3]; for [h1, h2, h3] -> {a: 2, b: 1}.
        """
        table, matched = self._holders, dict[ReplicaId, int]()
        alive: set[ReplicaId] = set()
        only: ReplicaId | None = None  # the one replica left: the common tail
        depth = 0
        for block in hashes:
            holders = table.get(block)
            if not holders:
                break
            if only is not None:
                if only not in holders:
                    break
            elif not depth:
                alive = set(holders)
            elif not alive <= holders.keys():  # set operations: no Python loop per replica
                kept = alive & holders.keys()
                if not kept:
                    break
                matched.update(dict.fromkeys(alive - kept, depth))
                alive = kept
            if only is None and len(alive) == 1:
                (only,) = alive
            depth += 1
        matched.update(dict.fromkeys(alive, depth))
        return matched

    def medium(self, replica: ReplicaId, block: EngineBlockHash) -> str | None:
        return (self._holders.get(block) or {}).get(replica)

    def blocks_of(self, replica: ReplicaId) -> int:
        return len(self._blocks.get(replica, ()))

    def stored_by(self, replica: ReplicaId) -> int:
        """Blocks the replica has stored since it was first seen (a counter: its cache's churn)."""
        return self._stored.get(replica, 0)

    def __len__(self) -> int:
        """(block, replica) pairs held."""
        return self._entries

    def _shrink(self) -> None:
        while self._entries > self._max_entries:
            block, holders = self._holders.popitem(last=False)
            for replica in holders:
                self._blocks[replica].discard(block)
            self._entries -= len(holders)
