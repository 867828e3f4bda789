"""Time to first token as a function of the work ahead, fitted online from observed first tokens.

    TTFT(r) = speed(r) * (overhead + work / P + busy * c / P)

`work` is the prefill queued on replica r plus the request's own uncached tokens, `busy` the
requests already running there (their decode steps share every engine step with the prefill).
`overhead`, `1/P` and `c/P` are one least-squares fit per pool, with recent samples weighted
most and a prior worth one sample. `speed(r)` is how much slower than predicted the replica's
recent first tokens came: the mean of their log ratios observed / predicted, each clipped to a
factor of 3 and shrunk toward 1 by a prior worth 5 samples, so a slower node or a noisy
neighbour shows after a few samples while one outlier moves it by 20% at most.

A replica's speed evidence also fades with time (`speed_half_life_s`), back toward the pool's
law. Without that, a replica that once measured slow is never chosen while the others are idle,
so it never gets the sample that would clear it: exploitation without exploration.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np

from router.index import ReplicaId

_SCALE = 1000.0  # work in thousands of tokens keeps the normal equations well conditioned


class TTFTParams(msgspec.Struct, frozen=True):
    """What a scorer needs for one replica; estimate = overhead_s + work_tokens / tokens_per_s."""

    tokens_per_s: float
    in_flight_cost_tokens: float
    overhead_s: float


@dataclass
class _Speed:
    log_ratio: float = 0.0  # decayed sum of clipped log(observed / predicted)
    weight: float = 0.0  # decayed number of samples
    at: float = 0.0  # when the last sample came


@dataclass
class TTFTModel:
    prior_tokens_per_s: float = 4000.0
    prior_in_flight_cost_tokens: float = 128.0
    prior_overhead_s: float = 0.02
    decay: float = 0.98  # weight of the previous samples at each new one (about 50 samples)
    speed_prior_samples: float = 5.0  # samples of "as predicted" each replica's speed starts with
    speed_clip: float = 3.0  # one sample counts as at most this many times slower or faster
    speed_half_life_s: float = 30.0  # a replica's speed evidence halves in weight this often
    clock: Callable[[], float] = time.monotonic
    samples: int = 0
    _gram: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)))
    _moment: np.ndarray = field(default_factory=lambda: np.zeros(3))
    _theta: tuple[float, float, float] = (0.0, 1.0, 0.0)  # floats: read per replica
    _speeds: dict[ReplicaId, _Speed] = field(default_factory=dict)

    def __post_init__(self) -> None:
        seconds_per_k = _SCALE / self.prior_tokens_per_s
        self._prior = np.array([self.prior_overhead_s, seconds_per_k,
                                self.prior_in_flight_cost_tokens / self.prior_tokens_per_s])
        self._theta = _floats(self._prior)

    def observe(self, replica: ReplicaId, work_tokens: int, busy: int, elapsed_s: float) -> None:
        """One first token: `work_tokens` had to be prefilled before it, beside `busy` others."""
        x = np.array([1.0, work_tokens / _SCALE, float(busy)])
        predicted = float(x @ np.array(self._theta))
        speed = self._speeds.setdefault(replica, _Speed())
        now = self.clock()
        fade = self.decay * self._fade(speed, now)
        clip = math.log(self.speed_clip)
        ratio = math.log(max(elapsed_s, 1e-6) / max(predicted, 1e-6))
        speed.log_ratio = fade * speed.log_ratio + min(clip, max(-clip, ratio))
        speed.weight = fade * speed.weight + 1.0
        speed.at = now
        self._gram = self.decay * self._gram + np.outer(x, x)
        self._moment = self.decay * self._moment + x * elapsed_s
        self.samples += 1
        self._theta = _floats(self._solve())

    def _solve(self) -> np.ndarray:
        ridge = np.eye(3)  # the prior counts as one sample of each feature
        theta = np.linalg.solve(self._gram + ridge, self._moment + ridge @ self._prior)
        theta[0] = max(theta[0], 0.0)
        theta[1] = max(theta[1], 1e-4)  # at most 10M tokens/s: never free work
        theta[2] = max(theta[2], 0.0)
        return theta

    def speed(self, replica: ReplicaId, now: float | None = None) -> float:
        """How many times slower than predicted the replica's recent first tokens came.

        Example (prior 5 samples, clip 3, half-life 30 s): one sample took 1.0 s where 0.15 s
        was predicted -> exp(log 3 / (1 + 5)) = 1.20 at once, exp(0.5 log 3 / (0.5 + 5)) = 1.105
        30 s later.
        """
        s = self._speeds.get(replica)
        if s is None:
            return 1.0
        fade = self._fade(s, self.clock() if now is None else now)
        return math.exp(fade * s.log_ratio / (fade * s.weight + self.speed_prior_samples))

    def _fade(self, speed: _Speed, now: float) -> float:
        return math.pow(0.5, max(0.0, now - speed.at) / self.speed_half_life_s)

    def params(self, replica: ReplicaId, now: float | None = None) -> TTFTParams:
        """The replica's law (`now`: the clock's reading, when the caller has it already)."""
        overhead, per_k, per_busy = self._theta
        speed = self.speed(replica, now)
        return TTFTParams(tokens_per_s=_SCALE / (per_k * speed),
                          in_flight_cost_tokens=per_busy * _SCALE / per_k,
                          overhead_s=overhead * speed)

    def forget(self, replica: ReplicaId) -> None:
        self._speeds.pop(replica, None)


def _floats(theta: np.ndarray) -> tuple[float, float, float]:
    overhead, per_k, per_busy = (float(x) for x in theta)
    return overhead, per_k, per_busy
