"""Prometheus series of every pool replica, rendered from the replicas' self-reports.

The gateway's `/metrics` appends these to its own, so one scrape target gives per-pool load,
cache and transfer numbers. `tokenfab_replica_info` carries the Serve replica id under the label
vLLM's own Ray-exported series use (`ReplicaId`), so a dashboard can group vLLM's latency
histograms by pool:

    sum by (pool, le) (rate(ray_vllm_time_to_first_token_seconds_bucket[5m])
      * on (ReplicaId) group_left (pool) tokenfab_replica_info)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pools.registry import ReplicaReport

_LABELS = ["pool", "ReplicaId"]
_GAUGES = {  # LoadSnapshot field -> (series, help)
    "running": ("tokenfab_replica_requests_running", "Requests the engine is running."),
    "waiting": ("tokenfab_replica_requests_waiting", "Requests waiting in the engine's queue."),
    "in_flight": ("tokenfab_replica_in_flight", "Requests the replica has accepted, not finished."),
    "kv_cache_usage": ("tokenfab_replica_kv_cache_usage", "Share of KV cache blocks in use, 0-1."),
}
_COUNTERS = {  # LoadSnapshot field -> (series without _total, help)
    "prefix_cache_queries": ("tokenfab_replica_prefix_cache_queried_tokens",
                             "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("tokenfab_replica_prefix_cache_hit_tokens",
                          "Prompt tokens found in the prefix cache."),
    "generation_tokens": ("tokenfab_replica_generation_tokens", "Tokens generated."),
    "kv_transfers": ("tokenfab_replica_kv_transfers", "KV transfers pulled by this replica."),
    "kv_transfer_bytes": ("tokenfab_replica_kv_transfer_bytes", "Bytes of KV pulled."),
    "kv_transfer_seconds": ("tokenfab_replica_kv_transfer_seconds", "Time spent pulling KV."),
    "kv_transfer_failures": ("tokenfab_replica_kv_transfer_failures",
                             "KV pulls that failed (the request was recomputed)."),
}
_PROMPT_SOURCES = {"computed": "prompt_tokens_computed", "local_hit": "prompt_tokens_local_hit",
                   "transferred": "prompt_tokens_transferred"}


class _ReplicaCollector:
    def __init__(self, reports: Iterable[ReplicaReport]) -> None:
        self._reports = list(reports)

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("tokenfab_replica_info", "One per pool replica (value 1).",
                                 labels=[*_LABELS, "role", "node", "state"])
        replicas = GaugeMetricFamily("tokenfab_pool_replicas", "Replicas per pool and state.",
                                     labels=["pool", "role", "state"])
        gauges = {f: GaugeMetricFamily(n, h, labels=_LABELS) for f, (n, h) in _GAUGES.items()}
        counters = {f: CounterMetricFamily(n, h, labels=_LABELS) for f, (n, h) in _COUNTERS.items()}
        prompt = CounterMetricFamily("tokenfab_replica_prompt_tokens",
                                     "Prompt tokens by where their KV came from.",
                                     labels=[*_LABELS, "source"])
        experts = CounterMetricFamily(
            "tokenfab_replica_expert_routed_tokens", "Tokens routed to each expert index of a "
            "mixture-of-experts engine, over all MoE layers (engines with "
            "enable_return_routed_experts only).", labels=[*_LABELS, "expert"])
        states: Counter[tuple[str, str, str]] = Counter()
        for report in self._reports:
            labels = [report.pool, report.replica_id]
            info.add_metric([*labels, report.role, report.node_ip, report.state], 1)
            states[report.pool, report.role, report.state] += 1
            for field, family in gauges.items():
                family.add_metric(labels, getattr(report.load, field))
            for field, counter in counters.items():
                counter.add_metric(labels, getattr(report.load, field))
            for source, field in _PROMPT_SOURCES.items():
                prompt.add_metric([*labels, source], getattr(report.load, field))
            for expert, tokens in enumerate(report.expert_tokens):
                experts.add_metric([*labels, str(expert)], tokens)
        for (pool, role, state), count in states.items():
            replicas.add_metric([pool, role, state], count)
        yield from (info, replicas, *gauges.values(), *counters.values(), prompt, experts)


def render(reports: Iterable[ReplicaReport]) -> bytes:
    """The replicas' series in Prometheus' text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ReplicaCollector(reports))
    return generate_latest(registry)
