"""The `cache_aware` policies of sglang-router 0.3.2 and vllm-router 0.1.17 (a fork of it), as
the simulated gateway's router. Both keep an approximate radix tree of what they sent where
(`sim.baselines_tree`) and a count of requests in flight per worker.

Sources (the PyPI sdists of those versions):
- sglang-router 0.3.2: `src/policies/cache_aware.rs` (`select_worker`, `select_worker_min_load`),
  `src/policies/tree.rs`, `src/policies/utils.rs` (`PeriodicTask`), `src/core/worker.rs`
  (`WorkerLoadGuard`), `src/routers/http/router.rs`; defaults from the Python `RouterArgs`
  (`sglang_router/router_args.py`), which the launcher passes: cache_threshold 0.3,
  balance_abs_threshold 64, balance_rel_threshold 1.5, eviction_interval_secs 60,
  max_tree_size 2**26.
- vllm-router 0.1.17: `src/policies/cache_aware.rs` (`prepare_selection`, `select_prepared`, the
  path `select_worker_with_inputs` that its HTTP router takes), `src/tree.rs`,
  `src/protocols/spec.rs` (`cache_routing`: token keys of 8 hex characters after a 6-character
  tag); defaults from `vllm_router/router_args.py`: 0.3, 64, 1.5, eviction every 120 s,
  max_tree_size 2**25.

The rule, both: load = requests the router sent a worker and whose response has not ended (the
load guard is taken at dispatch and dropped when the body ends). The pool is imbalanced when
`max - min > balance_abs_threshold and max > min * balance_rel_threshold` (f32); then the least
loaded worker (first of equals) is chosen. Else:
- sglang: match the prompt against the whole tree; rate = matched / prompt (f32). Above
  `cache_threshold`, the tenant the deepest matched node caches (its creator, not the worker
  sent it last); else the least loaded. The source's header says "smallest tree" below the
  threshold; its code, ported here, takes the least loaded.
- vllm-router: match against each worker's own paths; rate = its matched / prompt (f64). When
  the best rate is above the threshold, the least loaded of the workers with that rate; else
  the least loaded of all.
Either way the prompt is then inserted for the chosen worker (when imbalanced too).

Worked example (block 32, 2 workers idle): a 10-block prompt (320 tokens) of which worker a was
sent the first 4 blocks and b the first 2: sglang matches 4 blocks (128/320 = 0.4 > 0.3) and
takes the deepest node's creator, a; vllm-router rates a 0.4 and b 0.2 and takes a. With only 3
blocks sent to a (0.3, not above 0.3) both take the least loaded, a (first of equals).

Granularity: the source matches characters (sglang) or tokens (vllm-router); here the keys are
the prompt's block hashes, so a match counts whole blocks, as tokens (blocks x block size), over
the prompt's tokens: a prompt's partial last block never matches, so an identical prompt rates
a little under 1. The tree budgets become blocks: sglang's `max_tree_size` characters are taken
as tokens (a character per token); vllm-router's are its key characters, 8 a token plus the tag.

Not ported exactly: eviction runs on a thread every interval (after the first interval, then
each interval after); here it runs at the first decision after each interval of simulated time,
which the decisions cannot tell apart (nothing changes the tree between decisions). A chosen
tenant that is not among the offered replicas is dropped from the tree and the first replica
taken, as the source does for a removed or unhealthy worker.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from router.index import ReplicaId
from sim.baselines_tree import ApproxTree

_F32 = np.float32
_TOKEN_KEY_CHARS, _TOKEN_KEY_TAG = 8, len("\0ca:i:")  # vllm-router's cache_routing keys


@dataclass(frozen=True)
class CacheAwareConfig:
    """A launcher's `--cache-threshold` etc.; defaults are sglang-router 0.3.2's CLI."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 60.0
    max_tree_size: int = 2**26


SGLANG_0_3_2 = CacheAwareConfig()
VLLM_ROUTER_0_1_17 = CacheAwareConfig(eviction_interval_s=120.0, max_tree_size=2**25)


class _CacheAware:
    """What the two share: the tree, its workers, the imbalance rule and the eviction clock."""

    reads_events = False

    def __init__(self, config: CacheAwareConfig, block_size: int,
                 clock: Callable[[], float]) -> None:
        self.config, self.block_size, self._clock = config, block_size, clock
        self.tree = ApproxTree()
        self._known: set[ReplicaId] = set()
        self._next_eviction = clock() + config.eviction_interval_s

    def _prepare(self, replicas: Sequence[ReplicaId]) -> None:
        """Evict if an interval has passed; add new workers as `add_worker` does (an empty
        insert)."""
        interval = self.config.eviction_interval_s
        now = self._clock()
        if interval > 0 and now >= self._next_eviction:
            self.tree.evict(self._max_blocks())
            self._next_eviction += interval * ((now - self._next_eviction) // interval + 1)
        for replica in replicas:
            if replica not in self._known:
                self._known.add(replica)
                self.tree.insert((), replica)

    def _max_blocks(self) -> int:
        return self.config.max_tree_size // self.block_size

    def _imbalanced(self, loads: list[int]) -> bool:
        low, high = min(loads), max(loads)
        return high - low > self.config.balance_abs_threshold \
            and _F32(high) > _F32(low) * _F32(self.config.balance_rel_threshold)

    def record(self, block_hashes: Sequence[int], replicas: Sequence[ReplicaId],
               chosen: ReplicaId) -> None:
        """A decision made elsewhere (`sim.decisions`): the prompt inserted for `chosen`, as
        `choose` inserts it. sglang's match in `choose` also moves the tree's epochs (one match
        in 8 refreshes a node's); those order eviction only, and are not replayed."""
        self._prepare(replicas)
        self.tree.insert(block_hashes, chosen)

    def first_token(self, request_id: str) -> None:
        pass

    def finished(self, request_id: str) -> None:
        pass  # the load is the cluster's count of requests in flight

    def kv_events(self, replica: ReplicaId, events: Sequence[tuple[bool, int]]) -> None:
        pass


class SglangCacheAware(_CacheAware):
    """sglang-router 0.3.2 `cache_aware`."""

    name = "sglang:cache_aware"

    def choose(self, request_id: str, block_hashes: Sequence[int], prompt_tokens: int,
               replicas: Sequence[ReplicaId], load: Mapping[ReplicaId, int]) -> ReplicaId:
        self._prepare(replicas)
        loads = [load[r] for r in replicas]
        least = replicas[loads.index(min(loads))]
        if self._imbalanced(loads):
            self.tree.insert(block_hashes, least)
            return least
        tenant, matched = self.tree.prefix_match(block_hashes)
        rate = _F32(matched * self.block_size) / _F32(prompt_tokens) if prompt_tokens else 0.0
        if rate <= _F32(self.config.cache_threshold):
            chosen = least
        elif tenant in replicas:
            chosen = ReplicaId(tenant)
        else:  # a worker that left: forget it, take the first
            self.tree.remove_tenant(tenant)
            self._known.discard(tenant)
            return replicas[0]
        self.tree.insert(block_hashes, chosen)
        return chosen


class VllmRouterCacheAware(_CacheAware):
    """vllm-router 0.1.17 `cache_aware` (its token-key path)."""

    name = "vllm-router:cache_aware"

    def _max_blocks(self) -> int:
        tokens = (self.config.max_tree_size - _TOKEN_KEY_TAG) // _TOKEN_KEY_CHARS
        return tokens // self.block_size

    def choose(self, request_id: str, block_hashes: Sequence[int], prompt_tokens: int,
               replicas: Sequence[ReplicaId], load: Mapping[ReplicaId, int]) -> ReplicaId:
        self._prepare(replicas)
        depths = self.tree.match_depths(block_hashes)
        rates = [depths.get(r, 0) * self.block_size / prompt_tokens if prompt_tokens else 0.0
                 for r in replicas]
        best = max(rates, default=0.0)
        use_prefix = not self._imbalanced([load[r] for r in replicas]) \
            and best > float(_F32(self.config.cache_threshold))
        pool = [r for r, rate in zip(replicas, rates) if rate == best] if use_prefix \
            else replicas
        chosen = min(pool, key=load.__getitem__)  # first of equals, as Rust's min_by_key
        self.tree.insert(block_hashes, chosen)
        return chosen
