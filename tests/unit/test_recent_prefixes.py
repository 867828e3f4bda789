"""RecentPrefixes: block-aligned prefix matching, TTL expiry and the LRU bound, with a fake clock;
the rule that sends a prompt straight to decode."""

from __future__ import annotations

import pytest

from router.recent_prefixes import RecentPrefixes, skip_prefill


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


def test_a_prefix_counts_only_under_the_salt_it_was_sent_with() -> None:
    prefixes = RecentPrefixes(block_tokens=4, clock=Clock())
    prefixes.record(list(range(8)), "tenant-a")
    assert prefixes.cached_tokens(list(range(8)), "tenant-a") == 8
    assert prefixes.cached_tokens(list(range(8)), "tenant-b") == 0
    assert prefixes.cached_tokens(list(range(8))) == 0  # unsalted is a salt of its own
    prefixes.record(list(range(8)))
    assert prefixes.cached_tokens(list(range(8))) == 8
    assert prefixes.cached_tokens(list(range(8)), "tenant-b") == 0


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


def test_engine_block_hashes_count_like_token_blocks() -> None:
    prefixes = RecentPrefixes(block_tokens=16, ttl_s=10, clock=(clock := Clock()))
    prefixes.record_blocks([11, 12, 13])
    assert prefixes.cached_blocks([11, 12, 99]) == 2 and prefixes.cached_blocks([99, 12]) == 0
    clock.now = 11.0
    assert prefixes.cached_blocks([11, 12]) == 0  # past the TTL


def test_skip_prefill_names_why_decode_computes_the_prompt_itself() -> None:
    def never() -> int:
        raise AssertionError("a short prompt is not looked up")

    assert skip_prefill(100, never, 256) == "short_prompt"
    assert skip_prefill(2000, lambda: 1920, 256) == "cached_on_decode"  # 80 left for decode
    assert skip_prefill(2000, lambda: 1664, 256) is None  # 336 left: worth a prefill leg
    assert skip_prefill(256, lambda: 0, 256) is None
