"""Named routing policies: filters, then weighted scorers, then a picker.

A policy ranks candidates; it never blocks and never talks to another process.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from router.pickers import MaxScorePicker, PowerOfTwoPicker, RoundRobinPicker
from router.index import ReplicaId
from router.plugins import Candidate, Filter, IdPicker, Picker, RouteRequest
from router.scorers import SCORERS, AdapterSlotFilter, OverloadFilter, TTFTTargetFilter
from router.turn import Turn

# Default scorer weights of each score-based policy; `router.weights` in a topology replaces them.
DEFAULT_WEIGHTS: dict[str, dict[str, float]] = {
    "kv_aware": {"ttft": 1.0, "approx_prefix": 1.0, "cache_room": 1.0},
    "prefix_approx": {"approx_prefix": 1.0, "queue": 0.5},
    "round_robin": {},
    "least_loaded": {"queue": 1.0},
}
POLICIES = tuple(DEFAULT_WEIGHTS)
DEFAULT_MAX_CANDIDATES = 64  # replicas scored per decision (about 5 us each); 0: all
# scorers that read the request's blocks; those that read the map fed by engine events; those
# that read each replica's TTFT model
_PREFIX_SCORERS = frozenset({"prefix", "approx_prefix", "ttft", "delay", "cache_room"})
_MAP_SCORERS = frozenset({"prefix", "ttft", "delay", "cache_room"})
_MODEL_SCORERS = frozenset({"ttft", "delay"})
_MODEL_FILTERS = frozenset({"ttft_target"})  # filters that read the estimate, so all of the above


@dataclass
class Scored:
    """One decision, kept for metrics and for `/tokenfab/route` explanations."""

    ranked: list[Candidate]
    scores: dict[str, float] = field(default_factory=dict)  # replica -> total score


class Policy:
    """Stateless apart from the randomness or cursor of the picker and of `shortlist`; safe to
    call from one thread."""

    def __init__(self, name: str, filters: Sequence[Filter], weights: Mapping[str, float],
                 picker: Picker, scorer_args: Mapping[str, Mapping[str, Any]] | None = None,
                 *, max_candidates: int = 0, rng: random.Random | None = None) -> None:
        unknown = sorted(set(weights) - set(SCORERS))
        if unknown:
            raise ValueError(f"unknown scorer(s) {unknown}; known: {sorted(SCORERS)}")
        self.name, self.filters, self.picker = name, list(filters), picker
        # whether a filter reads the estimated TTFT (so the map's cached tokens and the model)
        self._estimates = any(step.name in _MODEL_FILTERS for step in self.filters)
        self.max_candidates, self._rng = max_candidates, rng or random.Random()
        self.weights = {scorer: weight for scorer, weight in weights.items() if weight}
        args = scorer_args or {}
        self._scorers = {scorer: SCORERS[scorer](**args.get(scorer, {})) for scorer in self.weights}

    @property
    def uses_prefixes(self) -> bool:
        """Whether ranking reads the request's block hashes (else no prompt is hashed)."""
        return bool(_PREFIX_SCORERS & set(self.weights)) or self._estimates

    @property
    def reads_candidates(self) -> bool:
        """Whether a filter or scorer reads the candidates' snapshots (else only their ids)."""
        return bool(self.filters or self.weights)

    @property
    def ranks_ids(self) -> bool:
        """Whether `rank_ids` ranks without snapshots: nothing reads them and the picker orders
        ids itself (round robin)."""
        return not self.reads_candidates and hasattr(self.picker, "rank_ids")

    def rank_ids(self, replicas: Sequence[ReplicaId]) -> list[ReplicaId]:
        """The order of preference where `ranks_ids`; what `rank` would give, as ids."""
        return cast(IdPicker, self.picker).rank_ids(replicas)

    @property
    def reads_block_map(self) -> bool:
        """Whether ranking reads the KV block map (else no engine events are followed)."""
        return bool(_MAP_SCORERS & set(self.weights)) or self._estimates

    @property
    def reads_ttft_model(self) -> bool:
        """Whether ranking reads the replicas' fitted TTFT models (else candidates carry the
        model's defaults, and no model is read per replica)."""
        return bool(_MODEL_SCORERS & set(self.weights)) or self._estimates

    def shortlist(self, replicas: Sequence[ReplicaId], *lookups: Mapping[ReplicaId, int],
                  ) -> tuple[list[ReplicaId], list[ReplicaId]]:
        """The replicas to snapshot and score for a request, and the rest: fallbacks, unscored,
        in their given order rotated at random.

        Scoring costs each replica a few microseconds per request, so a pool of 1,024 would cost
        milliseconds a decision. Past `max_candidates` (0: no bound; policies without scorers
        see every replica), the replicas holding the longest prefixes of the request (the most
        blocks any of `lookups` gives them; up to half the places, equal depths in random
        order) and a uniform sample of the others are scored: the power of d choices for load,
        with the longest holders among them.

        Example (max 4): replicas a..h, depths {c: 10, f: 3, z: 5} (z is not offered) -> c, f
        and 2 of the other 6 at random are scored; the remaining 4 follow.
        """
        limit = self.max_candidates
        if not limit or not self.weights or len(replicas) <= limit:
            return list(replicas), []
        depths = dict(lookups[0]) if lookups else {}
        for lookup in lookups[1:]:
            for replica, depth in lookup.items():
                depths[replica] = max(depth, depths.get(replica, 0))
        offered = set(replicas)
        holders = [r for r in depths if r in offered]
        self._rng.shuffle(holders)  # a stable sort then keeps equal depths in random order
        holders = sorted(holders, key=depths.__getitem__, reverse=True)[:limit // 2]
        chosen = set(holders)
        others = [r for r in replicas if r not in chosen]
        sample = self._rng.sample(others, limit - len(holders))
        chosen.update(sample)
        rest = [r for r in others if r not in chosen]
        turn = self._rng.randrange(len(rest)) if rest else 0
        return holders + sample, rest[turn:] + rest[:turn]

    def rank(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Scored:
        kept = list(candidates)
        for step in self.filters:
            kept = step.filter(request, kept)
        totals = [0.0] * len(kept)
        for scorer, weight in self.weights.items():  # each score clamped to [0, 1]
            values = self._scorers[scorer].score(request, kept)
            totals = [total + weight * (v if 0.0 <= v <= 1.0 else float(v > 1.0))
                      for total, v in zip(totals, values, strict=True)]
        ranked = self.picker.rank(kept, totals)
        if len(kept) < len(candidates):
            kept_ids = {c.replica for c in kept}
            ranked += [c for c in candidates if c.replica not in kept_ids]
        return Scored(ranked, dict(zip([c.replica for c in kept], totals)))


def build_policy(name: str, weights: Mapping[str, float] | None = None, *,
                 max_in_flight: int | None = None, ttft_target_s: float = 0.0,
                 tolerance: float = 0.05,
                 max_candidates: int = DEFAULT_MAX_CANDIDATES,
                 rng: random.Random | None = None, turn: Turn | None = None) -> Policy:
    """The policy called `name` in a topology file, with optional scorer weights. Score-based
    policies skip replicas with `max_in_flight` requests in flight (None: each engine's
    max_num_seqs); kv_aware also those estimated past `ttft_target_s` (0: no target), while
    others are not. round_robin draws its turn from `turn` (default: its own)."""
    if name not in DEFAULT_WEIGHTS:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(DEFAULT_WEIGHTS)}")
    rng = rng or random.Random()
    if name == "round_robin":
        return Policy(name, [], {}, RoundRobinPicker(turn))
    if name == "least_loaded":  # Ray Serve's default router: power of two choices on queue length
        return Policy(name, [], DEFAULT_WEIGHTS[name], PowerOfTwoPicker(rng),
                      max_candidates=max_candidates, rng=rng)
    chosen = dict(weights) if weights else DEFAULT_WEIGHTS[name]
    filters: list[Filter] = [OverloadFilter(max_in_flight), AdapterSlotFilter()]
    if name == "kv_aware" and ttft_target_s > 0:
        filters.append(TTFTTargetFilter(ttft_target_s))
    return Policy(name, filters, chosen,
                  MaxScorePicker(tolerance, rng),
                  max_candidates=max_candidates, rng=rng)
