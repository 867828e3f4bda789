"""Mooncake-format trace rows as simulated requests: prompts as chains of block hashes, outputs,
arrival times; and more load than one trace holds, by tiling it.

A trace row is `{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}`, one hash id
per `tokens_per_id` prompt tokens. Engine blocks of `block_size` tokens (a divisor of
`tokens_per_id`) get hashes chained from the prompt's first block, as an engine chains them, so two
prompts share exactly the blocks whose hash ids they share from the start. The router never reads
these tokens: it gets the hashes, as it would from its hasher (`router.hashing`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from sim.engine import SimRequest

MASK = 0xFFFF_FFFF_FFFF_FFFF
Row = dict[str, Any]


def read_trace(path: Path) -> list[Row]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def block_hashes(hash_ids: Iterable[int], blocks: int, tokens_per_id: int, block_size: int,
                 namespace: int = 0) -> list[int]:
    """Chained hashes of the first `blocks` engine blocks of a prompt made of `hash_ids`.

    Example (32 tokens per id, block 16): ids [7, 9] -> blocks (7, 0), (7, 1), (9, 0), (9, 1),
    each hash covering every block before it."""
    per_id = tokens_per_id // block_size
    out, parent = [], namespace
    for hash_id in hash_ids:
        if len(out) >= blocks:
            break
        key = (parent, hash_id, per_id)
        chunk = _CHUNKS.get(key)
        if chunk is None:
            chunk = _CHUNKS[key] = _chunk(parent, hash_id, per_id)
        out += chunk
        parent = chunk[-1]
    return out[:blocks]


_CHUNKS: dict[tuple[int, int, int], list[int]] = {}  # prompts share prefixes: hash each once


def _chunk(parent: int, hash_id: int, per_id: int) -> list[int]:
    out = []
    for i in range(per_id):
        parent = hash((parent, hash_id, i)) & MASK
        out.append(parent)
    return out


def arrival_offsets(rows: list[Row], rate: float) -> list[float]:
    """The trace's own spacing, stretched or squeezed to a mean of `rate` requests/s (as the
    routing benchmark replays it)."""
    start = rows[0]["timestamp"]
    span_s = max(1.0, (rows[-1]["timestamp"] - start) / 1000)
    scale = (len(rows) / rate) / span_s
    return [(row["timestamp"] - start) / 1000 * scale for row in rows]


def requests(rows: list[Row], rate: float, *, tokens_per_id: int, block_size: int,
             max_prompt_tokens: int, output_tokens: Callable[[Row], int], start: float = 0.0,
             namespace: int = 0, exact_ids: bool = False, bos: int = 1) -> list[SimRequest]:
    """Requests for `rows` arriving from `start` at `rate`. A prompt is its `input_length` tokens
    (or, with `exact_ids`, exactly `tokens_per_id` per hash id), plus `bos`, capped at
    `max_prompt_tokens`; `namespace` gives a replay blocks no other namespace shares."""
    out = []
    for index, (row, offset) in enumerate(zip(rows, arrival_offsets(rows, rate))):
        ids = row["hash_ids"]
        length = len(ids) * tokens_per_id if exact_ids else row["input_length"]
        prompt = min(length + bos, max_prompt_tokens)
        full = min(prompt // block_size, len(ids) * (tokens_per_id // block_size))
        out.append(SimRequest(
            request_id=f"{namespace}-{index}", arrival=start + offset,
            prompt_tokens=prompt,
            block_hashes=block_hashes(ids, full, tokens_per_id, block_size, namespace),
            output_tokens=output_tokens(row)))
    return out


def tile(rows: list[Row], copies: int, seed: int = 0) -> list[Row]:
    """`copies` of the trace on one time axis, each with hash ids of its own and its arrivals
    rotated by a random share of the span: `copies` times the load, the same shape of reuse.

    Example: 2 copies of a 100 s trace -> twice the rows over the same 100 s; copy 1's ids are
    shifted past every id of copy 0."""
    if copies <= 1:
        return list(rows)
    rng = random.Random(seed)
    first, last = rows[0]["timestamp"], rows[-1]["timestamp"]
    span = max(1, last - first)
    stride = 1 + max(max(row["hash_ids"], default=0) for row in rows)
    out = []
    for copy in range(copies):
        shift = 0 if copy == 0 else rng.randrange(span)
        for row in rows:
            at = first + (row["timestamp"] - first + shift) % span
            out.append(row | {"timestamp": at,
                              "hash_ids": [h + copy * stride for h in row["hash_ids"]]})
    out.sort(key=lambda row: row["timestamp"])
    return out


def reusable_tokens(requests: list[SimRequest], block_size: int) -> list[tuple[SimRequest, int]]:
    """Each request, in order of arrival, with the prompt tokens an infinite cache shared by every
    replica would serve it: its longest prefix of blocks any earlier request had, as an engine
    counts it (at least one prompt token is computed).

    Example (block 16): a 64-token prompt of blocks [1, 2, 3, 4], then the same prompt, then one
    of [1, 2, 9] -> 0, 48 (its last block is recomputed) and 32 tokens."""
    seen: set[int] = set()
    out = []
    for request in sorted(requests, key=lambda r: r.arrival):
        matched = 0
        for block in request.block_hashes:
            if block not in seen:
                break
            matched += 1
        out.append((request, min(matched, (request.prompt_tokens - 1) // block_size) * block_size))
        seen.update(request.block_hashes)
    return out
