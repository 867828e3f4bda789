"""Ray Serve's autoscaling loop around a pool's policy, simulated: the policy itself is tokenfab's
own (`autoscaler.serve_policy`), called as Serve calls it.

Every `interval_s`, each ready replica reports its `ReplicaSignals` (what
`PoolReplica.record_autoscaling_stats` returns, from the simulated engine's windows). Serve averages
each metric per replica over `look_back_s` and hands the policy a context with them. The count it
returns is applied: new replicas start after the profile's start latency, and removed ones drain
(the newest first, those still starting before any).

`ServeDelays` wraps a policy whose answer Serve smooths with its own delays, as it does for
`ray_requests_policy`: up only after `upscale_delay_s` of wanting more, down only after
`downscale_delay_s` of wanting fewer.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import msgspec

from autoscaler.signals import ReplicaSignals
from sim.cluster import SimCluster
from sim.engine import SimEngine
from sim.loop import EventLoop

Policy = Callable[[Any], tuple[float, dict[str, Any]]]


def replica_signals(engine: SimEngine, now: float, held: int) -> ReplicaSignals:
    """What a pool replica reports to Serve, from its engine's last-10-s windows."""
    return ReplicaSignals(
        running=float(len(engine.running)), waiting=float(len(engine.waiting)),
        kv_cache_usage=engine.kv_usage(), ttft_p90_s=engine.ttft.p90(now),
        itl_p90_s=engine.itl.p90(now), prompt_tokens_per_s=engine.prompt_tokens.rate(now),
        generation_tokens_per_s=engine.generated_tokens.rate(now),
        queued_prompt_tokens=float(engine.queued_prompt_tokens()),
        prefill_capacity_tokens_per_s=engine.prefill_rate.p90(now),
        in_flight=float(engine.load()), held=float(held),
        arrivals=float(engine.arrivals))


@dataclass
class ServeDelays:
    """Serve's handling of a policy that returns a raw replica count (its default policy's delays,
    rounding and bounds)."""

    policy: Policy
    min_replicas: int
    max_replicas: int
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    _wanted_since: tuple[int, float] | None = None  # direction, since when

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        raw, state = self.policy(ctx)
        wanted = min(self.max_replicas, max(self.min_replicas, math.ceil(raw)))
        current = ctx.target_num_replicas
        direction = (wanted > current) - (wanted < current)
        if direction == 0:
            self._wanted_since = None
            return current, state
        if self._wanted_since is None or self._wanted_since[0] != direction:
            self._wanted_since = (direction, ctx.current_time)
        delay = self.upscale_delay_s if direction > 0 else self.downscale_delay_s
        if ctx.current_time - self._wanted_since[1] >= delay:
            self._wanted_since = None
            return wanted, state
        return current, state


@dataclass
class SimAutoscaler:
    loop: EventLoop
    cluster: SimCluster
    policy: Policy
    interval_s: float = 1.0
    look_back_s: float = 5.0
    until: float = math.inf
    decisions: list[tuple[float, int, int, str]] = field(default_factory=list)
    replica_seconds: float = 0.0
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (time, replicas held)
    _reports: dict[str, deque] = field(default_factory=dict)
    _state: dict[str, Any] = field(default_factory=dict)
    _last: float = 0.0

    def start(self) -> None:
        self._last = self.loop.now
        self.loop.after(self.interval_s, self._tick)

    def _tick(self) -> None:
        now, cluster = self.loop.now, self.cluster
        held = cluster.count("starting", "ready", "draining")
        self.replica_seconds += held * (now - self._last)
        self._last = now
        self.timeline.append((now, held))
        self._collect(now)
        ready = cluster.count("ready")
        target = cluster.count("starting", "ready")
        ctx = SimpleNamespace(
            policy_state=self._state, current_time=now, current_num_replicas=ready,
            target_num_replicas=target, aggregated_metrics=self._aggregated(now),
            raw_metrics=self._raw(),
            total_queued_requests=len(cluster.held) if ready else 0,
            total_num_requests=len(cluster.held))
        desired, self._state = self.policy(ctx)
        desired = int(math.ceil(desired))
        if desired != target:
            self.decisions.append((now, target, desired, str(self._state.get("reason", ""))))
        for _ in range(desired - target):
            cluster.add_replica()
        for _ in range(target - desired):
            cluster.drain_replica()
        if now < self.until:
            self.loop.after(self.interval_s, self._tick)

    def _collect(self, now: float) -> None:
        held = len(self.cluster.held)
        for name, replica in self.cluster.replicas.items():
            if replica.state != "ready":
                continue
            reports = self._reports.setdefault(name, deque())
            reports.append((now, msgspec.structs.asdict(
                replica_signals(replica.engine, now, held))))
        for name in [n for n in self._reports if n not in self.cluster.replicas]:
            del self._reports[name]

    def _aggregated(self, now: float) -> dict[str, dict[str, float]]:
        """{metric: {replica: mean over the look-back window}}, as Serve aggregates them."""
        out: dict[str, dict[str, float]] = {}
        for name, reports in self._reports.items():
            while reports and reports[0][0] < now - self.look_back_s:
                reports.popleft()
            if not reports or self.cluster.replicas[name].state != "ready":
                continue
            for metric in reports[0][1]:
                values = [r[metric] for _, r in reports]
                out.setdefault(metric, {})[name] = sum(values) / len(values)
        return out

    def _raw(self) -> dict[str, dict[str, list[SimpleNamespace]]]:
        """{metric: {replica: its reports in the look-back window}}, as Serve's raw_metrics."""
        out: dict[str, dict[str, list[SimpleNamespace]]] = {}
        for name, reports in self._reports.items():
            if not reports or self.cluster.replicas[name].state != "ready":
                continue
            for metric in reports[0][1]:
                out.setdefault(metric, {})[name] = [
                    SimpleNamespace(timestamp=at, value=r[metric]) for at, r in reports]
        return out
