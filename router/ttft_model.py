"""Time to first token as a function of the work ahead, fitted online from observed first tokens.

    TTFT(r) = speed(r) * (overhead + work / P + busy * c / P)

`work` is the prefill queued on replica r plus the request's own uncached tokens, `busy` the
requests already running there (their decode steps share every engine step with the prefill).
`overhead`, `1/P` and `c/P` are one least-squares fit per pool, with recent samples weighted
most and a prior worth one sample; `speed(r)` is the replica's observed / predicted time, summed
over its recent samples and shrunk toward 1, so a slower node or a noisy neighbour shows while
noise on a few samples does not unbalance identical replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from router.index import ReplicaId

_SCALE = 1000.0  # work in thousands of tokens keeps the normal equations well conditioned


@dataclass(frozen=True)
class TTFTParams:
    """What a scorer needs for one replica; estimate = overhead_s + work_tokens / tokens_per_s."""

    tokens_per_s: float
    in_flight_cost_tokens: float
    overhead_s: float


@dataclass
class _Speed:
    observed: float = 0.0
    predicted: float = 0.0


@dataclass
class TTFTModel:
    prior_tokens_per_s: float = 4000.0
    prior_in_flight_cost_tokens: float = 128.0
    prior_overhead_s: float = 0.02
    decay: float = 0.98  # weight of the previous samples at each new one (about 50 samples)
    speed_prior_s: float = 2.0  # seconds of "as predicted" each replica's speed starts with
    samples: int = 0
    _gram: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)))
    _moment: np.ndarray = field(default_factory=lambda: np.zeros(3))
    _theta: np.ndarray | None = None
    _speeds: dict[ReplicaId, _Speed] = field(default_factory=dict)

    def __post_init__(self) -> None:
        seconds_per_k = _SCALE / self.prior_tokens_per_s
        self._prior = np.array([self.prior_overhead_s, seconds_per_k,
                                self.prior_in_flight_cost_tokens / self.prior_tokens_per_s])
        self._theta = self._prior.copy()

    def observe(self, replica: ReplicaId, work_tokens: int, busy: int, elapsed_s: float) -> None:
        """One first token: `work_tokens` had to be prefilled before it, beside `busy` others."""
        x = np.array([1.0, work_tokens / _SCALE, float(busy)])
        predicted = float(x @ self._theta)
        speed = self._speeds.setdefault(replica, _Speed())
        speed.observed = self.decay * speed.observed + elapsed_s
        speed.predicted = self.decay * speed.predicted + max(predicted, 1e-6)
        self._gram = self.decay * self._gram + np.outer(x, x)
        self._moment = self.decay * self._moment + x * elapsed_s
        self.samples += 1
        self._theta = self._solve()

    def _solve(self) -> np.ndarray:
        ridge = np.eye(3)  # the prior counts as one sample of each feature
        theta = np.linalg.solve(self._gram + ridge, self._moment + ridge @ self._prior)
        theta[0] = max(theta[0], 0.0)
        theta[1] = max(theta[1], 1e-4)  # at most 10M tokens/s: never free work
        theta[2] = max(theta[2], 0.0)
        return theta

    def speed(self, replica: ReplicaId) -> float:
        """Observed over predicted time of the replica's recent samples, shrunk toward 1."""
        s = self._speeds.get(replica)
        if s is None:
            return 1.0
        ratio = (s.observed + self.speed_prior_s) / (s.predicted + self.speed_prior_s)
        return min(4.0, max(0.25, ratio))

    def params(self, replica: ReplicaId) -> TTFTParams:
        overhead, per_k, per_busy = self._theta
        speed = self.speed(replica)
        return TTFTParams(tokens_per_s=_SCALE / (per_k * speed),
                          in_flight_cost_tokens=per_busy * _SCALE / per_k,
                          overhead_s=overhead * speed)

    def forget(self, replica: ReplicaId) -> None:
        self._speeds.pop(replica, None)
