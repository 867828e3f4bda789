"""Which prompt prefixes a pool has recently been sent, from the router's own decisions.

An approximation for engines whose cache we do not observe: a block-aligned prefix counts as
cached for `ttl_s` after a request carrying it was dispatched, within a bounded number of blocks
(least recently used first out). Engine-side evictions are not seen; the TTL bounds that error.

A prefix is remembered with the request's cache salt, as an engine caches it: one tenant's
prompts never count as cached for another's (whose salted blocks the engine does not share), so
where a request goes never depends on what another tenant sent.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Literal


DecodeOnly = Literal["short_prompt", "cached_on_decode"]  # why a prompt skips the prefill leg
BLOCK_TOKENS = 64  # the gateway's blocks, and how many it remembers
CAPACITY_BLOCKS = 100_000


class RecentPrefixes:
    """Owned by one task (the ingress event loop); not thread-safe."""

    def __init__(self, block_tokens: int = BLOCK_TOKENS, capacity_blocks: int = CAPACITY_BLOCKS,
                 ttl_s: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._block, self._capacity = block_tokens, capacity_blocks
        self._ttl, self._clock = ttl_s, clock
        self._seen: OrderedDict[int, float] = OrderedDict()  # chained block hash -> last dispatch

    def _hashes(self, token_ids: Sequence[int], salt: str | None) -> list[int]:
        hashes, parent = [], 0 if salt is None else hash(("cache_salt", salt))
        for start in range(0, len(token_ids) - self._block + 1, self._block):
            parent = hash((parent, tuple(token_ids[start:start + self._block])))
            hashes.append(parent)
        return hashes

    def cached_tokens(self, token_ids: Sequence[int], salt: str | None = None) -> int:
        """Tokens of the longest block-aligned prefix dispatched within the TTL with the same
        cache salt.

        Example (block 4): after recording [1..10], a prompt [1..8, 99] has 8 cached tokens, and
        [1, 2, 3, 99, ...] has 0 (its first block differs); [1..8] with another salt has 0.
        """
        return self.cached_blocks(self._hashes(token_ids, salt)) * self._block

    def record(self, token_ids: Sequence[int], salt: str | None = None) -> None:
        self.record_blocks(self._hashes(token_ids, salt))

    def cached_blocks(self, block_hashes: Sequence[int]) -> int:
        """Blocks of the longest prefix of `block_hashes` (chained, as `_hashes` makes them or as
        an engine does) dispatched within the TTL."""
        now, cached = self._clock(), 0
        for block_hash in block_hashes:
            seen = self._seen.get(block_hash)
            if seen is None or now - seen > self._ttl:
                break
            cached += 1
        return cached

    def record_blocks(self, block_hashes: Sequence[int]) -> None:
        now = self._clock()
        for block_hash in block_hashes:
            self._seen[block_hash] = now
            self._seen.move_to_end(block_hash)
        while len(self._seen) > self._capacity:
            self._seen.popitem(last=False)


def skip_prefill(prompt_tokens: int, cached_on_decode: Callable[[], int],
                 min_prompt_tokens: int) -> DecodeOnly | None:
    """Why a prompt goes straight to decode (None: it is worth a prefill leg): decode would
    compute fewer than `min_prompt_tokens` of it itself, being short or mostly held by decode
    (`cached_on_decode` counts those tokens: from decode's block map, or the prompts recently
    sent there; a short prompt is not looked up). The gateway's `DisaggregatedFlow` and the
    simulator's P/D pools both decide so.

    Example (min 256): a 2,000-token prompt whose first 1,920 tokens decode holds leaves 80 to
    compute: decode does that faster than a prefill leg plus a transfer.
    """
    if prompt_tokens < min_prompt_tokens:
        return "short_prompt"
    if prompt_tokens - cached_on_decode() < min_prompt_tokens:
        return "cached_on_decode"
    return None
