"""How many replicas a pool needs: a pure function of its signals, its targets and the time.

Scaling up is fast and proportional; scaling down is slow, one replica at a time, and only after
the pool has been calm for a while. Between the two thresholds nothing moves, so noise around a
steady load never flaps the pool.

Up, when any of these asks for more than the running replicas (the largest ask wins):

- load: `ceil(ongoing / target_ongoing)` replicas, where ongoing = running + waiting requests
  and `target_ongoing` is what one replica serves within its latency targets (capacity sizing).
  Example: 19 ongoing requests, target_ongoing 8 -> 3 replicas.
- burst: waiting requests above `max_waiting_per_replica` x replicas mean the engines' queues grow
  faster than they drain; the queue asks for `ceil(waiting / target_ongoing)` more replicas at
  once, before the latency of the queued requests shows it.
  Example: 1 replica, 2 running, 9 waiting, limit 4 per replica -> 1 + ceil(9 / 8) = 3.
- backlog (prefill and unified pools, two or more requests per replica): the prompt tokens
  queued for prefill, at the measured prefill capacity of a replica, take longer to drain than
  the TTFT target; the pool asks for the replicas that would clear them within it,
  `ceil(queued / (capacity x ttft_target))`.
  This is capacity sizing in tokens: it sees a burst of long prompts when it arrives, before any
  of them has a first token to measure, and it sees ten long prompts as more than ten short ones.
  Example: 1 replica that prefills 20,000 tokens/s, 90,000 prompt tokens queued, TTFT target
  2 s: draining takes 4.5 s > 2 s, so ceil(90,000 / 40,000) = 3 replicas.
- latency: a p90 above its target (TTFT for prefill and unified pools, inter-token latency for
  decode and unified pools) asks for `ceil(replicas x p90 / target)`, when the pool has two or
  more requests per replica: below that the latency is about the engine's floor (a request
  alone, or nearly), which more replicas would not lower.
  Example: 2 decode replicas with 4 requests, ITL p90 0.3 s against 0.2 s -> ceil(2 x 1.5) = 3;
  the same ITL with 3 requests in the pool asks for nothing.
- KV: the fullest replica above `max_kv_usage` asks for one more.
- plan (with `capacity_rps`, the requests/s one replica serves within the targets, profiled
  offline by `python -m sim capacity`): the arrival rate expected one replica start from now
  (autoscaler/forecast.py) needs `ceil(rate x (1 + headroom) / capacity_rps)` replicas. The other
  asks see load that has arrived; this one orders the replicas a rising rate will need by the
  time they can serve.
  Example: 8 req/s now, rising 0.1 req/s each second for two minutes, start time 90 s,
  capacity 1 req/s, headroom 0.2: ceil((8 + 9) x 1.2 / 1) = 21 replicas.

Down, by one replica, when for `downscale_delay_s` the load would fit one replica fewer with
`scale_down_margin` to spare (ongoing, KV usage and the backlog's drain time each under the
margin's share of their target, no request waiting) and the latency p90s stayed under
`LATENCY_CALM` of their targets; the calm clock then restarts, so each further step waits as
long again. Latency has its own, softer bar: an engine's floor latency may sit above half the
target, and a pool must still come down when its load is gone. Where one replica fewer would
still give every request an engine of its own (ongoing <= replicas - 1), latency does not count
at all: a request alone gets the floor, however many replicas stand idle (the same reason as
"two or more requests per replica" for going up).
Example: margin 0.5, target_ongoing 8, 3 replicas with 6 ongoing, no waiting, KV low, ITL p90
0.12 s against 0.2 s: 6 <= 0.5 x 8 x 2 and 0.12 <= 0.8 x 0.2, so after 30 calm seconds 3 -> 2;
2 -> 1 needs 6 <= 4: it stays at 2.

With a plan, down goes in one step instead: to what the highest rate of the last
`downscale_delay_s` needs with the headroom counted twice, plus the declared rise's spare
(`rise_rps_per_s` x start time, as up sizes for it; never below what the requests in flight
need at `target_ongoing` each), when the pool has been calm as above (its load under
that count's `target_ongoing`) for the delay. A burst's replicas go when it ends, not one per
delay; the band of one headroom between up and down keeps noise from flapping the pool.

To zero, only with `min_replicas: 0`: after `idle_to_zero_s` with nothing ongoing. Back from zero
as soon as a request waits (Serve holds requests while the replica starts).
"""

from __future__ import annotations

import math

import msgspec

from autoscaler.forecast import Plan
from autoscaler.signals import PoolSignals

LATENCY_CALM = 0.8  # a pool may step down while its latency p90s are under 80% of their targets


class Targets(msgspec.Struct, frozen=True):
    """One pool's bounds and targets (from the topology's `autoscaler` section)."""

    role: str
    min_replicas: int
    max_replicas: int
    ttft_p90_s: float = 2.0
    itl_p90_s: float = 0.25
    max_kv_usage: float = 0.85
    target_ongoing: float = 8.0
    max_waiting_per_replica: float = 4.0
    scale_down_margin: float = 0.5
    downscale_delay_s: float = 30.0
    idle_to_zero_s: float = 300.0
    capacity_rps: float = 0.0  # requests/s one replica serves within the targets; 0: no plan
    headroom: float = 0.2  # the plan sizes for the forecast rate x (1 + headroom)
    replica_start_s: float = 60.0  # the plan's horizon until a start has been measured
    rise_rps_per_s: float = 0.0  # the fastest rise the plan keeps in hand over a start time


class Decision(msgspec.Struct, frozen=True):
    replicas: int
    reason: str
    calm_since: float | None = None  # when every signal went under its scale-down threshold
    idle_since: float | None = None  # when the pool last had nothing ongoing


def _uses_ttft(role: str) -> bool:
    return role in ("prefill", "unified")


def _uses_itl(role: str) -> bool:
    return role in ("decode", "unified")


def _drain_s(s: PoolSignals, current: int) -> float:
    """Seconds the pool's replicas need to prefill what is queued (0 before any measurement)."""
    if s.queued_prompt_tokens <= 0 or s.prefill_capacity_tokens_per_s <= 0 or current <= 0:
        return 0.0
    return s.queued_prompt_tokens / (s.prefill_capacity_tokens_per_s * current)


def planned(rate: float, t: Targets) -> int:
    """Replicas that serve `rate` requests/s within the targets, with the headroom."""
    return math.ceil(rate * (1 + t.headroom) / t.capacity_rps - 1e-9)


def _up(s: PoolSignals, t: Targets, current: int, plan: Plan | None) -> tuple[int, str]:
    asks = [(math.ceil(s.ongoing / t.target_ongoing),
             f"load: {s.ongoing:.1f} ongoing / {t.target_ongoing:g} per replica")]
    if plan is not None and t.capacity_rps > 0:
        asks.append((planned(plan.forecast, t),
                     f"plan: {plan.rate:.1f} req/s now, {plan.forecast:.1f} expected in "
                     f"{plan.horizon_s:.0f}s, {t.capacity_rps:g} per replica"))
    if s.waiting > t.max_waiting_per_replica * current:
        asks.append((current + math.ceil(s.waiting / t.target_ongoing),
                     f"burst: {s.waiting:.1f} waiting > {t.max_waiting_per_replica:g} per replica"))
    loaded = s.ongoing >= 2 * current  # two or more requests per replica: latency follows load
    if loaded and _uses_ttft(t.role):
        drain_s, capacity = _drain_s(s, current), s.prefill_capacity_tokens_per_s
        if drain_s > t.ttft_p90_s:
            asks.append((math.ceil(s.queued_prompt_tokens / (capacity * t.ttft_p90_s)),
                         f"backlog: {s.queued_prompt_tokens:.0f} prompt tokens queued, "
                         f"{drain_s:.1f}s to drain at {capacity:.0f} tokens/s per replica > "
                         f"{t.ttft_p90_s:g}s"))
        if s.ttft_p90_s > t.ttft_p90_s:
            asks.append((math.ceil(current * s.ttft_p90_s / t.ttft_p90_s),
                         f"TTFT p90 {s.ttft_p90_s:.2f}s > {t.ttft_p90_s:g}s"))
    if loaded and _uses_itl(t.role) and s.itl_p90_s > t.itl_p90_s:
        asks.append((math.ceil(current * s.itl_p90_s / t.itl_p90_s),
                     f"ITL p90 {s.itl_p90_s:.3f}s > {t.itl_p90_s:g}s"))
    if s.kv_cache_usage > t.max_kv_usage:
        asks.append((current + 1, f"KV usage {s.kv_cache_usage:.2f} > {t.max_kv_usage:g}"))
    return max(asks, key=lambda ask: ask[0])


def _calm(s: PoolSignals, t: Targets, current: int, fewer: int, max_ongoing: float) -> bool:
    """Whether the pool, stepping down to `fewer` replicas, is calm: at most `max_ongoing`
    requests, none waiting, KV usage and the prefill backlog under the margin's share of their
    targets, latencies under LATENCY_CALM of theirs. Where `fewer` replicas would still give each
    request an engine of its own (ongoing <= fewer), latency does not count: it is the engine's
    floor, which the replica that goes would not have lowered."""
    m = t.scale_down_margin
    alone = s.ongoing <= fewer
    return (s.waiting < 1  # averaged over the look-back window: less than one request waiting
            and s.ongoing <= max_ongoing
            and s.kv_cache_usage <= m * t.max_kv_usage
            and (not _uses_ttft(t.role) or (_drain_s(s, current) <= m * t.ttft_p90_s and (
                alone or s.ttft_p90_s <= LATENCY_CALM * t.ttft_p90_s)))
            and (not _uses_itl(t.role) or alone or s.itl_p90_s <= LATENCY_CALM * t.itl_p90_s))


def _down_to(s: PoolSignals, t: Targets, current: int, plan: Plan | None) -> int | None:
    """The replica count a calm pool may come down to, or None when it must stay.

    Without a plan: one fewer, when the load fits it with the margin to spare. With one: in one
    step to what the highest rate of the scale-down delay needs with the headroom counted twice
    (autoscaler.forecast), when the load fits that count (ongoing requests at most
    `target_ongoing` each) and the pool is otherwise calm.
    """
    floor = max(1, t.min_replicas)
    if plan is None or t.capacity_rps <= 0:
        calm = _calm(s, t, current, current - 1,
                     t.scale_down_margin * t.target_ongoing * (current - 1))
        return current - 1 if current > floor and calm else None
    fewer = max(floor, planned(plan.peak_rate * (1 + t.headroom) + plan.spare_rate, t),
                math.ceil(s.ongoing / t.target_ongoing))
    if fewer >= current or not _calm(s, t, current, fewer, t.target_ongoing * fewer):
        return None
    return fewer


def decide(s: PoolSignals, t: Targets, current: int, now: float,
           calm_since: float | None = None, idle_since: float | None = None,
           plan: Plan | None = None) -> Decision:
    """The replicas the pool should have now, and why (see the module docstring)."""
    idle_since = (idle_since if idle_since is not None else now) if s.ongoing == 0 else None
    if current == 0:
        if t.min_replicas > 0:
            return Decision(t.min_replicas, "below min_replicas", idle_since=idle_since)
        if s.ongoing > 0:
            return Decision(1, "requests waiting at zero replicas")
        return Decision(0, "idle at zero", idle_since=idle_since)
    wanted, reason = _up(s, t, current, plan)
    if wanted > current:
        wanted = min(t.max_replicas, wanted)
        if wanted > current:
            return Decision(wanted, reason, idle_since=idle_since)
        return Decision(current, f"at max_replicas ({reason})", idle_since=idle_since)
    if current > t.max_replicas:
        return Decision(t.max_replicas, "above max_replicas", idle_since=idle_since)
    if current < max(1, t.min_replicas):
        return Decision(max(1, t.min_replicas), "below min_replicas", idle_since=idle_since)
    if t.min_replicas == 0 and current == 1 and idle_since is not None \
            and now - idle_since >= t.idle_to_zero_s:
        return Decision(0, f"idle for {now - idle_since:.0f}s: scale to zero")
    fewer = _down_to(s, t, current, plan)
    if fewer is not None:
        calm_since = calm_since if calm_since is not None else now
        if now - calm_since >= t.downscale_delay_s:
            return Decision(fewer, f"calm for {now - calm_since:.0f}s: load fits "
                            f"{fewer}", calm_since=now, idle_since=idle_since)
        return Decision(current, "calm, waiting out the scale-down delay", calm_since=calm_since,
                        idle_since=idle_since)
    return Decision(current, "within targets", idle_since=idle_since)
