"""Counters of the prefill/decode flow, kept by the ingress that runs it.

Exposed as Prometheus series on the gateway's /metrics and as JSON for `tokenfab status`.
"""

from __future__ import annotations

from collections import Counter as Tally
from typing import Literal, get_args

from prometheus_client import CollectorRegistry, Counter, Histogram

Path = Literal["disaggregated", "decode_only"]
FallbackReason = Literal["prefill_failed", "prefill_timeout", "prefill_error", "no_kv_params"]
SkipReason = Literal["short_prompt", "cached_on_decode", "multiple_choices", "unknown_prompt"]


class TransferMetrics:
    """One per ingress replica; every method is called from its event loop."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._requests = Counter("tokenfab_pd_requests", "Requests by path taken.", ["path"],
                                 registry=registry)
        self._skips = Counter("tokenfab_pd_skipped", "Requests sent straight to decode, by reason.",
                              ["reason"], registry=registry)
        self._fallbacks = Counter("tokenfab_pd_fallbacks", "Prefill legs that failed; decode "
                                  "recomputed the prompt.", ["reason"], registry=registry)
        self._prefill = Histogram("tokenfab_pd_prefill_seconds", "Prefill leg latency.",
                                  buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                                  registry=registry)
        self.tally: Tally[str] = Tally()
        for counter, labels in ((self._requests, Path), (self._skips, SkipReason),
                                (self._fallbacks, FallbackReason)):
            for label in get_args(labels):  # every series exists from the start, at 0
                counter.labels(label)

    def path(self, path: Path) -> None:
        self._requests.labels(path).inc()
        self.tally[f"requests_{path}"] += 1

    def skipped(self, reason: SkipReason) -> None:
        self._skips.labels(reason).inc()
        self.tally[f"skipped_{reason}"] += 1

    def fallback(self, reason: FallbackReason) -> None:
        self._fallbacks.labels(reason).inc()
        self.tally[f"fallback_{reason}"] += 1
        self.tally["fallbacks"] += 1

    def prefill_latency(self, seconds: float) -> None:
        self._prefill.observe(seconds)
