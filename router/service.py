"""The routing service of one pool, in each ingress process: the global KV block map fed by every
replica's events, this router's load view, and the policy that ranks replicas.

A background thread follows the replicas the registry reports (subscribe, apply events in order,
recover gaps, drop replicas that left); Ray Serve's request router calls `rank` and `dispatched`
from its own loop, the gateway calls `route_key`, `first_token` and `finished` from its loop. One
lock guards the map and the load view; nothing under it blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from router.event_sync import ReplicaEventStream
from router.hashing import BlockHasher
from router.index import KVBlockIndex, ReplicaId
from router.load import DispatchHistory, LoadTracker
from router.metrics import RouterMetrics
from router.plugins import Candidate, RouteRequest
from router.policies import Policy
from router.ttft_model import TTFTModel
from router.wire import ReplicaView, RouteKey

logger = logging.getLogger(__name__)

ReplicaSource = Callable[[], Sequence[ReplicaView]]  # blocking; called on the follower thread


class RoutingService:
    def __init__(self, pool: str, policy: Policy, source: ReplicaSource,
                 hasher_factory: Callable[[int], BlockHasher], metrics: RouterMetrics | None = None,
                 *, max_index_entries: int = 10_000_000, refresh_s: float = 1.0,
                 history_ttl_s: float = 300.0, prior_tokens_per_s: float = 4000.0,
                 in_flight_cost_tokens: float = 128.0) -> None:
        self.pool, self.policy = pool, policy
        self._source, self._hasher_factory, self._metrics = source, hasher_factory, metrics
        self._refresh_s = refresh_s
        self._lock = threading.Lock()
        self._index = KVBlockIndex(max_index_entries)
        self._tracker = LoadTracker(TTFTModel(prior_tokens_per_s, in_flight_cost_tokens))
        self._history = DispatchHistory(history_ttl_s)
        self._views: dict[ReplicaId, ReplicaView] = {}
        self._streams: dict[ReplicaId, ReplicaEventStream] = {}
        self._hashers: dict[int, BlockHasher] = {}
        self._context = zmq.Context()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._counted: dict[ReplicaId, tuple[int, int, int]] = {}
        if metrics is not None:  # every series exists from the start, at 0
            metrics.decisions.labels(pool, policy.name)
            for outcome in ("replayed", "cleared"):
                metrics.gaps.labels(pool, outcome)

    # -- gateway side -------------------------------------------------------------------------

    def block_size(self) -> int:
        """The engines' KV block size, once a replica has reported it (0 before)."""
        return next((v.block_size for v in self._views.values() if v.block_size), 0)

    def route_key(self, request_id: str, token_ids: Sequence[int],
                  cache_salt: str | None = None) -> RouteKey | None:
        """Hash the prompt as the engines will (CPU work: call it off the event loop)."""
        block_size = self.block_size()
        if not block_size:
            return None
        hasher = self._hashers.get(block_size)
        if hasher is None:
            hasher = self._hashers[block_size] = self._hasher_factory(block_size)
        hashes = hasher.block_hashes(token_ids, cache_salt=cache_salt)
        return RouteKey(request_id, len(token_ids), block_size, hashes)

    def first_token(self, request_id: str) -> None:
        with self._lock:
            self._tracker.first_token(request_id)

    def finished(self, request_id: str) -> None:
        with self._lock:
            self._tracker.finished(request_id)

    # -- request-router side ------------------------------------------------------------------

    def rank(self, key: RouteKey | None, replicas: Sequence[ReplicaId]) -> list[ReplicaId]:
        """Replicas in order of preference for the request (first is the choice).

        The request is counted on its first choice at once: requests routed in the same instant
        see each other's load before Serve confirms any placement (`dispatched` corrects it).
        """
        with self._lock:
            candidates = self._candidates(key, replicas)
            scored = self.policy.rank(_request(key), candidates)
            if key is not None and scored.ranked:
                first = scored.ranked[0]
                self._tracker.dispatched(key.request_id, first.replica, first.uncached_tokens(
                    _request(key)))
        return [c.replica for c in scored.ranked]

    def dispatched(self, key: RouteKey | None, replica: ReplicaId) -> None:
        """Serve placed the request on `replica`: count its load and remember its prefix."""
        with self._lock:
            cached = 0
            if key is not None:
                matched = self._index.longest_prefix(key.block_hashes).get(replica, 0)
                cached = min(matched * key.block_size, key.prompt_tokens)
                self._tracker.dispatched(key.request_id, replica, key.prompt_tokens - cached)
                self._history.record(replica, key.block_hashes)
        if self._metrics is not None:
            self._metrics.decisions.labels(self.pool, self.policy.name).inc()
            if key is not None:
                self._metrics.prompt_tokens.labels(self.pool).inc(key.prompt_tokens)
                self._metrics.predicted_cached.labels(self.pool).inc(cached)

    def _candidates(self, key: RouteKey | None, replicas: Sequence[ReplicaId]) -> list[Candidate]:
        """Snapshots of `replicas` for this request (a hot path: ~1 us per replica)."""
        hashes = key.block_hashes if key else []
        block, prompt = (key.block_size, key.prompt_tokens) if key else (0, 0)
        held = self._index.longest_prefix(hashes) if hashes else {}
        approx = "approx_prefix" in self.policy.weights and bool(hashes)
        tracker, views, history = self._tracker, self._views, self._history
        out = []
        for replica in replicas:
            view = views.get(replica)
            model = tracker.ttft_params(replica)
            out.append(Candidate(
                replica=replica,
                cached_tokens=min(held.get(replica, 0) * block, prompt),
                approx_cached_tokens=min(history.cached_blocks(replica, hashes) * block, prompt)
                if approx else 0,
                queued_prefill_tokens=tracker.queued_prefill_tokens(replica),
                in_flight=max(tracker.in_flight(replica), view.in_flight if view else 0),
                kv_usage=view.kv_usage if view else 0.0,
                prefill_tokens_per_s=model.tokens_per_s,
                in_flight_cost_tokens=model.in_flight_cost_tokens,
                overhead_s=model.overhead_s,
            ))
        return out

    # -- introspection ------------------------------------------------------------------------

    def explain(self, key: RouteKey | None) -> dict[str, Any]:
        """What the policy would do with this request now (for `/tokenfab/route`)."""
        with self._lock:
            candidates = self._candidates(key, sorted(self._views))
            scored = self.policy.rank(_request(key), candidates)
        return {
            "pool": self.pool, "policy": self.policy.name,
            "prompt_tokens": key.prompt_tokens if key else None,
            "block_size": key.block_size if key else None,
            "block_hashes": [_hex(h) for h in key.block_hashes] if key else [],
            "ranked": [c.replica for c in scored.ranked],
            "candidates": [{
                "replica": c.replica, "cached_tokens": c.cached_tokens,
                "approx_cached_tokens": c.approx_cached_tokens,
                "queued_prefill_tokens": c.queued_prefill_tokens, "in_flight": c.in_flight,
                "kv_usage": c.kv_usage, "prefill_tokens_per_s": round(c.prefill_tokens_per_s, 1),
                "in_flight_cost_tokens": round(c.in_flight_cost_tokens, 1),
                "overhead_s": round(c.overhead_s, 4),
                "estimated_ttft_s": round(c.estimated_ttft_s(_request(key)), 6),
                "score": round(scored.scores.get(c.replica, 0.0), 6),
            } for c in candidates],
        }

    def replicas(self) -> dict[ReplicaId, dict[str, Any]]:
        """Per followed replica: blocks in the map and the state of its event stream."""
        with self._lock:
            out = {}
            for replica, view in self._views.items():
                stream = self._streams.get(replica)
                stats = stream.stats if stream else None
                out[replica] = {
                    "cached_blocks": self._index.blocks_of(replica),
                    "event_batches": stats.batches if stats else 0,
                    "gaps_recovered": stats.gaps_recovered if stats else 0,
                    "caught_up": stats.caught_up if stats else 0,
                    "gaps_cleared": stats.gaps_cleared if stats else 0,
                    "engine_cached_tokens": view.engine_cached_tokens,
                    "engine_prompt_tokens": view.engine_prompt_tokens,
                }
            return out

    def index_entries(self) -> int:
        with self._lock:
            return len(self._index)

    # -- follower thread ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._follow, name=f"kv-map-{self.pool}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            for stream in self._streams.values():
                stream.close()
            self._streams.clear()
        self._context.term()

    def _follow(self) -> None:
        next_refresh = 0.0
        poller = zmq.Poller()
        while not self._stop.is_set():
            if time.monotonic() >= next_refresh:
                next_refresh = time.monotonic() + self._refresh_s
                poller = self._refresh(poller)
            ready = dict(poller.poll(50))
            if ready:
                for stream in list(self._streams.values()):
                    if stream.socket in ready:
                        stream.poll(0)  # applies under the lock, batch by batch
                self._record_stream_metrics()

    def _refresh(self, poller: zmq.Poller) -> zmq.Poller:
        try:
            views = [v for v in self._source() if v.pool == self.pool]
        except Exception as exc:  # the registry is restarting: keep following what we know
            logger.warning("replica registry unavailable: %s", exc)
            return poller
        wanted = {v.replica: v for v in views if v.kv_events_endpoint}
        with self._lock:
            self._views = {v.replica: v for v in views}
            gone = [r for r in self._streams if r not in wanted]
            for replica in gone:  # removed, or restarted (a restart is a new replica id)
                self._streams.pop(replica).close()
                self._index.drop_replica(replica)
                self._tracker.forget(replica)
                self._history.forget(replica)
                self._counted.pop(replica, None)
        added = [r for r in wanted if r not in self._streams]
        for replica in added:  # subscribe, then fetch what was published before (no lock held)
            view = wanted[replica]
            stream = ReplicaEventStream(replica, view.kv_events_endpoint, view.kv_replay_endpoint,
                                        self._index, self._context, lock=self._lock)
            stream.catch_up()
            with self._lock:
                self._streams[replica] = stream
        self._record_view_metrics()
        if not (gone or added):
            return poller
        poller = zmq.Poller()
        for stream in self._streams.values():
            poller.register(stream.socket, zmq.POLLIN)
        return poller

    def _record_view_metrics(self) -> None:
        if self._metrics is None:
            return
        with self._lock:
            rows = [(r, v.engine_cached_tokens, self._index.blocks_of(r))
                    for r, v in self._views.items()]
            entries, followed = len(self._index), len(self._streams)
        for replica, engine_cached, blocks in rows:
            self._metrics.realised_cached.labels(self.pool, replica).set(engine_cached)
            self._metrics.cached_blocks.labels(self.pool, replica).set(blocks)
        self._metrics.index_entries.labels(self.pool).set(entries)
        self._metrics.replicas.labels(self.pool).set(followed)

    def _record_stream_metrics(self) -> None:
        if self._metrics is None:
            return
        lag = 0.0
        with self._lock:
            for replica, stream in self._streams.items():
                stats = stream.stats
                old = self._counted.get(replica, (0, 0, 0))
                new = (stats.batches, stats.gaps_recovered, stats.gaps_cleared)
                self._counted[replica] = new
                self._metrics.event_batches.labels(self.pool).inc(new[0] - old[0])
                self._metrics.gaps.labels(self.pool, "replayed").inc(new[1] - old[1])
                self._metrics.gaps.labels(self.pool, "cleared").inc(new[2] - old[2])
                lag = max(lag, stats.last_lag_s)
            entries = len(self._index)
        self._metrics.event_lag.labels(self.pool).set(lag)
        self._metrics.index_entries.labels(self.pool).set(entries)


def _request(key: RouteKey | None) -> RouteRequest:
    return RouteRequest(key.prompt_tokens, key.block_size) if key else RouteRequest()


def _hex(block: Any) -> str:
    return block.hex() if isinstance(block, bytes) else str(block)
