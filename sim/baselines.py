"""Other routers' policies, ported, for `SimCluster` to route with in place of tokenfab's
(`policy="sglang:cache_aware"` etc.), so that they can be compared at the same scale.

| name                      | source                                   | module                    |
| ------------------------- | ---------------------------------------- | ------------------------- |
| `sglang:cache_aware`      | sglang-router 0.3.2                      | `baselines_cache_aware`   |
| `vllm-router:cache_aware` | vllm-router 0.1.17                       | `baselines_cache_aware`   |
| `dynamo:kv`               | ai-dynamo/dynamo KV router, db19bd2a     | `baselines_dynamo`        |

Each module's docstring names its source files, the defaults used, the formula with a worked
example and what could not be ported exactly. All match prompts by the engines' block hashes,
so a match counts whole blocks.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from router.index import ReplicaId
from sim.baselines_cache_aware import (SGLANG_0_3_2, VLLM_ROUTER_0_1_17, SglangCacheAware,
                                       VllmRouterCacheAware)
from sim.baselines_dynamo import DynamoKvRouter


class BaselineRouter(Protocol):
    """A ported router. The simulated gateway calls it from its loop only, never concurrently:
    `choose` once per request, then `first_token` when its first token returns and `finished`
    when its response ends (where the source routers release a request's load); `kv_events`
    with each engine step's KV events, `event_lag_s` after the step, when `reads_events`."""

    name: str
    reads_events: bool

    def choose(self, request_id: str, block_hashes: Sequence[int], prompt_tokens: int,
               replicas: Sequence[ReplicaId], load: Mapping[ReplicaId, int]) -> ReplicaId:
        """One of `replicas` (non-empty, ready, in the cluster's order) for the request.
        `block_hashes` are its prompt's full blocks (`prompt_tokens` tokens in all), `load` each
        replica's requests sent and not yet finished, the request itself not counted."""
        ...

    def first_token(self, request_id: str) -> None: ...

    def finished(self, request_id: str) -> None: ...

    def kv_events(self, replica: ReplicaId, events: Sequence[tuple[bool, int]]) -> None:
        """(stored, block hash) in the engine's order: True for BlockStored, False for
        BlockRemoved."""
        ...


# name -> factory(block_size, clock, rng)
Factory = Callable[[int, Callable[[], float], random.Random], BaselineRouter]
BASELINES: dict[str, Factory] = {
    "sglang:cache_aware": lambda block_size, clock, rng: SglangCacheAware(
        SGLANG_0_3_2, block_size, clock),
    "vllm-router:cache_aware": lambda block_size, clock, rng: VllmRouterCacheAware(
        VLLM_ROUTER_0_1_17, block_size, clock),
    "dynamo:kv": lambda block_size, clock, rng: DynamoKvRouter(block_size, rng),
}


def is_baseline(policy: str) -> bool:
    return policy in BASELINES


def build_baseline(policy: str, block_size: int, clock: Callable[[], float],
                   rng: random.Random) -> BaselineRouter:
    """The port called `policy`, on the simulated `clock`, drawing from `rng`."""
    try:
        factory = BASELINES[policy]
    except KeyError:
        raise ValueError(f"unknown baseline router {policy!r}; known: {sorted(BASELINES)}") \
            from None
    return factory(block_size, clock, rng)
