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
A pool of a disaggregated pair is profiled the same way beside a strong pool of the other role
(`sweep_pd`), in its own arrivals and requests.

Example: points at 0.5, 0.75 and 1.0 req/s per replica with TTFT p90 0.4, 1.1 and 6.0 s against
a 3 s target: the capacity is 0.75 req/s per replica.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from autoscaler.signals import PoolSignals, pool_signals
from sim.autoscale import replica_signals
from sim.cluster import SimCluster
from sim.engine import SimRequest
from sim.loop import EventLoop
from sim.params import EngineParams
from sim.pd import PREFILL, SimPDCluster
from tokenfab.stats import percentile

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
    signals = _watch(loop, sim, replicas, seconds)
    loop.run()
    done = [r for r in requests if r.first_token is not None and r.finished is not None]
    in_flight = sum(r.finished - r.arrival for r in done) / seconds / replicas
    return _point(rate_per_replica, signals, requests, in_flight)


def measure_pd(params: EngineParams, make: MakeLoad, rate_per_replica: float, role: str,
               replicas: int, other: int, seconds: float, policy: str = "kv_aware",
               max_ongoing_requests: int = 64, **pd: float) -> Point:
    """One pool of a disaggregated pair (`role`, `replicas` of it) beside `other` replicas of
    the other pool, offered `rate_per_replica` x `replicas` requests/s. The point's rate and
    requests in flight are the pool's own (its engines' arrivals; from each of its requests'
    arrival at an engine to its end), its signals its own replicas'; the requests' latencies
    are end to end."""
    loop = EventLoop()
    prefill, decode = (replicas, other) if role == PREFILL else (other, replicas)
    sim = SimPDCluster(loop, params, policy, prefill, decode,
                       max_ongoing_requests=max_ongoing_requests, **pd)
    pool = sim.prefill if role == PREFILL else sim.decode
    requests = make(rate_per_replica * replicas, seconds)
    sim.submit(requests)
    signals = _watch(loop, pool, replicas, seconds)
    loop.run()
    arrivals = sum(r.engine.arrivals for r in pool.replicas.values())
    in_flight = sum(r.finished - r.engine_arrival for r in pool.finished) / seconds / replicas
    return _point(arrivals / seconds / replicas, signals, requests, in_flight)


def _watch(loop: EventLoop, pool: SimCluster, replicas: int,
           seconds: float) -> list[PoolSignals]:
    """The pool's signals every second until `seconds`, as the autoscaler would read them."""
    seen: list[PoolSignals] = []

    def tick() -> None:
        per_metric: dict[str, dict[str, float]] = {}
        for name, replica in pool.replicas.items():
            report = msgspec.structs.asdict(replica_signals(replica.engine, loop.now, 0))
            for metric, value in report.items():
                per_metric.setdefault(metric, {})[name] = value
        seen.append(pool_signals(per_metric, replicas))
        if loop.now < seconds:
            loop.after(1.0, tick)

    loop.after(1.0, tick)
    return seen


def _point(rate_per_replica: float, signals: list[PoolSignals], requests: list[SimRequest],
           in_flight: float) -> Point:
    done = [r for r in requests if r.first_token is not None and r.finished is not None]
    ttft = [r.first_token - r.arrival for r in done]
    itl = [r.itl_sum_s / r.itl_count for r in done if r.itl_count]
    return Point(rate_per_replica, _p90([s.ttft_p90_s for s in signals]),
                 _p90([s.itl_p90_s for s in signals]), _p90(ttft), _p90(itl), in_flight,
                 len(done))


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
    return _sweep(lambda rate: measure(params, make, rate, replicas, seconds, policy,
                                       max_ongoing_requests), rates, ttft_p90_s, itl_p90_s)


def sweep_pd(params: EngineParams, make: MakeLoad, rates: Sequence[float], ttft_p90_s: float,
             itl_p90_s: float, role: str, replicas: int = 4, other: int = 16,
             seconds: float = 300.0, policy: str = "kv_aware", max_ongoing_requests: int = 64,
             **pd: float) -> Capacity:
    """`sweep` for one pool of a disaggregated pair, the other pool `other` replicas strong:
    `rates` are offered requests/s per replica of the pool; the capacity is in the pool's own
    arrivals (a prefill pool gets only the prompts that take a prefill leg). Where the other
    pool limits a point after all (a decode pool's high rates behind a prefill pool at its
    own capacity), the pool's arrivals fall short of what was offered, and the sweep can end
    within the targets: its capacity is then a lower bound."""
    return _sweep(lambda rate: measure_pd(params, make, rate, role, replicas, other, seconds,
                                          policy, max_ongoing_requests, **pd),
                  rates, ttft_p90_s, itl_p90_s)


def _sweep(measure_at: Callable[[float], Point], rates: Sequence[float], ttft_p90_s: float,
           itl_p90_s: float) -> Capacity:
    points = []
    for rate in sorted(rates):
        points.append(measure_at(rate))
        if points[-1].ttft_p90_s > ttft_p90_s or points[-1].itl_p90_s > itl_p90_s:
            break
    return capacity(points, ttft_p90_s, itl_p90_s)


def _p90(values: list[float]) -> float:
    return percentile(values, 90) if values else float("nan")
