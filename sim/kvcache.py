"""A paged KV cache with prefix caching, as vLLM v1's block pool keeps it.

Blocks are numbered 0..N-1. Free blocks wait in one queue, least recently freed first; a block
that still carries a hash stays findable by it (a prefix-cache hit) until it is taken for new
data, which evicts it. A request frees its blocks last-first, so a prompt's tail is evicted
before its head. Hashes are opaque: the same chained block hashes the router computes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class BlockPool:
    """Not thread-safe; one engine owns it. Stored and removed hashes are collected, in order,
    until `take_events` (one engine step's KV events)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}  # hash -> block
        self._refs: dict[int, int] = {}
        self._events: list[tuple[bool, int]] = []  # (stored, hash), in the order they happened
        self.allocated = 0  # blocks taken for new data, ever (each one block's life in the cache)

    @property
    def free_blocks(self) -> int:
        """Blocks that can be taken now (empty, or cached and unreferenced)."""
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        """Blocks referenced by running requests (vLLM's KV cache usage counts these)."""
        return self.num_blocks - len(self._free)

    def cached_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached prefix of `hashes` (not yet referenced)."""
        blocks = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def is_free(self, block: int) -> bool:
        """Whether the block waits in the free queue (taking it would evict it)."""
        return block in self._free

    def touch(self, blocks: Sequence[int]) -> None:
        """A request reuses these cached blocks: they leave the free queue while referenced."""
        for block in blocks:
            refs = self._refs.get(block, 0)
            if refs == 0:
                self._free.pop(block, None)
            self._refs[block] = refs + 1

    def allocate(self, count: int) -> list[int] | None:
        """`count` blocks for new data, least recently freed first (evicting their hashes);
        None, taking nothing, when fewer are free."""
        if count > len(self._free):
            return None
        self.allocated += count
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            old = self._hash_of.pop(block, None)
            if old is not None:
                del self._block_of[old]
                self._events.append((False, old))
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def cache(self, block: int, block_hash: int) -> None:
        """The block is full of a prompt's computed tokens: findable by its hash from now on.
        A hash already cached in another block is kept there (this block stays unhashed)."""
        if block_hash in self._block_of or block in self._hash_of:
            return
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        self._events.append((True, block_hash))

    def free(self, blocks: Sequence[int]) -> None:
        """A request is done with its blocks (or was preempted): last block first to the queue."""
        for block in reversed(blocks):
            refs = self._refs[block] - 1
            if refs:
                self._refs[block] = refs
            else:
                del self._refs[block]
                self._free[block] = None

    def take_events(self) -> list[tuple[bool, int]]:
        """(stored, hash) for each hash stored (True) or evicted (False) since the last call."""
        events, self._events = self._events, []
        return events
