"""Pickers: turn total scores into an order of preference."""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.index import ReplicaId
from router.plugins import Candidate
from router.turn import Turn, local_turn


class MaxScorePicker:
    """Highest total score first. Candidates within `tolerance` (relative) of the best are
    shuffled, so equal replicas share load instead of the first one taking everything.

    Example (tolerance 0.05): scores [1.0, 0.97, 0.5] -> the first two in random order, then the
    third.
    """

    name = "max_score"

    def __init__(self, tolerance: float = 0.05, rng: random.Random | None = None) -> None:
        self._tolerance, self._rng = tolerance, rng or random.Random()

    def rank(self, candidates: Sequence[Candidate], scores: Sequence[float]) -> list[Candidate]:
        if not candidates:
            return []
        order = sorted(range(len(candidates)), key=scores.__getitem__, reverse=True)
        cutoff = scores[order[0]] * (1.0 - self._tolerance) if scores[order[0]] > 0 else 0.0
        top = [i for i in order if scores[i] >= cutoff]
        self._rng.shuffle(top)
        rest = [i for i in order if scores[i] < cutoff]
        return [candidates[i] for i in top + rest]


class RoundRobinPicker:
    """Ignores scores: the next replica in turn (by replica id), the others after it. `turn`
    draws the turn's tickets (router/turn.py: one shared by a node's ingresses); by default this
    picker's own.

    Example: replicas [a, b, c] over three requests -> a, b, c first in turn.
    """

    name = "round_robin"

    def __init__(self, turn: Turn | None = None) -> None:
        self._turn = turn or local_turn()
        self._offered: list[ReplicaId] = []  # the replicas of the last rank_ids, and in order
        self._ordered: list[ReplicaId] = []

    def rank(self, candidates: Sequence[Candidate], scores: Sequence[float]) -> list[Candidate]:
        by_id = {c.replica: c for c in candidates}
        return [by_id[replica] for replica in self.rank_ids(list(by_id))]

    def rank_ids(self, replicas: Sequence[ReplicaId]) -> list[ReplicaId]:
        """The same turn over bare ids, for a policy that reads nothing of the candidates: no
        snapshot per replica (a pool of 1,024 took 0.24 ms a decision to
        snapshot and sort). The order of a pool that did not change is kept, not sorted again."""
        if not replicas:
            return []
        if replicas != self._offered:
            self._offered, self._ordered = list(replicas), sorted(replicas)
        ordered = self._ordered
        start = self._turn() % len(ordered)
        return ordered[start:] + ordered[:start]


class PowerOfTwoPicker:
    """Two candidates drawn at random, the better scored first (ties: the first drawn), then the
    rest in random order: the power of two choices, as Ray Serve's default router does it.

    Example: scores [1.0, 0.0, 0.5], the draw is (1, 2) -> candidates 2, 1, then 0.
    """

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def rank(self, candidates: Sequence[Candidate], scores: Sequence[float]) -> list[Candidate]:
        order = list(range(len(candidates)))
        self._rng.shuffle(order)
        if len(order) >= 2 and scores[order[1]] > scores[order[0]]:
            order[0], order[1] = order[1], order[0]
        return [candidates[i] for i in order]
