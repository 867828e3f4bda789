"""NVIDIA Dynamo's KV router cost function (`DefaultWorkerSelector`) with the load it tracks
(`ActiveSequences`) and the overlaps its indexer gives, as the simulated gateway's router.

Sources (github ai-dynamo/dynamo):
- `lib/llm/src/kv_router/scheduler.rs` at commit db19bd2a659d4cb04998fb4101cd0dbfbbeba9d4:
  `DefaultWorkerSelector::select_worker` and `softmax_sample`;
- `lib/llm/src/kv_router/sequence.rs` (`ActiveSequences`: `add_request`,
  `mark_prefill_completed`, `free`, `potential_blocks_and_tokens`), a 2025 version (its commit
  unknown) whose `potential_blocks_and_tokens(token_seq, isl, overlap)` is the one
  scheduler.rs's queue calls;
- `KvRouterConfig::default()`: overlap_score_weight 1.0, router_temperature 0.0,
  router_track_active_blocks true, router_track_output_blocks false.

Per worker, with `overlap` its leading blocks of the prompt cached (the indexer, fed by the
engines' KV events), lower is better:

    potential_prefill_tokens = isl - overlap x block_size + prefill tokens of its requests
                               whose first token has not come
    potential_decode_blocks  = distinct blocks of its active requests' prompts, with this
                               prompt's blocks added
    logit = overlap_score_weight x potential_prefill_tokens / block_size + potential_decode_blocks

At temperature 0 the smallest logit wins; ties go to the smallest indexer tree (blocks cached on
the worker), and if those are equal too, to a random one. Above 0, `softmax_sample` over
`-logit / (max - min) / temperature`. The chosen worker then counts the request (`add_request`
with its overlap); its prefill tokens leave at the first token, its blocks at the end.

Worked example (block 32, weight 1, idle workers): a 4-block, 128-token prompt; a holds its
first 3 blocks, b none. a: 1 x (128 - 96) / 32 + 4 = 5; b: 1 x 128 / 32 + 4 = 8 -> a. Had a
two requests waiting for their first token with 320 prefill tokens: a = 15 -> b.

Not ported: the scheduler's queue (`router_queue_threshold`, requests held while every worker is
busy), data-parallel ranks, replica sync between routers and the 300 s expiry of stale
requests. The hash-map orders of the source (softmax over its keys, ties among the smallest
trees) are the replicas' order here.
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from router.index import ReplicaId


@dataclass
class _Active:
    """`ActiveSequences` of one worker: its requests' blocks (counted once) and prefill tokens."""

    blocks: Counter[int] = field(default_factory=Counter)  # block -> active requests holding it
    prefill: dict[str, int] = field(default_factory=dict)  # request -> tokens until first token
    prefill_tokens: int = 0
    sequences: dict[str, Sequence[int]] = field(default_factory=dict)

    def add(self, request_id: str, hashes: Sequence[int], prefill_tokens: int) -> list[int]:
        """Count the request; the blocks it makes active here."""
        self.prefill[request_id] = prefill_tokens
        self.prefill_tokens += prefill_tokens
        self.sequences[request_id] = hashes
        fresh = [block for block in hashes if block not in self.blocks]
        self.blocks.update(hashes)
        return fresh

    def prefill_done(self, request_id: str) -> None:
        self.prefill_tokens -= self.prefill.pop(request_id, 0)

    def free(self, request_id: str) -> list[int]:
        """Forget the request; the blocks no active request holds here any more."""
        self.prefill_done(request_id)
        gone = []
        for block in self.sequences.pop(request_id, ()):
            self.blocks[block] -= 1
            if not self.blocks[block]:
                del self.blocks[block]
                gone.append(block)
        return gone


class DynamoKvRouter:
    """Dynamo's default KV router. Reads the engines' KV events (`kv_events`)."""

    name = "dynamo:kv"
    reads_events = True

    def __init__(self, block_size: int, rng: random.Random, *, overlap_score_weight: float = 1.0,
                 temperature: float = 0.0) -> None:
        self.block_size, self._rng = block_size, rng
        self.weight, self.temperature = overlap_score_weight, temperature
        self._holders: dict[int, set[ReplicaId]] = defaultdict(set)  # the indexer's blocks
        self._tree_size: Counter[ReplicaId] = Counter()
        self._active: dict[ReplicaId, _Active] = defaultdict(_Active)
        # block -> workers with an active request holding it: a prompt's new blocks on every
        # worker in one pass over the prompt, not one per worker
        self._in_use: dict[int, set[ReplicaId]] = defaultdict(set)
        self._placed: dict[str, ReplicaId] = {}

    def overlaps(self, block_hashes: Sequence[int]) -> dict[ReplicaId, int]:
        """Leading blocks of the prompt each worker holds (the indexer's `find_matches`)."""
        depths: dict[ReplicaId, int] = {}
        alive: set[ReplicaId] | None = None
        for depth, block in enumerate(block_hashes):
            holders = self._holders.get(block)
            alive = set(holders or ()) if alive is None else alive & (holders or set())
            if not alive:
                break
            for replica in alive:
                depths[replica] = depth + 1
        return depths

    def logits(self, block_hashes: Sequence[int], prompt_tokens: int,
               replicas: Sequence[ReplicaId]) -> tuple[list[float], dict[ReplicaId, int]]:
        overlaps = self.overlaps(block_hashes)
        active_here: Counter[ReplicaId] = Counter()
        for block in block_hashes:
            active_here.update(self._in_use.get(block, ()))
        out = []
        for replica in replicas:
            active = self._active[replica]
            prefill = prompt_tokens - overlaps.get(replica, 0) * self.block_size \
                + active.prefill_tokens
            new_blocks = len(block_hashes) - active_here[replica]
            decode = new_blocks + len(active.blocks)
            out.append(self.weight * prefill / self.block_size + decode)
        return out, overlaps

    def choose(self, request_id: str, block_hashes: Sequence[int], prompt_tokens: int,
               replicas: Sequence[ReplicaId], load: Mapping[ReplicaId, int]) -> ReplicaId:
        logits, overlaps = self.logits(block_hashes, prompt_tokens, replicas)
        if self.temperature == 0.0:
            low = min(logits)
            tied = [r for r, logit in zip(replicas, logits) if logit == low]
            sizes = [self._tree_size[r] for r in tied]
            if len(tied) == 1:
                chosen = tied[0]
            elif all(size == sizes[0] for size in sizes):
                chosen = tied[self._rng.randrange(len(tied))]
            else:
                chosen = tied[sizes.index(min(sizes))]
        else:
            chosen = replicas[softmax_sample(logits, self.temperature, self._rng.random())]
        prefill = prompt_tokens - overlaps.get(chosen, 0) * self.block_size
        for block in self._active[chosen].add(request_id, block_hashes, prefill):
            self._in_use[block].add(chosen)
        self._placed[request_id] = chosen
        return chosen

    def first_token(self, request_id: str) -> None:
        replica = self._placed.get(request_id)
        if replica is not None:
            self._active[replica].prefill_done(request_id)

    def finished(self, request_id: str) -> None:
        replica = self._placed.pop(request_id, None)
        if replica is None:
            return
        for block in self._active[replica].free(request_id):
            users = self._in_use[block]
            users.discard(replica)
            if not users:
                del self._in_use[block]

    def kv_events(self, replica: ReplicaId, events: Sequence[tuple[bool, int]]) -> None:
        """An engine's BlockStored (True) and BlockRemoved (False) hashes, in order."""
        for stored, block in events:
            holders = self._holders.get(block)
            if stored and (holders is None or replica not in holders):
                self._holders[block].add(replica)
                self._tree_size[replica] += 1
            elif not stored and holders is not None and replica in holders:
                holders.discard(replica)
                self._tree_size[replica] -= 1
                if not holders:
                    del self._holders[block]


def softmax_sample(logits: Sequence[float], temperature: float, sample: float) -> int:
    """The index `softmax_sample` draws for a uniform `sample` in [0, 1): lower logits likelier.

    Example: logits [1, 2], temperature 1 -> weights e^0 and e^-1, probabilities 0.73 and 0.27;
    sample 0.5 -> 0, sample 0.8 -> 1."""
    low, high = min(logits), max(logits)
    if low == high:
        probabilities = [1 / len(logits)] * len(logits)
    else:
        scaled = [-(v / (high - low)) / temperature for v in logits]
        top = max(scaled)
        weights = [math.exp(v - top) for v in scaled]
        total = sum(weights)
        probabilities = [w / total for w in weights]
    cumulative = 0.0
    for index, p in enumerate(probabilities):
        cumulative += p
        if sample <= cumulative:
            return index
    return len(logits) - 1
