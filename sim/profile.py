"""A pool's latency as a function of its load, profiled offline: the planning autoscaler's
capacity (`capacity_rps`), as NVIDIA Dynamo's SLA planner profiles an engine before it plans.

A small pool of simulated engines (the profile's step law, tokenfab's router) serves the
workload's requests at a sweep of arrival rates per replica. Each point records the latencies as
the autoscaler sees them: every second, the pool's TTFT and ITL signals (`pool_signals` over the
replicas' `ReplicaSignals`), and their p90 over the run. The capacity is the highest rate per
replica at which the point and every lower one keep both signals within the targets 90% of the
time, so the plan never sizes a pool that the latency rules would then find too small; the
requests in flight there (Little's law) are what one replica serves within them
(`target_ongoing`). The requests' own TTFT and mean inter-token gap p90s are recorded beside.

Example: points at 0.5, 0.75 and 1.0 req/s per replica with TTFT p90 0.4, 1.1 and 6.0 s against
a 3 s target: the capacity is 0.75 req/s per replica.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from autoscaler.signals import PoolSignals, pool_signals
from sim.autoscale import replica_signals
from sim.cluster import SimCluster
from sim.engine import SimRequest
from sim.loop import EventLoop
from sim.params import EngineParams

MakeLoad = Callable[[float, float], list[SimRequest]]  # (requests/s, seconds) -> requests


class Point(msgspec.Struct, frozen=True):
    rate_per_replica: float
    ttft_p90_s: float  # the pool's TTFT signal, its p90 over the run's seconds
    itl_p90_s: float  # the pool's ITL signal (requests' mean gaps), its p90 over the seconds
    request_ttft_p90_s: float  # the requests' own
    request_itl_p90_s: float
    ongoing_per_replica: float  # requests in flight, on average (Little's law)
    requests: int


class Capacity(msgspec.Struct, frozen=True):
    rate_per_replica: float  # 0 when even the lowest rate misses a target
    ongoing_per_replica: float
    points: list[Point]


def measure(params: EngineParams, make: MakeLoad, rate_per_replica: float, replicas: int,
            seconds: float, policy: str = "kv_aware", max_ongoing_requests: int = 64) -> Point:
    loop = EventLoop()
    sim = SimCluster(loop, params, policy, replicas, max_ongoing_requests=max_ongoing_requests)
    requests = make(rate_per_replica * replicas, seconds)
    sim.submit(requests)
    seen: list[PoolSignals] = []

    def tick() -> None:
        per_metric: dict[str, dict[str, float]] = {}
        for name, replica in sim.replicas.items():
            report = msgspec.structs.asdict(replica_signals(replica.engine, loop.now, 0))
            for metric, value in report.items():
                per_metric.setdefault(metric, {})[name] = value
        seen.append(pool_signals(per_metric, replicas))
        if loop.now < seconds:
            loop.after(1.0, tick)

    loop.after(1.0, tick)
    loop.run()
    done = [r for r in requests if r.first_token is not None and r.finished is not None]
    ttft = [r.first_token - r.arrival for r in done]
    itl = [r.itl_sum_s / r.itl_count for r in done if r.itl_count]
    in_flight = sum(r.finished - r.arrival for r in done) / seconds / replicas
    return Point(rate_per_replica, _p90([s.ttft_p90_s for s in seen]),
                 _p90([s.itl_p90_s for s in seen]), _p90(ttft), _p90(itl), in_flight, len(done))


def capacity(points: Sequence[Point], ttft_p90_s: float, itl_p90_s: float) -> Capacity:
    """The highest rate per replica at which it and every lower point meet both targets."""
    best: Point | None = None
    for point in sorted(points, key=lambda p: p.rate_per_replica):
        if point.ttft_p90_s > ttft_p90_s or point.itl_p90_s > itl_p90_s:
            break
        best = point
    return Capacity(best.rate_per_replica if best else 0.0,
                    best.ongoing_per_replica if best else 0.0, list(points))


def sweep(params: EngineParams, make: MakeLoad, rates: Sequence[float], ttft_p90_s: float,
          itl_p90_s: float, replicas: int = 4, seconds: float = 300.0,
          policy: str = "kv_aware", max_ongoing_requests: int = 64) -> Capacity:
    """Measure each rate per replica in turn, stopping after the first that misses a target."""
    points = []
    for rate in sorted(rates):
        points.append(measure(params, make, rate, replicas, seconds, policy,
                              max_ongoing_requests))
        if points[-1].ttft_p90_s > ttft_p90_s or points[-1].itl_p90_s > itl_p90_s:
            break
    return capacity(points, ttft_p90_s, itl_p90_s)


def _p90(values: list[float]) -> float:
    return float(np.percentile(values, 90)) if values else float("nan")
