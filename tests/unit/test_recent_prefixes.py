"""RecentPrefixes: block-aligned prefix matching, TTL expiry and the LRU bound, with a fake clock."""

from __future__ import annotations

import pytest

from router.recent_prefixes import RecentPrefixes


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(("recorded", "query", "cached"), [
    (list(range(10)), list(range(8)) + [99], 8),   # two full blocks of 4 match
    (list(range(10)), list(range(10)), 8),         # the partial third block never counts
    (list(range(10)), [0, 1, 2, 99] + list(range(4, 10)), 0),  # first block differs
    (list(range(10)), [0, 1, 2, 3, 4, 5, 6, 99], 4),  # second block differs
    (list(range(3)), list(range(3)), 0),            # shorter than a block
    ([], list(range(8)), 0),
])
def test_longest_cached_prefix(recorded: list[int], query: list[int], cached: int) -> None:
    prefixes = RecentPrefixes(block_tokens=4, clock=Clock())
    prefixes.record(recorded)
    assert prefixes.cached_tokens(query) == cached


def test_entries_expire_after_ttl() -> None:
    clock = Clock()
    prefixes = RecentPrefixes(block_tokens=4, ttl_s=10, clock=clock)
    prefixes.record(list(range(8)))
    clock.now = 10.0
    assert prefixes.cached_tokens(list(range(8))) == 8
    clock.now = 10.5
    assert prefixes.cached_tokens(list(range(8))) == 0


def test_least_recently_used_blocks_leave_first() -> None:
    prefixes = RecentPrefixes(block_tokens=2, capacity_blocks=3, clock=Clock())
    prefixes.record([1, 2, 3, 4])      # blocks a, ab
    prefixes.record([7, 8])            # block c
    prefixes.record([1, 2])            # a is used again: ab is now the oldest
    prefixes.record([9, 9])            # over capacity: ab leaves
    assert prefixes.cached_tokens([1, 2, 3, 4]) == 2
    assert prefixes.cached_tokens([7, 8]) == 2 and prefixes.cached_tokens([9, 9]) == 2
