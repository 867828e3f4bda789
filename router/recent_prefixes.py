"""Which prompt prefixes a pool has recently been sent, from the router's own decisions.

An approximation for engines whose cache we do not observe: a block-aligned prefix counts as
cached for `ttl_s` after a request carrying it was dispatched, within a bounded number of blocks
(least recently used first out). Engine-side evictions are not seen; the TTL bounds that error.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence


class RecentPrefixes:
    """Owned by one task (the ingress event loop); not thread-safe."""

    def __init__(self, block_tokens: int = 64, capacity_blocks: int = 100_000,
                 ttl_s: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._block, self._capacity, self._ttl, self._clock = block_tokens, capacity_blocks, ttl_s, clock
        self._seen: OrderedDict[int, float] = OrderedDict()  # chained block hash -> last dispatch

    def _hashes(self, token_ids: Sequence[int]) -> list[int]:
        hashes, parent = [], 0
        for start in range(0, len(token_ids) - self._block + 1, self._block):
            parent = hash((parent, tuple(token_ids[start:start + self._block])))
            hashes.append(parent)
        return hashes

    def cached_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of the longest block-aligned prefix dispatched within the TTL.

        Example (block 4): after recording [1..10], a prompt [1..8, 99] has 8 cached tokens, and
        [1, 2, 3, 99, ...] has 0 (its first block differs).
        """
        now, cached = self._clock(), 0
        for block_hash in self._hashes(token_ids):
            seen = self._seen.get(block_hash)
            if seen is None or now - seen > self._ttl:
                break
            cached += self._block
        return cached

    def record(self, token_ids: Sequence[int]) -> None:
        now = self._clock()
        for block_hash in self._hashes(token_ids):
            self._seen[block_hash] = now
            self._seen.move_to_end(block_hash)
        while len(self._seen) > self._capacity:
            self._seen.popitem(last=False)
