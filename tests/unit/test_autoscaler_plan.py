"""The planning autoscaler: arrival counters into rates, trends told from steps and noise, the
measured start time, and the plan's asks up and down (exact counts, no flapping)."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from autoscaler.forecast import Arrivals, Plan, StartClock, forecast, level, slope, trend
from autoscaler.policy import Targets, decide, planned
from autoscaler.signals import PoolSignals

PLANNED = Targets(role="unified", min_replicas=2, max_replicas=64, ttft_p90_s=3.0, itl_p90_s=0.1,
                  target_ongoing=4, downscale_delay_s=30, capacity_rps=1.0, headroom=0.2,
                  replica_start_s=60)


def poisson_rates(rate_at, seconds: int, seed: int = 0) -> list[tuple[float, float]]:
    """One sample per second: the count of a Poisson process over that second."""
    rng = random.Random(seed)
    out = []
    for t in range(1, seconds + 1):
        lam, count, clock = rate_at(t), 0, rng.expovariate(1.0)
        while lam > 0 and clock < lam:
            count += 1
            clock += rng.expovariate(1.0)
        out.append((float(t), float(count)))
    return out


def test_arrival_counters_become_the_pools_rate_as_replicas_come_and_go() -> None:
    arrivals = Arrivals()
    assert arrivals.sample(0.0, {"a": 100, "b": 50}) is None  # a first look: no interval yet
    assert arrivals.sample(2.0, {"a": 110, "b": 56}) == 8.0  # 16 requests in 2 s
    # b left (drained), c is new: neither bends the rate; a took 9 more in 1 s
    assert arrivals.sample(3.0, {"a": 119, "c": 30}) == 9.0
    assert arrivals.sample(4.0, {"a": 120, "c": 33}) == 4.0


def test_slope_and_its_error() -> None:
    assert slope([(float(t), 2.0 * t + 1) for t in range(10)]) == (pytest.approx(2.0), 0.0)
    assert slope([(0.0, 1.0), (1.0, 2.0)]) == (0.0, math.inf)  # too few to tell


def test_noise_around_a_steady_rate_is_no_trend() -> None:
    """500 s of Poisson noise at 8 req/s, seen every second: never a trend."""
    samples = poisson_rates(lambda t: 8.0, 500, seed=3)
    for end in range(60, 500):
        assert trend(samples[:end]) == 0.0
    assert level(samples) == pytest.approx(8.0, abs=2.5)


def test_a_ramp_is_a_trend_and_a_step_is_not() -> None:
    ramp = poisson_rates(lambda t: 10.0 + 0.2 * t, 180, seed=1)  # +0.2 req/s every second
    _, error = slope(ramp[-120:])
    assert abs(trend(ramp) - 0.2) < 3 * error  # the true slope, within the noise
    # the forecast 90 s ahead: the level now (about 45) plus about 18
    assert forecast(ramp, 90.0) == pytest.approx(45.0 + 18.0, abs=3 * error * 90 + 5)
    for at in range(1, 121, 7):  # a step anywhere in the window is no trend
        step = poisson_rates(lambda t: 8.0 if t < 200 - at else 45.0, 200, seed=at)
        assert trend(step) == 0.0, at
    assert forecast(step, 90.0) == pytest.approx(45.0, abs=5.0)  # the level already shows it


def test_too_little_history_is_no_trend() -> None:
    assert trend([(float(t), float(t)) for t in range(1, 100)]) == 0.0  # 100 s < the window


def test_start_clock_matches_each_ask_with_its_replica() -> None:
    clock = StartClock(60.0, ready=2, target=2)
    clock.observe(0.0, ready=2, target=4)  # 2 asked at 0
    clock.observe(5.0, ready=2, target=6)  # 2 more at 5
    clock.observe(40.0, ready=4, target=6)  # the first two: 40 s each
    assert clock.start_s == pytest.approx(60 * 0.7 ** 2 + 40 * (1 - 0.7 ** 2))
    before = clock.start_s
    clock.observe(45.0, ready=6, target=6)  # the next two: 40 s each too (asked at 5)
    assert clock.start_s == pytest.approx(before * 0.7 ** 2 + 40 * (1 - 0.7 ** 2))
    assert clock.asked == []
    clock.observe(50.0, ready=6, target=8)
    clock.observe(51.0, ready=6, target=7)  # one ask withdrawn
    assert clock.asked == [50.0]


def plan(rate: float, expected: float | None = None, peak: float | None = None) -> Plan:
    return Plan(rate=rate, forecast=rate if expected is None else expected, horizon_s=60.0,
                peak_rate=rate if peak is None else peak)


def test_planned_replicas_cover_the_forecast_with_headroom() -> None:
    assert planned(8.0, PLANNED) == 10  # 8 x 1.2 / 1.0 = 9.6
    assert planned(10.0, PLANNED) == 12  # exactly 12: no extra replica for rounding noise
    d = decide(PoolSignals(replicas=4, running=8), PLANNED, 4, now=0.0,
               plan=plan(8.0, expected=20.0))
    assert d.replicas == 24 and d.reason.startswith("plan: 8.0 req/s now, 20.0 expected in 60s")


def test_the_plan_comes_down_in_one_step_to_its_recent_peak() -> None:
    """After a burst: 40 replicas, 8 req/s, calm. The highest rate over the delay was 9 req/s,
    so after 30 calm seconds the pool goes at once to ceil(9 x 1.2 x 1.2) = 13, not one replica
    per delay."""
    calm = PoolSignals(replicas=40, running=20, ttft_p90_s=1.0, itl_p90_s=0.02)
    d = decide(calm, PLANNED, 40, now=0.0, plan=plan(8.0, peak=9.0))
    assert d.replicas == 40 and d.calm_since == 0.0
    d = decide(calm, PLANNED, 40, now=30.0, calm_since=d.calm_since, plan=plan(8.0, peak=9.0))
    assert d.replicas == 13 and "load fits 13" in d.reason
    # up needs 1.2 x rate > 13: a rate above 10.8 req/s, 20% over the recent peak
    assert decide(calm, PLANNED, 13, now=31.0, plan=plan(10.8)).replicas == 13
    assert decide(calm, PLANNED, 13, now=31.0, plan=plan(11.0)).replicas == 14
    # the requests in flight need more than the plan's peak: it comes down only to theirs
    busy = PoolSignals(replicas=40, running=60, ttft_p90_s=1.0, itl_p90_s=0.02)
    d = decide(busy, PLANNED, 40, now=30.0, calm_since=0.0, plan=plan(8.0, peak=9.0))
    assert d.replicas == 15  # 60 ongoing / 4 per replica
    # a latency near its target holds the pool where it is
    slow = PoolSignals(replicas=40, running=20, ttft_p90_s=2.9, itl_p90_s=0.02)
    assert decide(slow, PLANNED, 40, now=30.0, calm_since=0.0,
                  plan=plan(8.0, peak=9.0)).replicas == 40


def test_a_declared_rise_is_kept_in_hand_and_a_steeper_trend_wins() -> None:
    steady = poisson_rates(lambda t: 8.0, 180, seed=3)
    assert trend(steady) == 0.0
    # no trend: the rate now plus the declared rise over the 90 s start
    assert forecast(steady, 90.0, rise=0.12) == pytest.approx(level(steady) + 10.8)
    ramp = poisson_rates(lambda t: 10.0 + 0.2 * t, 180, seed=1)
    assert forecast(ramp, 90.0, rise=0.12) == forecast(ramp, 90.0)  # the trend is steeper
    # up sizes for 8 + 10.8 req/s; down keeps the same spare over the recent peak, so a pool
    # at the planned size stays there (no flapping between the two)
    risen = Targets(**{f: getattr(PLANNED, f) for f in PLANNED.__struct_fields__}
                    | {"rise_rps_per_s": 0.12})
    ahead = Plan(rate=8.0, forecast=18.8, horizon_s=90.0, peak_rate=8.0, spare_rate=10.8)
    calm = PoolSignals(replicas=13, running=20, ttft_p90_s=1.0, itl_p90_s=0.02)
    assert decide(calm, risen, 13, now=0.0, plan=ahead).replicas == 23  # ceil(18.8 x 1.2)
    held = decide(calm, risen, 23, now=60.0, calm_since=0.0, plan=ahead)  # calm a minute
    assert (held.replicas, held.reason) == (23, "within targets")  # down keeps >= 25
    # after a burst it comes down to the peak's needs plus the spare, not below
    d = decide(calm, risen, 40, now=30.0, calm_since=0.0,
               plan=Plan(rate=8.0, forecast=18.8, horizon_s=90.0, peak_rate=9.0,
                         spare_rate=10.8))
    assert d.replicas == 26  # ceil((9 x 1.2 + 10.8) x 1.2) = ceil(25.92)


def test_a_planned_pool_does_not_flap_under_noisy_steady_load() -> None:
    """Poisson arrivals at 8 req/s for 20 minutes through PoolPolicy: after reaching its size,
    the pool never changes it."""
    from autoscaler.serve_policy import PoolPolicy

    policy = PoolPolicy(app="a", pool="main", **{f: getattr(PLANNED, f)
                                                    for f in PLANNED.__struct_fields__})
    rng, counter, state, current, history = random.Random(7), 0.0, {}, 10, []
    for second in range(1, 1200):
        counter += sum(1 for _ in range(80) if rng.random() < 0.1)  # about 8 per second
        metrics = {"arrivals": {"r0": counter}, "running": {"r0": 8 + rng.uniform(-2, 2)},
                   "ttft_p90_s": {"r0": 1.0}, "itl_p90_s": {"r0": 0.03}}
        raw = {"arrivals": {"r0": [SimpleNamespace(timestamp=second - 0.5, value=counter - 1),
                                   SimpleNamespace(timestamp=float(second), value=counter)]}}
        ctx = SimpleNamespace(policy_state=state, current_time=float(second),
                              current_num_replicas=current, target_num_replicas=current,
                              aggregated_metrics=metrics, raw_metrics=raw, total_num_requests=0,
                              total_queued_requests=0)
        current, state = policy(ctx)
        history.append(current)
    ups = [i for i in range(121, len(history)) if history[i] > history[i - 1]]
    changes = [i for i in range(121, len(history)) if history[i] != history[i - 1]]
    assert not ups and len(changes) <= 2, (ups, changes)  # settles: at most a step down or two
    assert 10 <= history[-1] <= 14
