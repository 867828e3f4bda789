"""Mooncake-format traces for the benchmarks: sampling by conversation root, prompts made of
single-token words, the infinite-cache bound, and arrival times rescaled to a target rate.

A trace row is `{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}`; one hash
id stands for a 512-token block, replayed as `BLOCK_TOKENS` single-token words (one engine block).
"""

from __future__ import annotations

import json
import random
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

from sim.calibrate import single_token_words  # noqa: F401 - the benchmarks' prompts

BLOCK_TOKENS, MAX_BLOCKS = 32, 60


def sample_by_root(path: Path, share: float, seed: int) -> list[dict[str, Any]]:
    """Every request whose first block is one of a seeded random `share` of the roots, in trace
    order, so all prefix sharing among the sampled requests is kept."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    roots = sorted({row["hash_ids"][0] for row in rows})
    chosen = set(random.Random(seed).sample(roots, max(1, int(share * len(roots)))))
    return [row for row in rows if row["hash_ids"][0] in chosen]


def without_reuse(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same requests (arrivals, lengths) with every block their own: no prefix is shared,
    so no placement can win a hit.

    Example: hash_ids [7, 8] and [7, 9] -> [0, 1] and [2, 3]."""
    out, serial = [], 0
    for row in requests:
        count = len(row["hash_ids"])
        out.append(row | {"hash_ids": list(range(serial, serial + count))})
        serial += count
    return out


def upper_bound_hit_rate(requests: list[dict[str, Any]], max_blocks: int = MAX_BLOCKS) -> float:
    """Share of prompt blocks an infinite cache shared by all replicas would serve."""
    return lru_hit_rate(requests, sys.maxsize, max_blocks)


def lru_hit_rate(requests: list[dict[str, Any]], capacity_blocks: int,
                 max_blocks: int = MAX_BLOCKS) -> float:
    """Share of prompt blocks one LRU prefix cache of `capacity_blocks` would serve: what a
    single engine of that size reaches with every request, and, at twice the size, what two
    caches could reach at most if placement made them act as one (no block held twice)."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for row in requests:
        blocks = row["hash_ids"][:max_blocks]
        total += len(blocks)
        for block in blocks:
            if block not in cache:
                break
            hits += 1
        for block in blocks:
            cache[block] = None
            cache.move_to_end(block)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hits / total if total else 0.0


class Prompts:
    """Block id -> 32 words, fixed per `namespace` (a new namespace shares nothing with others)."""

    def __init__(self, words: list[str], namespace: int, max_blocks: int = MAX_BLOCKS) -> None:
        self._words, self._namespace, self._max_blocks = words, namespace, max_blocks
        self._chunks: dict[int, str] = {}

    def chunk(self, block: int) -> str:
        if block not in self._chunks:
            rng = random.Random(self._namespace * 1_000_003 + block)
            self._chunks[block] = "".join(rng.choice(self._words) for _ in range(BLOCK_TOKENS))
        return self._chunks[block]

    def prompt(self, row: dict[str, Any]) -> str:
        return "".join(self.chunk(block) for block in row["hash_ids"][:self._max_blocks])


def arrival_offsets(requests: list[dict[str, Any]], rate: float) -> list[float]:
    """Seconds from the start of the replay at which each request is sent: the trace's own
    spacing, stretched or squeezed so the mean rate is `rate` requests/s."""
    start_ms = requests[0]["timestamp"]
    span_s = max(1.0, (requests[-1]["timestamp"] - start_ms) / 1000)
    scale = (len(requests) / rate) / span_s
    return [(row["timestamp"] - start_ms) / 1000 * scale for row in requests]
