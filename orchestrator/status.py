"""`tokenfab status`: Serve's view of each replica joined with what the replica reports of its load.

Serve's view comes from the dashboard, the replicas' reports from the gateway; neither needs this
process to join the Ray cluster.
"""

from __future__ import annotations

import os
import time
from typing import Any

import httpx

from orchestrator.config import Topology
from orchestrator.deploy import IMPORT_PATH, ServeClient, topology_of
from tokenfab.errors import ClusterError

_COLUMNS = [("pool", "POOL"), ("role", "ROLE"), ("replica", "REPLICA"), ("state", "STATE"),
            ("health", "HEALTH"), ("node", "NODE"), ("cores", "CORES"), ("running", "RUN"),
            ("waiting", "WAIT"), ("kv_usage", "KV%"), ("prefix_hit", "HIT%"),
            ("cached_blocks", "BLOCKS"), ("breaker", "BREAKER"),
            ("kv_transfers", "XFERS"), ("kv_transfer_failures", "XFAIL")]


def deployed_topology(client: ServeClient, app: str | None) -> Topology:
    """The topology of `app`, or of the only tokenfab application deployed."""
    configs = [c for c in client.deployed_apps() if c.get("import_path") == IMPORT_PATH]
    if app is not None:
        configs = [c for c in configs if c["name"] == app]
    if len(configs) != 1:
        names = [c["name"] for c in configs]
        raise ClusterError(f"expected one tokenfab application, found {names or 'none'}: use --app")
    return topology_of(configs[0])


def gateway_url(topology: Topology) -> str:
    gateway = topology.gateway
    host = "127.0.0.1" if gateway.host in ("0.0.0.0", "::") else gateway.host
    return f"http://{host}:{gateway.port}{gateway.route_prefix.rstrip('/')}"


ADMIN_KEY_ENV = "TOKENFAB_ADMIN_KEY"


def _from_gateway(topology: Topology, path: str) -> Any:
    """JSON from one of the gateway's /tokenfab routes, with the admin key of $TOKENFAB_ADMIN_KEY
    if set; None while the gateway is not up. A gateway that refuses the key is an error."""
    key = os.environ.get(ADMIN_KEY_ENV, "").strip()
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        response = httpx.get(f"{gateway_url(topology)}{path}", timeout=10, trust_env=False,
                             headers=headers)
    except httpx.HTTPError:
        return None
    if response.status_code in (401, 403):
        raise ClusterError(f"the gateway refused {path} ({response.status_code}): with auth on, "
                           f"set {ADMIN_KEY_ENV} to an admin key (auth.admin_keys)")
    return response.json() if response.is_success else None


def adapter_call(dashboard_url: str, app: str | None, method: str, *,
                 body: dict[str, Any] | None = None, name: str = "") -> Any:
    """A call to the gateway's /tokenfab/adapters route (admin key from $TOKENFAB_ADMIN_KEY);
    its JSON answer, or a ClusterError with the gateway's own message."""
    topology = deployed_topology(ServeClient(dashboard_url), app)
    key = os.environ.get(ADMIN_KEY_ENV, "").strip()
    headers = {"authorization": f"Bearer {key}"} if key else {}
    url = f"{gateway_url(topology)}/tokenfab/adapters" + (f"/{name}" if name else "")
    try:
        response = httpx.request(method, url, json=body, headers=headers, timeout=30,
                                 trust_env=False)
    except httpx.HTTPError as exc:
        raise ClusterError(f"the gateway of {topology.name} did not answer: {exc}") from exc
    if response.is_success:
        return response.json()
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:200]
    hint = f" (set {ADMIN_KEY_ENV} to an admin key)" if response.status_code in (401, 403) else ""
    raise ClusterError(f"{response.status_code}: {message}{hint}")


def collect(dashboard_url: str, app: str | None) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """One row per pool replica, and the gateway's prefill/decode counters (empty if unified)."""
    client = ServeClient(dashboard_url)
    topology = deployed_topology(client, app)
    details = client.application(topology.name) or {}
    reports = {r["replica_id"]: r for r in _from_gateway(topology, "/tokenfab/replicas") or []}
    routed = (_from_gateway(topology, "/tokenfab/router") or {}).get("pools", {})
    rows = []
    for pool in topology.pools:
        deployment = (details.get("deployments") or {}).get(f"pool-{pool.name}") or {}
        in_map = (routed.get(pool.name) or {}).get("replicas", {})
        for replica in deployment.get("replicas") or []:
            report = reports.get(replica["replica_id"])
            row = _row(pool.name, pool.role, replica, report)
            rows.append(_routed(row, in_map))
            for rank in (report or {}).get("ranks") or []:  # data-parallel ranks: a row each
                rows.append(_routed(_rank_row(row, rank), in_map))
    return rows, _from_gateway(topology, "/tokenfab/pd") or {}


def _routed(row: dict[str, Any], in_map: dict[str, Any]) -> dict[str, Any]:
    """The row with what the router knows of its target: blocks in the map, breaker state."""
    if row["replica"] in in_map:
        routed = in_map[row["replica"]]
        row["cached_blocks"] = routed["cached_blocks"]
        row["breaker"] = routed.get("breaker", "-")
    return row


def _rank_row(replica_row: dict[str, Any], rank: dict[str, Any]) -> dict[str, Any]:
    """One data-parallel rank of a replica's engine, named as the router names its target."""
    return {key: replica_row[key] for key in ("pool", "role", "state", "node", "health")} | {
        "replica": f"{replica_row['replica']}/dp{rank['rank']}", "rank": rank["rank"],
        "kv_events_endpoint": rank["kv_events_endpoint"]} | _load_columns(rank["load"])


def _row(pool: str, role: str, replica: dict[str, Any], report: dict[str, Any] | None) -> dict:
    row: dict[str, Any] = {
        "pool": pool, "role": role, "replica": replica["replica_id"], "state": replica["state"],
        "node": replica.get("node_ip") or "-",
        "health": "healthy" if replica["state"] == "RUNNING" else "not ready",
    }
    if report is not None:
        load = report["load"]
        row |= _load_columns(load) | {
            "cores": ",".join(map(str, report["cores"])) or "-",
            "engine": report["state"], "engine_start_s": round(report["engine_start_s"], 1),
            "health": "engine failed" if report["state"] == "failed" else row["health"],
            "kv_events_endpoint": report["kv_events_endpoint"],
            "side_channel": report["side_channel"],
            "latency": report.get("latency") or {},
            "kv_transfers": load["kv_transfers"],
            "kv_transfer_bytes": load["kv_transfer_bytes"],
            "kv_transfer_failures": load["kv_transfer_failures"],
        }
    return row


def _load_columns(load: dict[str, Any]) -> dict[str, Any]:
    """What a replica's or a rank's engine reports of its requests, cache and prompt tokens."""
    queries = load["prefix_cache_queries"]
    return {
        "running": load["running"], "waiting": load["waiting"],
        "kv_usage": round(100 * load["kv_cache_usage"], 1),
        "prefix_hit": round(100 * load["prefix_cache_hits"] / queries, 1) if queries else 0.0,
        "prompt_tokens": {"computed": load["prompt_tokens_computed"],
                          "local_hit": load["prompt_tokens_local_hit"],
                          "transferred": load["prompt_tokens_transferred"]},
    }


def render(rows: list[dict[str, Any]]) -> str:
    table = [[title for _, title in _COLUMNS]]
    table += [[str(row.get(key, "-")) for key, _ in _COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(_COLUMNS))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip()
                     for line in table)


def collect_scaling(dashboard_url: str, app: str | None) -> list[dict[str, Any]]:
    """The autoscaler's latest decision per autoscaled pool (empty when none is)."""
    topology = deployed_topology(ServeClient(dashboard_url), app)
    return _from_gateway(topology, "/tokenfab/autoscaler") or []


def render_scaling(records: list[dict[str, Any]]) -> str:
    lines = ["autoscaler:"]
    for r in records:
        lines.append(f"  {r['pool']}: {r['current']} -> {r['desired']} replicas "
                     f"(bounds {r['min_replicas']}..{r['max_replicas']}; targets TTFT p90 "
                     f"{r['ttft_p90_s']:g}s, ITL p90 {r['itl_p90_s']:g}s); now: {r['reason']}")
        if r.get("last_change"):
            ago = max(0.0, time.time() - r["last_change_at"])
            lines.append(f"    last change {ago:.0f}s ago: {r['last_change']}")
    return "\n".join(lines)
