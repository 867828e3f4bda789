"""The controller: Ray Serve runs this policy for every autoscaled pool, every `interval_s`.

Serve stays the one source of truth for replica counts: it collects each replica's signals
(`PoolReplica.record_autoscaling_stats`), calls `PoolPolicy`, applies the count it returns,
and drains a replica before stopping it (in-flight requests finish; see pools.deployment).
Each decision that changes the count, and the latest of each pool, is recorded: a log line in
the Serve controller's log, Ray metrics (`tokenfab_autoscaler_*`, exported by the Ray metrics
agent), and the application's replica registry, which `tokenfab status` reads.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from autoscaler.forecast import TREND_WINDOW_S, Arrivals, Plan, StartClock, forecast, level
from autoscaler.policy import Targets, decide
from autoscaler.records import DecisionSink, ScaleRecord, load_sink
from autoscaler.signals import pool_signals

logger = logging.getLogger("ray.serve").getChild("tokenfab.autoscaler")
_metrics: dict[str, Any] = {}


def _record(sink: DecisionSink, app: str, pool: str, current: int, desired: int, reason: str,
            targets: Targets, state: dict[str, Any]) -> None:
    import ray

    if not ray.is_initialized():  # outside a cluster (unit tests): the log line is the record
        return
    try:
        from ray.util import metrics

        if not _metrics:
            _metrics["decisions"] = metrics.Counter(
                "tokenfab_autoscaler_decisions", "Replica count changes, by direction",
                tag_keys=("app", "pool", "direction"))
            _metrics["desired"] = metrics.Gauge(
                "tokenfab_autoscaler_desired_replicas", "Replicas the policy asks for",
                tag_keys=("app", "pool"))
        _metrics["desired"].set(desired, tags={"app": app, "pool": pool})
        if desired != current:
            direction = "up" if desired > current else "down"
            _metrics["decisions"].inc(tags={"app": app, "pool": pool, "direction": direction})
        sink(app, ScaleRecord(
            pool=pool, current=current, desired=desired, reason=reason, at=time.time(),
            min_replicas=targets.min_replicas, max_replicas=targets.max_replicas,
            ttft_p90_s=targets.ttft_p90_s, itl_p90_s=targets.itl_p90_s,
            last_change=state.get("last_change", ""),
            last_change_at=state.get("last_change_at", 0.0)))
    except Exception:  # noqa: BLE001 - bookkeeping must never stop scaling
        logger.exception("could not record the autoscaling decision of pool %s", pool)


def held_requests(ctx: Any, signals: Any) -> float:
    """Requests waiting for a replica of the pool outside any engine: those gateways hold (all
    replicas full, as the replicas heard from the gateways) and Serve's handle queue (with no
    replica at all, the gateways' wake-up calls wait there)."""
    current = ctx.current_num_replicas
    queued = (ctx.total_queued_requests if current else ctx.total_num_requests) or 0
    return float(queued) + signals.held


class PoolPolicy:
    """Serve's custom autoscaling policy for one pool. Serve builds it once with the
    `policy_kwargs` (app, pool, the import path of the decision sink, and the fields of
    Targets) and calls it every interval."""

    def __init__(self, app: str, pool: str, sink: str = "", **targets: Any) -> None:
        self.app, self.pool, self.targets = app, pool, Targets(**targets)
        self._sink = load_sink(sink) if sink else (lambda app, record: None)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        t, pool = self.targets, self.pool
        state = dict(ctx.policy_state or {})
        now = ctx.current_time if ctx.current_time is not None else time.time()
        current = ctx.current_num_replicas
        signals = pool_signals(ctx.aggregated_metrics or {}, current)
        held = held_requests(ctx, signals)
        if held > 0:
            signals = msgspec.structs.replace(signals, waiting=signals.waiting + held)
        plan = self._plan(ctx, state, now)
        decision = decide(signals, t, current, now, state.get("calm_since"),
                          state.get("idle_since"), plan)
        desired = decision.replicas
        if ctx.target_num_replicas > current and desired >= current:
            desired = max(desired, ctx.target_num_replicas)  # never cancel replicas starting
        changed = desired != state.get("desired", current)
        if changed:  # Serve asks every ~0.1 s: a line per new decision, not per question
            logger.info("pool %s: %d -> %d replicas (%s); ongoing %.1f, waiting %.1f, KV %.2f, "
                        "queued prompt tokens %.0f, TTFT p90 %.2fs, ITL p90 %.3fs", pool, current,
                        desired, decision.reason, signals.ongoing, signals.waiting,
                        signals.kv_cache_usage, signals.queued_prompt_tokens,
                        signals.ttft_p90_s, signals.itl_p90_s)
            state.update(last_change=f"{current} -> {desired}: {decision.reason}",
                         last_change_at=now)
        if changed or now - state.get("recorded_at", 0.0) >= 5.0:
            _record(self._sink, self.app, pool, current, desired, decision.reason, t, state)
            state["recorded_at"] = now
        state["desired"] = desired
        state.update(calm_since=decision.calm_since, idle_since=decision.idle_since,
                     reason=decision.reason)
        return desired, state

    def _plan(self, ctx: Any, state: dict[str, Any], now: float) -> Plan | None:
        """The pool's forecast (autoscaler.forecast), kept in the policy state: the arrival
        counters, the rates, the recent levels and the replicas' measured start time."""
        t = self.targets
        if t.capacity_rps <= 0:
            return None
        current, target = ctx.current_num_replicas, ctx.target_num_replicas
        clock = state.get("start_clock") or StartClock(t.replica_start_s, ready=current)
        clock.observe(now, current, target)
        arrivals = state.get("arrivals") or Arrivals()
        keep = max(TREND_WINDOW_S, t.downscale_delay_s)
        rates = [(at, r) for at, r in state.get("rates", ()) if at > now - keep]
        rate = arrivals.sample(now, arrival_counters(ctx))
        if rate is not None:
            rates.append((now, rate))
        levels = [(at, r) for at, r in state.get("levels", ()) if at > now - t.downscale_delay_s]
        levels.append((now, level(rates)))
        state.update(start_clock=clock, arrivals=arrivals, rates=rates, levels=levels)
        return Plan(rate=levels[-1][1],
                    forecast=forecast(rates, clock.start_s, t.rise_rps_per_s),
                    horizon_s=clock.start_s, peak_rate=max(r for _, r in levels),
                    spare_rate=t.rise_rps_per_s * clock.start_s)


def arrival_counters(ctx: Any) -> dict[str, float]:
    """Each running replica's latest arrival counter: its newest raw report (Serve's mean over
    the look-back window would blur the counter's steps)."""
    raw = (ctx.raw_metrics or {}).get("arrivals") or {}
    return {str(replica): max(series, key=lambda v: v.timestamp).value
            for replica, series in raw.items() if series}


def ray_requests_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Ray Serve's default policy (`replica_queue_length_autoscaling_policy`) on the requests
    tokenfab counts, for comparisons: Serve cannot count them itself, since they reach replicas
    over the data channel. Desired = ongoing requests / target_ongoing_requests; Serve applies
    its own delays, rounding and bounds around it, exactly as for its default policy.

    Example: 2 replicas with 7 and 5 requests in flight, 3 held, target 2 -> 7.5 (Serve: 8).
    """
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    signals = pool_signals(ctx.aggregated_metrics or {}, ctx.current_num_replicas)
    ongoing = signals.in_flight + held_requests(ctx, signals)
    return ongoing / ctx.config.get_target_ongoing_requests(), {}
