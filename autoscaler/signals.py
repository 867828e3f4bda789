"""What the autoscaler sees of a pool: each replica's own recent numbers, and their sum.

Every replica reports `ReplicaSignals` to Ray Serve (`record_autoscaling_stats`); Serve averages
each one over its look-back window per replica and hands them to the pool's policy, which folds
them into one `PoolSignals`. Latencies are the replica's recent p90 (a sliding window of what its
engine measured): TTFT per request, and inter-token latency as each finished request's mean gap
between tokens (vLLM's time per output token, what latency SLOs judge). A p90 over single gaps
would mostly measure the steps that carry a long prompt's prefill chunk: with 32k-token prompts
that p90 stays near 0.5 s at any replica count while requests' mean gaps are 0.03 s
(benchmarks/results/sim_autoscaling.md), and a policy chasing it holds every replica it may.
Throughputs are per second over the same window; arrivals are a counter, which the policy
differences between decisions (autoscaler.forecast). Queued prompt tokens are
the prompts of the replica's requests still in their prefill (vLLM's own count); prefill capacity
is what the engine computes per second while it prefills (the p90 of its recent steps' prompt
tokens over step time), so backlog / capacity is how long the queue takes to drain.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Mapping

import msgspec

SIGNAL_WINDOW_S = 10.0  # latencies and rates a replica reports are over this window


class ReplicaSignals(msgspec.Struct, frozen=True):
    """One replica's recent load and latency, as floats (what Serve's custom metrics carry)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float = 0.0
    ttft_p90_s: float = 0.0  # 0 when no request got its first token in the window
    itl_p90_s: float = 0.0
    prompt_tokens_per_s: float = 0.0
    generation_tokens_per_s: float = 0.0
    queued_prompt_tokens: float = 0.0
    prefill_capacity_tokens_per_s: float = 0.0  # 0 until the engine has prefilled
    in_flight: float = 0.0  # requests the replica is serving (running, waiting, or finishing)
    held: float = 0.0  # requests gateways hold for the pool, as far as this replica heard
    arrivals: float = 0.0  # requests the replica has taken since it started (a counter)


class PoolSignals(msgspec.Struct, frozen=True):
    """A pool's signals: sums of load, replicas' typical latencies, the fullest KV cache."""

    replicas: int
    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float = 0.0  # the fullest replica's
    ttft_p90_s: float = 0.0  # the mean of the replicas' p90s
    itl_p90_s: float = 0.0
    prompt_tokens_per_s: float = 0.0
    generation_tokens_per_s: float = 0.0
    queued_prompt_tokens: float = 0.0
    prefill_capacity_tokens_per_s: float = 0.0  # per replica: the mean of those that measured it
    in_flight: float = 0.0
    held: float = 0.0  # requests gateways hold because no replica could take them (the most
    # any replica heard of: each replica hears every gateway, so these are not summed)

    @property
    def ongoing(self) -> float:
        return self.running + self.waiting


def pool_signals(per_metric: Mapping[str, Mapping[object, float]], replicas: int) -> PoolSignals:
    """Fold Serve's aggregated custom metrics ({metric: {replica: value}}) into pool signals."""

    def values(name: str) -> list[float]:
        return [v for v in (per_metric.get(name) or {}).values() if math.isfinite(v)]

    capacities = [v for v in values("prefill_capacity_tokens_per_s") if v > 0]

    def typical(name: str) -> float:
        """The mean of the p90s of replicas that measured one. Not the slowest replica's: the
        largest of N small-sample p90s grows with N (at 64 replicas with ~10 requests each in the
        window it is about the pool's p99.8), so a pool would look slower the larger it is."""
        measured = [v for v in values(name) if v > 0]
        return statistics.fmean(measured) if measured else 0.0

    return PoolSignals(
        replicas=replicas,
        running=sum(values("running")),
        waiting=sum(values("waiting")),
        kv_cache_usage=max(values("kv_cache_usage"), default=0.0),
        ttft_p90_s=typical("ttft_p90_s"),
        itl_p90_s=typical("itl_p90_s"),
        prompt_tokens_per_s=sum(values("prompt_tokens_per_s")),
        generation_tokens_per_s=sum(values("generation_tokens_per_s")),
        queued_prompt_tokens=sum(values("queued_prompt_tokens")),
        prefill_capacity_tokens_per_s=statistics.fmean(capacities) if capacities else 0.0,
        in_flight=sum(values("in_flight")),
        held=max(values("held"), default=0.0),
    )


class Window:
    """Samples of the last `seconds`, for a p90 or a rate. Not thread-safe: one writer.
    Each sample added drops those older than the window, so it holds one window's worth whether
    or not anything reads it."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, value: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._trim(now)
        self._samples.append((now, value))

    def __len__(self) -> int:
        return len(self._samples)

    def _trim(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self._seconds:
            self._samples.popleft()

    def p90(self, now: float | None = None) -> float:
        return self.quantile(0.9, now)

    def quantile(self, q: float, now: float | None = None) -> float:
        """The value q of the way up the window's sorted samples (nearest rank below); 0 for an
        empty window."""
        self._trim(time.monotonic() if now is None else now)
        values = sorted(v for _, v in self._samples)
        return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0

    def rate(self, now: float | None = None) -> float:
        """Sum of values per second over the window."""
        now = time.monotonic() if now is None else now
        self._trim(now)
        return sum(v for _, v in self._samples) / self._seconds
