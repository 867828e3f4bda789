"""Where a pool's load is heading, for a policy that must act a replica's start time ahead.

A replica asked for now serves only after it starts (model load, warm-up: 40 s on this machine,
minutes on a GPU node). A policy that waits for latency to rise is a start time late; the plan
sizes the pool for the arrival rate expected when the replicas it asks for are ready.

- **Rate.** Each replica counts the requests it takes (`ReplicaSignals.arrivals`); the policy
  sums the counters' increases between two decisions (`Arrivals`). Those samples are
  independent (Poisson counts over disjoint intervals), so their noise is measured, not guessed,
  and replicas that come and go do not bend the sum as windowed rates would (a new replica's
  window starts empty). The rate now is the mean of the last `LEVEL_S` of samples.
- **Trend.** The least-squares slope of the last `TREND_WINDOW_S`, when it stands
  `SIGNIFICANCE` standard errors above zero and each half of the window rises at least half as
  fast on its own. A step (flat, jump, flat) fits a steep line over the window, but neither half
  rises: extrapolating it would order replicas for a rise that is already over. Noise around a
  steady rate gives no trend, so it never inflates a steady pool.
  Example: the rate grew smoothly from 10 to 34 req/s over the last 120 s, 0.2 req/s per s in
  each half; with a 90 s start time the forecast is 34 + 0.2 x 90 = 52 req/s.
- **A declared rise** (`rise_rps_per_s`, 0 unless the topology sets one). No trend shows in the
  first minute of a rise, and a replica asked for then serves a start time later: a pool held at
  what the rate now needs is short for the whole of that start. Where its users know how fast
  their traffic can rise, the plan keeps that rise over one start time in hand: it sizes for
  the rate now plus `max(trend, rise_rps_per_s) x start time`, in quiet phases too. The spare
  capacity grows with the measured start time, as the rise it must cover does.
  Example: 8 req/s, no trend, rises of up to 0.12 req/s per s, 90 s start time: the pool is
  sized for 8 + 0.12 x 90 = 18.8 req/s (with the headroom, 23 replicas of 1 req/s).
- **Start time.** Measured (`StartClock`): each replica asked for is matched, first asked first
  ready, with the decision that sees it ready; a moving average, the topology's
  `replica_start_s` until the first one.
- **Down.** To what the highest rate of the last `downscale_delay_s` needs with the headroom
  counted twice (as the Kubernetes HPA stabilises scale-down on its recent peak). Up asks for
  headroom once: between the two lies a band of one headroom, so noise around a steady rate
  does not flap the pool.
  Example: headroom 0.2, 1 req/s per replica, rates of 8 to 9.4 req/s over the last 30 s: up
  when 1.2 x rate > replicas, down to ceil(9.4 x 1.44) = 14 replicas at most.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import msgspec

LEVEL_S = 10.0
TREND_WINDOW_S = 120.0  # two halves of a minute: a rise must last about two minutes to count
SIGNIFICANCE = 4.0  # a trend counts when the slope is this many standard errors above zero
# (a policy asks every second: at 3, 20 minutes of steady Poisson arrivals showed a false trend)
START_SMOOTHING = 0.3  # weight of the newest start-time measurement

Samples = Sequence[tuple[float, float]]  # (time, requests/s over the interval ending then)


class Plan(msgspec.Struct, frozen=True):
    """What the policy expects: the arrival rate now, and when new replicas would be ready."""

    rate: float  # requests/s now
    forecast: float  # requests/s expected `horizon_s` from now
    horizon_s: float  # a replica's start time
    peak_rate: float = 0.0  # the highest rate over the scale-down delay
    spare_rate: float = 0.0  # the declared rise over `horizon_s`, held in hand at all times


class Arrivals(msgspec.Struct):
    """Turns replicas' arrival counters into the pool's rate between two decisions."""

    counters: dict[str, float] = {}
    at: float | None = None

    def sample(self, now: float, counters: Mapping[str, float]) -> float | None:
        """Requests/s since the previous call, summed over replicas seen both times (None on
        the first call)."""
        rate = None
        if self.at is not None and now > self.at:
            grown = sum(max(0.0, value - self.counters[name])
                        for name, value in counters.items() if name in self.counters)
            rate = grown / (now - self.at)
        self.counters, self.at = dict(counters), now
        return rate


def slope(samples: Samples) -> tuple[float, float]:
    """Least-squares slope of (time, value) samples and its standard error ((0, inf) when there
    are too few samples to tell)."""
    n = len(samples)
    if n < 4:
        return 0.0, math.inf
    mean_t = sum(t for t, _ in samples) / n
    mean_v = sum(v for _, v in samples) / n
    sxx = sum((t - mean_t) ** 2 for t, _ in samples)
    if sxx <= 0:
        return 0.0, math.inf
    b = sum((t - mean_t) * (v - mean_v) for t, v in samples) / sxx
    residual = sum((v - mean_v - b * (t - mean_t)) ** 2 for t, v in samples)
    return b, math.sqrt(residual / (n - 2) / sxx)


def level(samples: Samples) -> float:
    """The rate now: the mean of the last LEVEL_S of samples."""
    if not samples:
        return 0.0
    now = samples[-1][0]
    recent = [v for t, v in samples if t > now - LEVEL_S]
    return sum(recent) / len(recent)


def trend(samples: Samples) -> float:
    """Requests/s per second the rate keeps rising by, or 0 (see the module docstring)."""
    if not samples:
        return 0.0
    now = samples[-1][0]
    window = [(t, v) for t, v in samples if t > now - TREND_WINDOW_S]
    if not window or window[0][0] > now - 0.9 * TREND_WINDOW_S:
        return 0.0  # not enough history yet to tell a trend from a step
    middle = now - TREND_WINDOW_S / 2
    whole, error = slope(window)
    first, _ = slope([(t, v) for t, v in window if t <= middle])
    second, _ = slope([(t, v) for t, v in window if t > middle])
    if whole <= SIGNIFICANCE * error or min(first, second) < whole / 2:
        return 0.0
    return whole


def forecast(samples: Samples, horizon_s: float, rise: float = 0.0) -> float:
    """The rate expected `horizon_s` after the last sample (never below the rate now: a falling
    rate lowers the pool only through the scale-down delay), rising at least by the declared
    `rise` (requests/s per second) meanwhile."""
    return level(samples) + max(trend(samples), rise) * horizon_s


class StartClock(msgspec.Struct):
    """How long new replicas take to serve, measured: each replica the pool's target rose by is
    matched, first asked first ready, with the decision that sees the ready count rise."""

    start_s: float  # the current estimate
    asked: list[float] = []  # when each replica still starting was asked for
    ready: int = 0
    target: int = 0

    def observe(self, now: float, ready: int, target: int) -> None:
        if target > self.target:
            self.asked += [now] * (target - max(self.target, ready))
        for _ in range(min(len(self.asked), max(0, ready - self.ready))):
            seconds = now - self.asked.pop(0)
            self.start_s = (1 - START_SMOOTHING) * self.start_s + START_SMOOTHING * seconds
        del self.asked[max(0, target - ready):]  # withdrawn asks
        self.ready, self.target = ready, target
