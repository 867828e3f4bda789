"""The global KV block map: which replica holds which engine-reported block, on which medium.

One owner applies events in order per replica (`apply`); lookups answer, for a request's block
hashes, how many leading blocks each replica holds. Memory is bounded: past `max_entries`
(block, replica) pairs, the least recently stored blocks are forgotten first, which can only make
the map under-report what is cached, never over-report it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NewType

from router.events import AllBlocksCleared, BlockRemoved, BlockStored, EngineBlockHash, KVEventBatch

ReplicaId = NewType("ReplicaId", str)


class KVBlockIndex:
    """Not thread-safe: one task applies events and answers lookups (others read snapshots)."""

    def __init__(self, max_entries: int = 10_000_000) -> None:
        self._max_entries = max_entries
        self._holders: OrderedDict[EngineBlockHash, dict[ReplicaId, str]] = OrderedDict()
        self._blocks: dict[ReplicaId, set[EngineBlockHash]] = {}
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
        owned = self._blocks.setdefault(replica, set())
        for block in hashes:
            holders = self._holders.get(block)
            if holders is None:
                holders = self._holders[block] = {}
            else:
                self._holders.move_to_end(block)
            if replica not in holders:
                self._entries += 1
                owned.add(block)
            holders[replica] = medium
        self._shrink()

    def remove(self, replica: ReplicaId, hashes: Iterable[EngineBlockHash]) -> None:
        owned = self._blocks.get(replica, set())
        for block in hashes:
            holders = self._holders.get(block)
            if holders is None or holders.pop(replica, None) is None:
                continue
            self._entries -= 1
            owned.discard(block)
            if not holders:
                del self._holders[block]

    def clear(self, replica: ReplicaId) -> None:
        """Forget everything a replica holds (cache reset, restart, or a lost event stream)."""
        self.remove(replica, list(self._blocks.get(replica, ())))

    def drop_replica(self, replica: ReplicaId) -> None:
        self.clear(replica)
        self._blocks.pop(replica, None)

    def longest_prefix(self, hashes: Sequence[EngineBlockHash]) -> dict[ReplicaId, int]:
        """Leading blocks of `hashes` each replica holds; replicas holding none are left out.

        Example: replica a holds [h1, h2], b holds [h1, h3]; for [h1, h2, h3] -> {a: 2, b: 1}.
        """
        matched: dict[ReplicaId, int] = {}
        alive: set[ReplicaId] | None = None
        for depth, block in enumerate(hashes):
            holders = self._holders.get(block)
            if not holders:
                break
            if alive is None:
                alive = set(holders)
            elif len(alive) == 1:  # the common tail: one replica left, no set building
                (replica,) = alive
                if replica not in holders:
                    break
                matched[replica] = depth + 1
                continue
            else:
                alive.intersection_update(holders)
                if not alive:
                    break
            for replica in alive:
                matched[replica] = depth + 1
        return matched

    def medium(self, replica: ReplicaId, block: EngineBlockHash) -> str | None:
        return (self._holders.get(block) or {}).get(replica)

    def blocks_of(self, replica: ReplicaId) -> int:
        return len(self._blocks.get(replica, ()))

    def __len__(self) -> int:
        """(block, replica) pairs held."""
        return self._entries

    def _shrink(self) -> None:
        while self._entries > self._max_entries:
            block, holders = self._holders.popitem(last=False)
            for replica in holders:
                self._blocks[replica].discard(block)
            self._entries -= len(holders)
