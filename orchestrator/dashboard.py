"""The Grafana dashboard (deploy/dashboards/tokenfab.json), built from the panel list below.

Two kinds of scrape target feed it: the gateway's `/metrics` (tokenfab_* series: tenants,
routing, P/D, and every pool replica's load, cache and transfer numbers, see `pool_metrics`) and
each Ray node's metrics agent: vLLM's own engine series (`ray_vllm_*`, labelled with the Serve
`ReplicaId`) and, from the head's agent where Serve's controller runs, the autoscaler's
(`ray_tokenfab_autoscaler_*`). vLLM's latency histograms are grouped by pool by joining on
`tokenfab_replica_info`.

`tokenfab dashboard` prints it; a test keeps the committed file equal to it, and another scrapes
a running deployment to check that every series a panel queries is exported.
"""

from __future__ import annotations

from typing import Any

_BY_POOL = "* on (ReplicaId) group_left (pool) tokenfab_replica_info"


def _vllm_quantile(q: float, histogram: str) -> str:
    return (f"histogram_quantile({q}, sum by (pool, le) "
            f"(rate(ray_vllm_{histogram}_bucket[$__rate_interval]) {_BY_POOL}))")


# (row, [(title, unit, [(expr, legend)])])
PANELS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    ("Latency", [
        ("Time to first token per pool", "s", [
            (_vllm_quantile(0.5, "time_to_first_token_seconds"), "p50 {{pool}}"),
            (_vllm_quantile(0.9, "time_to_first_token_seconds"), "p90 {{pool}}"),
        ]),
        ("Inter-token latency per pool", "s", [
            (_vllm_quantile(0.5, "inter_token_latency_seconds"), "p50 {{pool}}"),
            (_vllm_quantile(0.9, "inter_token_latency_seconds"), "p90 {{pool}}"),
        ]),
        ("End-to-end request latency per pool", "s", [
            (_vllm_quantile(0.9, "e2e_request_latency_seconds"), "p90 {{pool}}"),
        ]),
        ("Queue time in the engine per pool", "s", [
            (_vllm_quantile(0.9, "request_queue_time_seconds"), "p90 {{pool}}"),
        ]),
    ]),
    ("Throughput and load", [
        ("Generated tokens/s per pool", "short", [
            ("sum by (pool) (rate(tokenfab_replica_generation_tokens_total[$__rate_interval]))",
             "{{pool}}"),
        ]),
        ("Prompt tokens/s by where their KV came from", "short", [
            ("sum by (pool, source) "
             "(rate(tokenfab_replica_prompt_tokens_total[$__rate_interval]))",
             "{{pool}} {{source}}"),
        ]),
        ("Finished requests/s by reason", "reqps", [
            ("sum by (finished_reason) "
             "(rate(ray_vllm_request_success_total[$__rate_interval]))", "{{finished_reason}}"),
        ]),
        ("Running and waiting requests per pool", "short", [
            ("sum by (pool) (tokenfab_replica_requests_running)", "running {{pool}}"),
            ("sum by (pool) (tokenfab_replica_requests_waiting)", "waiting {{pool}}"),
        ]),
        ("Replicas per pool", "short", [
            ("sum by (pool, state) (tokenfab_pool_replicas)", "{{pool}} {{state}}"),
        ]),
        ("KV cache usage per replica", "percentunit", [
            ("tokenfab_replica_kv_cache_usage", "{{pool}} {{ReplicaId}}"),
        ]),
    ]),
    ("Tenants", [
        ("Requests/s per tenant and status", "reqps", [
            ("sum by (tenant, code) (rate(tokenfab_gateway_requests_total[$__rate_interval]))",
             "{{tenant}} {{code}}"),
        ]),
        ("Rejections/s per tenant and reason", "reqps", [
            ("sum by (tenant, reason) "
             "(rate(tokenfab_gateway_rejections_total[$__rate_interval])) > 0",
             "{{tenant}} {{reason}}"),
        ]),
        ("Tokens/s served per tenant", "short", [
            ("sum by (tenant, kind) (rate(tokenfab_gateway_tokens_total[$__rate_interval]))",
             "{{tenant}} {{kind}}"),
        ]),
        ("Time to first token per tenant (gateway, queueing included)", "s", [
            ("histogram_quantile(0.9, sum by (tenant, le) "
             "(rate(tokenfab_gateway_ttft_seconds_bucket[$__rate_interval])))", "p90 {{tenant}}"),
        ]),
        ("Inter-token latency per tenant", "s", [
            ("histogram_quantile(0.9, sum by (tenant, le) "
             "(rate(tokenfab_gateway_itl_seconds_bucket[$__rate_interval])))", "p90 {{tenant}}"),
        ]),
        ("Fair queue: waiting, in flight, wait p90", "short", [
            ("sum by (tenant) (tokenfab_gateway_queued)", "waiting {{tenant}}"),
            ("sum by (tenant) (tokenfab_gateway_in_flight)", "in flight {{tenant}}"),
            ("histogram_quantile(0.9, sum by (tenant, le) "
             "(rate(tokenfab_gateway_queue_seconds_bucket[$__rate_interval])))",
             "wait p90 {{tenant}} (s)"),
        ]),
    ]),
    ("Autoscaler", [
        ("Replicas: the autoscaler's ask and what runs", "short", [
            ("max by (pool) (ray_tokenfab_autoscaler_desired_replicas)", "desired {{pool}}"),
            ('sum by (pool) (tokenfab_pool_replicas{state="ready"})', "ready {{pool}}"),
        ]),
        ("Autoscaler decisions", "short", [
            ("sum by (pool, direction) "
             "(increase(ray_tokenfab_autoscaler_decisions_total[$__rate_interval]))",
             "{{pool}} {{direction}}"),
        ]),
    ]),
    ("Prefix cache and routing", [
        ("Prefix-cache hit rate per pool", "percentunit", [
            ("sum by (pool) (rate(tokenfab_replica_prefix_cache_hit_tokens_total"
             "[$__rate_interval])) / sum by (pool) "
             "(rate(tokenfab_replica_prefix_cache_queried_tokens_total[$__rate_interval]))",
             "{{pool}}"),
        ]),
        ("Routing decisions/s", "reqps", [
            ("sum by (pool, policy) (rate(tokenfab_router_decisions_total[$__rate_interval]))",
             "{{pool}} {{policy}}"),
        ]),
        ("Cached prompt tokens: router's prediction vs routed prompt tokens", "short", [
            ("sum by (pool) "
             "(rate(tokenfab_router_predicted_cached_tokens_total[$__rate_interval]))",
             "predicted cached {{pool}}"),
            ("sum by (pool) (rate(tokenfab_router_prompt_tokens_total[$__rate_interval]))",
             "prompt {{pool}}"),
        ]),
        ("Block map", "short", [
            ("sum by (pool) (tokenfab_router_index_entries)", "entries {{pool}}"),
            ("sum by (pool) (tokenfab_router_followed_replicas)", "followed replicas {{pool}}"),
        ]),
        ("KV event lag and gaps", "s", [
            ("max by (pool) (tokenfab_router_event_lag_seconds)", "lag {{pool}}"),
            ("sum by (pool, outcome) (increase(tokenfab_router_event_gaps_total"
             "[$__rate_interval]))", "gaps {{pool}} {{outcome}}"),
        ]),
        ("KV event batches/s", "short", [
            ("sum by (pool) (rate(tokenfab_router_event_batches_total[$__rate_interval]))",
             "{{pool}}"),
        ]),
    ]),
    ("Mixture of experts", [
        ("Tokens routed to each expert/s (all MoE layers)", "short", [
            ("sum by (pool, expert) "
             "(rate(tokenfab_replica_expert_routed_tokens_total[$__rate_interval]))",
             "{{pool}} expert {{expert}}"),
        ]),
        ("Expert load balance: mean / busiest expert (1 = even)", "percentunit", [
            ("avg by (pool) (sum by (pool, expert) "
             "(rate(tokenfab_replica_expert_routed_tokens_total[$__rate_interval]))) / "
             "max by (pool) (sum by (pool, expert) "
             "(rate(tokenfab_replica_expert_routed_tokens_total[$__rate_interval])))", "{{pool}}"),
        ]),
    ]),
    ("Prefill/decode transfers", [
        ("Requests by path", "reqps", [
            ("sum by (path) (rate(tokenfab_pd_requests_total[$__rate_interval]))", "{{path}}"),
            ("sum by (reason) (rate(tokenfab_pd_skipped_total[$__rate_interval]))",
             "skipped: {{reason}}"),
        ]),
        ("Prefill leg latency", "s", [
            ("histogram_quantile(0.9, sum by (le) "
             "(rate(tokenfab_pd_prefill_seconds_bucket[$__rate_interval])))", "p90"),
        ]),
        ("KV transfer bandwidth per pool", "Bps", [
            ("sum by (pool) (rate(tokenfab_replica_kv_transfer_bytes_total[$__rate_interval]))",
             "{{pool}}"),
        ]),
        ("KV transfers and failures/s", "short", [
            ("sum by (pool) (rate(tokenfab_replica_kv_transfers_total[$__rate_interval]))",
             "transfers {{pool}}"),
            ("sum by (pool) "
             "(rate(tokenfab_replica_kv_transfer_failures_total[$__rate_interval]))",
             "failures {{pool}}"),
            ("sum by (reason) (rate(tokenfab_pd_fallbacks_total[$__rate_interval]))",
             "fallback: {{reason}}"),
        ]),
    ]),
]


def _panel(panel_id: int, title: str, unit: str, targets: list[tuple[str, str]], x: int,
           y: int) -> dict[str, Any]:
    return {
        "id": panel_id, "type": "timeseries", "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "multi"}},
        "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                    for i, (expr, legend) in enumerate(targets)],
    }


def dashboard() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (schema 39), with a Prometheus datasource variable."""
    panels: list[dict[str, Any]] = []
    y = 0
    for row, row_panels in PANELS:
        panels.append({"id": len(panels) + 1, "type": "row", "title": row, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        y += 1
        for i, (title, unit, targets) in enumerate(row_panels):
            x, dy = 12 * (i % 2), 8 * (i // 2)
            panels.append(_panel(len(panels) + 1, title, unit, targets, x, y + dy))
        y += 8 * ((len(row_panels) + 1) // 2)
    return {
        "uid": "tokenfab", "title": "tokenfab", "tags": ["tokenfab", "vllm", "ray"],
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"}, "timezone": "browser",
        "annotations": {"list": []},
        "templating": {"list": [{
            "name": "datasource", "label": "Prometheus", "type": "datasource",
            "query": "prometheus", "current": {}, "hide": 0,
        }]},
        "panels": panels,
    }


def queried_expressions(model: dict[str, Any]) -> list[str]:
    """Every PromQL expression of a dashboard's panels."""
    return [target["expr"] for panel in model["panels"] for target in panel.get("targets", [])]
