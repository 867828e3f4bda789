"""The routing service of one pool, in each ingress process: the global KV block map fed by every
replica's events, this router's load view, and the policy that ranks replicas.

Everything runs on the ingress process's event loop, which owns the map and the load view: the
gateway hands it the replicas it knows (`set_replicas`), one task per replica follows that
replica's events (subscribe, apply in order, recover gaps), and the request path asks it to rank.
Nothing here blocks or takes a lock; hashing a prompt is CPU work the caller runs off the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import zmq.asyncio

from router.adapters import AdapterResidency
from router.breaker import CircuitBreakers
from router.event_sync import EventCredentials, ReplicaEventStream
from router.events import KVEventBatch
from router.hashing import BlockHasher
from router.index import BYTES_PER_ENTRY, DEFAULT_MAX_ENTRIES, KVBlockIndex, ReplicaId
from router.load import CacheChurn, DispatchHistory, LoadTracker
from router.metrics import RouterMetrics
from router.plugins import Candidate, RouteRequest
from router.policies import Policy
from router.scorers import OverloadFilter
from router.ttft_model import TTFTModel, TTFTParams
from router.wire import ReplicaView, RouteKey

logger = logging.getLogger(__name__)

RESTART_DELAY_S = 1.0  # a replica's stream that stopped on an error is followed anew after this
MAX_PENDING_LOOKUPS = 4096  # ranked requests whose prefix lookup is kept for their dispatch


class RoutingService:
    def __init__(self, pool: str, policy: Policy,
                 hasher_factory: Callable[[int], BlockHasher], metrics: RouterMetrics | None = None,
                 *, follow_events: bool = True, max_index_entries: int = DEFAULT_MAX_ENTRIES,
                 history_ttl_s: float = 300.0, max_history_entries: int = DEFAULT_MAX_ENTRIES,
                 prior_tokens_per_s: float = 4000.0,
                 in_flight_cost_tokens: float = 128.0,
                 event_credentials: EventCredentials | None = None,
                 breakers: CircuitBreakers | None = None,
                 adapters: AdapterResidency | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool, self.policy = pool, policy
        # None: adapters are ignored (requests hashed and placed as the base model's)
        self.adapters = adapters
        self._breakers = breakers or CircuitBreakers(clock=clock)
        self._event_credentials = event_credentials
        self._hasher_factory, self._metrics, self._clock = hasher_factory, metrics, clock
        self._follow_events = follow_events and policy.reads_block_map  # else nothing reads them
        self._history = DispatchHistory(history_ttl_s, max_history_entries, clock=clock)
        # an eviction the engine reports ends the affinity this router remembers for the block
        self._index = KVBlockIndex(max_index_entries, on_removed=self._history.forget_blocks)
        self._tracker = LoadTracker(TTFTModel(prior_tokens_per_s, in_flight_cost_tokens,
                                              clock=clock), clock=clock)
        self._churn = CacheChurn(clock=clock)
        self._views: dict[ReplicaId, ReplicaView] = {}
        self._streams: dict[ReplicaId, ReplicaEventStream] = {}
        self._tasks: dict[ReplicaId, asyncio.Task[None]] = {}
        self._hashers: dict[int, BlockHasher] = {}
        self._context: zmq.asyncio.Context | None = None
        self._counted: dict[ReplicaId, tuple[int, int, int]] = {}
        self._held: dict[str, dict[ReplicaId, int]] = {}  # ranked, not yet dispatched
        if metrics is not None:  # every series exists from the start, at 0
            metrics.decisions.labels(pool, policy.name)
            for outcome in ("replayed", "cleared"):
                metrics.gaps.labels(pool, outcome)

    # -- gateway side -------------------------------------------------------------------------

    def block_size(self) -> int:
        """The engines' KV block size, once a replica has reported it (0 before)."""
        return next((v.block_size for v in self._views.values() if v.block_size), 0)

    def route_key(self, request_id: str, token_ids: Sequence[int] | None,
                  cache_salt: str | None = None, lora: tuple[str, str] | None = None
                  ) -> RouteKey:
        """The request's identity for routing; its prompt hashed as the engines will when the
        policy uses prefixes (CPU work: call it off the event loop when it hashes). `lora` is
        the request's adapter (name, path), which engines hash into every block."""
        if self.adapters is None:
            lora = None
        adapter = lora[0] if lora else None
        block_size = self.block_size()
        if token_ids is None or not block_size or not self.policy.uses_prefixes:
            return RouteKey(request_id, len(token_ids or ()), block_size, [], adapter)
        hasher = self._hashers.get(block_size)
        if hasher is None:
            hasher = self._hashers[block_size] = self._hasher_factory(block_size)
        hashes = hasher.block_hashes(token_ids, cache_salt=cache_salt, lora=lora)
        return RouteKey(request_id, len(token_ids), block_size, hashes, adapter)

    def rank(self, key: RouteKey, replicas: Sequence[ReplicaId]) -> list[ReplicaId]:
        """Replicas in order of preference for the request (first is the choice); in a large
        pool only a shortlist is scored (Policy.shortlist) and the others follow unscored.

        The request is counted on its first choice at once, so requests routed in the same
        instant see each other's load (`dispatched` corrects it, `finished` removes it)."""
        held, approx = self._lookups(key)
        self._remember(key.request_id, held)
        if self.policy.ranks_ids:  # round robin: no snapshot of every replica
            ids = self.policy.rank_ids(replicas)
            if ids:
                cached = min(held.get(ids[0], 0) * key.block_size, key.prompt_tokens)
                self._tracker.dispatched(key.request_id, ids[0], key.prompt_tokens - cached)
            return ids
        scored_ids, rest = self.policy.shortlist(replicas, approx, held)
        request = _request(key)
        scored = self.policy.rank(request, self._candidates(key, scored_ids, held, approx))
        if scored.ranked:
            first = scored.ranked[0]
            self._tracker.dispatched(key.request_id, first.replica, first.uncached_tokens(request))
        ranked = [c.replica for c in scored.ranked]
        if not rest:
            return ranked
        # the unscored before those a filter dropped (at max_in_flight, say)
        kept = [r for r in ranked if r in scored.scores]
        return kept + rest + [r for r in ranked if r not in scored.scores]

    def _remember(self, request_id: str, held: dict[ReplicaId, int]) -> None:
        """Keep a ranked request's prefix lookup for its `dispatched` (a 16k-token prompt is
        1,000 blocks to walk again); bounded, for callers that rank and never dispatch."""
        pending = self._held
        pending.pop(request_id, None)
        pending[request_id] = held
        if len(pending) > MAX_PENDING_LOOKUPS:
            del pending[next(iter(pending))]

    def dispatched(self, key: RouteKey, replica: ReplicaId) -> None:
        """The request went to `replica`: count its load there and remember its prefix."""
        held = self._held.pop(key.request_id, None)
        if held is None and key.block_hashes:
            held = self._index.longest_prefix(key.block_hashes)
        matched = held.get(replica, 0) if held else 0
        cached = min(matched * key.block_size, key.prompt_tokens)
        self._breakers.answered(replica)
        self._tracker.dispatched(key.request_id, replica, key.prompt_tokens - cached)
        if key.adapter is not None and self.adapters is not None:
            self.adapters.dispatched(replica, key.adapter, key.request_id)
        if key.block_hashes:
            self._history.record(replica, key.block_hashes)
        if self._metrics is not None:
            self._metrics.decisions.labels(self.pool, self.policy.name).inc()
            self._metrics.prompt_tokens.labels(self.pool).inc(key.prompt_tokens)
            self._metrics.predicted_cached.labels(self.pool).inc(cached)

    @property
    def follows_events(self) -> bool:
        """Whether the engines' KV events feed this service's block map (its policy reads it)."""
        return self._follow_events

    def cached_tokens(self, key: RouteKey) -> int | None:
        """Prompt tokens the engine would not compute, on the replica that holds most of the
        prompt among those this router could choose for it now, as the engines' KV events tell
        (the block map: it sees evictions). None when no events feed this service.

        Only replicas the policy could pick count: known, their circuit breaker closed, and not
        dropped by its overload filter (at `max_in_flight` while another replica has room), so
        the count is the cache of a replica the request can go to. An engine computes at least
        a prompt's last token, so a prompt held whole counts its last block as computed.

        Example (block 16): of a 1,000-token prompt, replica a holds 40 blocks and is at its
        in-flight bound, b holds 20 and has room -> 320."""
        if not self._follow_events:
            return None
        hashes = key.block_hashes
        if not hashes:
            return 0
        held = self._index.longest_prefix(hashes)
        blocks = max((held[r] for r in self._placeable(held)), default=0)
        return min(blocks, (key.prompt_tokens - 1) // key.block_size) * key.block_size

    def _placeable(self, replicas: Iterable[ReplicaId]) -> list[ReplicaId]:
        """Those of `replicas` the policy could choose now (see `cached_tokens`)."""
        chosen = [r for r in replicas if r in self._views and self._breakers.allows(r)]
        overload = next((f for f in self.policy.filters if isinstance(f, OverloadFilter)), None)
        if overload is None:
            return chosen

        def full(replica: ReplicaId) -> bool:
            view = self._views[replica]
            return max(self._tracker.in_flight(replica),
                       view.in_flight) >= overload.limit(view.max_num_seqs)

        if all(full(r) for r in self._views):  # the filter keeps every replica then
            return chosen
        return [r for r in chosen if not full(r)]

    def first_token(self, request_id: str) -> None:
        self._tracker.first_token(request_id)

    def finished(self, request_id: str) -> None:
        self._held.pop(request_id, None)
        self._tracker.finished(request_id)
        if self.adapters is not None:
            self.adapters.finished(request_id)

    def migration(self, outcome: str) -> None:
        """A stream lost its replica after sending tokens (see RouterMetrics.migrations)."""
        if self._metrics is not None:
            self._metrics.migrations.labels(self.pool, outcome).inc()

    def failed(self, replica: ReplicaId) -> None:
        """A request on `replica` failed before it was answered (engine dead, replica gone);
        enough of them open its circuit breaker."""
        tripped = self._breakers.failed(replica)
        if tripped:
            logger.warning("pool %s: replica %s failed repeatedly; not chosen for a while",
                           self.pool, replica)
        if self._metrics is not None:
            self._metrics.failures.labels(self.pool, replica).inc()
            if tripped:
                self._metrics.breaker_trips.labels(self.pool, replica).inc()

    def allows(self, replica: ReplicaId) -> bool:
        """Whether the replica's circuit breaker lets the router choose it now."""
        return self._breakers.allows(replica)

    def waiting(self, replica: ReplicaId) -> int:
        """Requests waiting in the replica's engine queue, as it last reported."""
        view = self._views.get(replica)
        return view.waiting if view is not None else 0

    def in_flight(self, replica: ReplicaId) -> int:
        """Requests this router has on `replica` now."""
        return self._tracker.in_flight(replica)

    def _lookups(self, key: RouteKey) -> tuple[dict[ReplicaId, int], dict[ReplicaId, int]]:
        """Leading blocks of the request each replica holds (the engine-fed map) and was sent
        (this router's history, where a scorer reads it); O(blocks), not O(replicas)."""
        hashes = key.block_hashes
        if not hashes:
            return {}, {}
        approx = "approx_prefix" in self.policy.weights
        return (self._index.longest_prefix(hashes),
                self._history.longest_prefix(hashes) if approx else {})

    def _candidates(self, key: RouteKey, replicas: Sequence[ReplicaId],
                    held: dict[ReplicaId, int], approx: dict[ReplicaId, int],
                    explain: bool = False) -> list[Candidate]:
        """Snapshots of `replicas` for this request (a hot path: ~3 us per replica, the TTFT
        model's part only where a scorer reads it, or to explain a decision)."""
        block, prompt = key.block_size, key.prompt_tokens
        room = "cache_room" in self.policy.weights
        modelled = explain or self.policy.reads_ttft_model
        tracker, views, now = self._tracker, self._views, self._clock()
        params, load = tracker.ttft_params, tracker.load
        prior = _PRIOR
        adapter, adapters = key.adapter, self.adapters
        out = []
        for replica in replicas:
            view = views.get(replica)
            model = params(replica, now) if modelled else prior
            queued, in_flight = load(replica)
            out.append(Candidate(
                replica=replica,
                cached_tokens=min(held.get(replica, 0) * block, prompt),
                approx_cached_tokens=min(approx.get(replica, 0) * block, prompt),
                queued_prefill_tokens=queued,
                in_flight=max(in_flight, view.in_flight if view else 0),
                batch_slots=view.max_num_seqs if view else 0,
                kv_usage=view.kv_usage if view else 0.0,
                prefill_tokens_per_s=model.tokens_per_s,
                in_flight_cost_tokens=model.in_flight_cost_tokens,
                overhead_s=model.overhead_s,
                cache_fill=self._cache_fill(replica, view, queued // max(block, 1), now)
                if room else 0.0,
                adapter_load_s=adapters.load_cost_s(replica, adapter)
                if adapter is not None and adapters is not None else 0.0,
                adapter_slot_s=adapters.slot_wait_s(replica, adapter)
                if adapter is not None and adapters is not None else 0.0,
            ))
        return out

    def _cache_fill(self, replica: ReplicaId, view: ReplicaView | None, queued: int,
                    now: float) -> float:
        """Blocks held, stored in about the last minute, and queued, over the replica's capacity.

        Example: 300 of 350 blocks held, 400 stored lately, 50 queued -> 750 / 350 = 2.14."""
        if view is None or not view.kv_blocks:
            return 0.0
        held = self._index.blocks_of(replica)
        churn = self._churn.recent(replica, self._index.stored_by(replica), now)
        return (held + churn + queued) / view.kv_blocks

    # -- introspection ------------------------------------------------------------------------

    def explain(self, key: RouteKey) -> dict[str, Any]:
        """What the policy would do with this request now (for `/tokenfab/route`): every
        replica is scored, also past `router.max_candidates`, where `rank` scores a shortlist."""
        candidates = self._candidates(key, sorted(self._views), *self._lookups(key), explain=True)
        request = _request(key)
        scored = self.policy.rank(request, candidates)
        return {
            "pool": self.pool, "policy": self.policy.name, "adapter": key.adapter,
            "prompt_tokens": key.prompt_tokens, "block_size": key.block_size,
            "block_hashes": [_hex(h) for h in key.block_hashes],
            "ranked": [c.replica for c in scored.ranked],
            "candidates": [{
                "replica": c.replica, "cached_tokens": c.cached_tokens,
                "approx_cached_tokens": c.approx_cached_tokens,
                "queued_prefill_tokens": c.queued_prefill_tokens, "in_flight": c.in_flight,
                "kv_usage": float(c.kv_usage),
                "prefill_tokens_per_s": round(float(c.prefill_tokens_per_s), 1),
                "in_flight_cost_tokens": round(float(c.in_flight_cost_tokens), 1),
                "overhead_s": round(float(c.overhead_s), 4),
                "cache_fill": round(float(c.cache_fill), 4),
                "adapter_load_s": round(float(c.adapter_load_s), 6),
                "adapter_slot_s": round(float(c.adapter_slot_s), 6),
                "estimated_ttft_s": round(float(c.estimated_ttft_s(request)), 6),
                "estimated_delay_s": round(float(c.estimated_delay_s(request)), 6),
                "score": round(float(scored.scores.get(c.replica, 0.0)), 6),
            } for c in candidates],
        }

    def replicas(self) -> dict[ReplicaId, dict[str, Any]]:
        """Per known replica: blocks in the map and the state of its event stream."""
        out = {}
        for replica, view in self._views.items():
            stream = self._streams.get(replica)
            stats = stream.stats if stream else None
            out[replica] = {
                "cached_blocks": self._index.blocks_of(replica),
                "kv_blocks": view.kv_blocks,
                "events": self._stream_state(replica),
                "event_batches": stats.batches if stats else 0,
                "malformed_batches": stats.malformed if stats else 0,
                "gaps_recovered": stats.gaps_recovered if stats else 0,
                "caught_up": stats.caught_up if stats else 0,
                "gaps_cleared": stats.gaps_cleared if stats else 0,
                "engine_cached_tokens": view.engine_cached_tokens,
                "engine_prompt_tokens": view.engine_prompt_tokens,
                "in_flight": self._tracker.in_flight(replica),
                "streaming": self._tracker.streaming(replica),
                "breaker": self._breakers.state(replica),
                "breaker_trips": self._breakers.trips(replica),
            }
        return out

    def index_entries(self) -> int:
        return len(self._index)

    def history_entries(self) -> int:
        """(block, replica) pairs in the dispatch history (router.load.DispatchHistory)."""
        return len(self._history)

    def index_bytes(self) -> int:
        """The block map's memory, estimated from its entries (see router.index)."""
        return len(self._index) * BYTES_PER_ENTRY

    def stream_health(self) -> dict[str, int]:
        """How many replicas' event streams are followed now, and how many should be."""
        expected = [r for r, v in self._views.items() if v.kv_events_endpoint] \
            if self._follow_events else []
        following = sum(self._stream_state(r) == "following" for r in expected)
        return {"expected": len(expected), "following": following}

    def _stream_state(self, replica: ReplicaId) -> str:
        """following, restarting (stopped on an error, followed anew shortly) or off (the
        policy reads no block map, or the replica publishes no events)."""
        task = self._tasks.get(replica)
        if task is not None and not task.done():
            return "following"
        view = self._views.get(replica)
        if self._follow_events and view is not None and view.kv_events_endpoint:
            return "restarting"
        return "off"

    # -- the replicas and their event streams -------------------------------------------------

    def set_replicas(self, views: Sequence[ReplicaView]) -> None:
        """The pool's replicas now (from the registry): follow new ones, drop those that left
        (a restarted replica has a new id), refresh the others' reported load."""
        gone = set(self._views) - {v.replica for v in views}
        self._views = {v.replica: v for v in views}
        for replica in gone:
            self._unfollow(replica)
        if self.adapters is not None:
            for replica in gone:
                self.adapters.forget(replica)
            for view in views:
                self.adapters.reported(view.replica, view.adapters, view.adapter_load_s)
        if self._follow_events:
            for view in views:
                if view.kv_events_endpoint and view.replica not in self._tasks:
                    self._follow(view)
        self._record_view_metrics()

    def apply_events(self, replica: ReplicaId, batch: KVEventBatch) -> None:
        """Apply a batch of the replica's KV events that reached this service by another route
        than a stream it follows (the simulator's engines); in publication order per replica."""
        self._index.apply(replica, batch)

    def _follow(self, view: ReplicaView) -> None:
        """Follow the events of a replica that publishes them (`kv_events_endpoint` set)."""
        assert view.kv_events_endpoint is not None
        if self._context is None:
            self._context = zmq.asyncio.Context()
        stream = ReplicaEventStream(view.replica, view.kv_events_endpoint,
                                    view.kv_replay_endpoint, self._index, self._context,
                                    credentials=self._event_credentials, rank=view.rank)
        self._streams[view.replica] = stream
        task = asyncio.get_running_loop().create_task(
            stream.run(), name=f"kv-events-{self.pool}-{view.replica}")
        task.add_done_callback(self._stream_ended)
        self._tasks[view.replica] = task

    def _stream_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        replica = next((r for r, t in self._tasks.items() if t is task), None)
        logger.error("KV event stream of replica %s stopped: %r; following it anew", replica,
                     task.exception())
        if replica is not None:  # start over from an empty entry: the replay fills it again
            self._stop_following(replica)  # its requests in flight still count
            asyncio.get_running_loop().call_later(RESTART_DELAY_S, self._refollow, replica)

    def _refollow(self, replica: ReplicaId) -> None:
        view = self._views.get(replica)
        if view is not None and view.kv_events_endpoint and replica not in self._tasks:
            self._follow(view)

    def _stop_following(self, replica: ReplicaId) -> None:
        """Stop the replica's stream and forget its blocks (a new stream replays them)."""
        task = self._tasks.pop(replica, None)
        if task is not None and not task.done():
            task.cancel()
        self._streams.pop(replica, None)
        self._index.clear(replica)
        self._counted.pop(replica, None)

    def _unfollow(self, replica: ReplicaId) -> None:
        """The replica left: forget everything about it."""
        self._stop_following(replica)
        self._index.drop_replica(replica)
        self._tracker.forget(replica)
        self._history.forget(replica)
        self._churn.forget(replica)
        self._breakers.forget(replica)

    def stop(self) -> None:
        for replica in list(self._tasks):
            self._unfollow(replica)
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    def record_metrics(self) -> None:
        """Bring the stream and map gauges up to date (called before each /metrics scrape)."""
        if self._metrics is None:
            return
        lag = 0.0
        for replica, stream in self._streams.items():
            stats = stream.stats
            old = self._counted.get(replica, (0, 0, 0))
            new = (stats.batches, stats.gaps_recovered, stats.gaps_cleared)
            self._counted[replica] = new
            self._metrics.event_batches.labels(self.pool).inc(new[0] - old[0])
            self._metrics.gaps.labels(self.pool, "replayed").inc(new[1] - old[1])
            self._metrics.gaps.labels(self.pool, "cleared").inc(new[2] - old[2])
            lag = max(lag, stats.last_lag_s)
        self._metrics.event_lag.labels(self.pool).set(lag)
        self._record_view_metrics()

    def _record_view_metrics(self) -> None:
        if self._metrics is None:
            return
        for replica, view in self._views.items():
            self._metrics.realised_cached.labels(self.pool, replica).set(view.engine_cached_tokens)
            self._metrics.breaker_open.labels(self.pool, replica).set(
                self._breakers.state(replica) == "open")
            self._metrics.cached_blocks.labels(self.pool, replica).set(
                self._index.blocks_of(replica))
        self._metrics.index_entries.labels(self.pool).set(len(self._index))
        self._metrics.index_bytes.labels(self.pool).set(self.index_bytes())
        health = self.stream_health()
        self._metrics.replicas.labels(self.pool).set(health["following"])
        self._metrics.unfollowed.labels(self.pool).set(health["expected"] - health["following"])


_DEFAULT = Candidate(ReplicaId(""))
_PRIOR = TTFTParams(_DEFAULT.prefill_tokens_per_s, _DEFAULT.in_flight_cost_tokens,
                    _DEFAULT.overhead_s)  # a candidate's defaults, where no scorer reads them


def _request(key: RouteKey) -> RouteRequest:
    return RouteRequest(key.prompt_tokens, key.block_size or 1, key.adapter)


def _hex(block: Any) -> str:
    return block.hex() if isinstance(block, bytes) else str(block)
