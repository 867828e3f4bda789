"""`tokenfab status`: Serve's view of each replica joined with what the replica reports of its load."""

from __future__ import annotations

from typing import Any

from orchestrator.config import ClusterSpec, Topology, parse_topology
from orchestrator.deploy import IMPORT_PATH, ServeClient
from orchestrator.errors import ClusterError

_COLUMNS = [("pool", "POOL"), ("role", "ROLE"), ("replica", "REPLICA"), ("state", "STATE"),
            ("health", "HEALTH"), ("node", "NODE"), ("cores", "CORES"), ("running", "RUN"),
            ("waiting", "WAIT"), ("kv_usage", "KV%"), ("prefix_hit", "HIT%")]


def deployed_topology(client: ServeClient, app: str | None) -> Topology:
    """The topology of `app`, or of the only tokenfab application deployed."""
    configs = [c for c in client.deployed_apps() if c.get("import_path") == IMPORT_PATH]
    if app is not None:
        configs = [c for c in configs if c["name"] == app]
    if len(configs) != 1:
        names = [c["name"] for c in configs]
        raise ClusterError(f"expected one tokenfab application, found {names or 'none'}: use --app")
    return parse_topology(configs[0]["args"]["topology"], f"application {configs[0]['name']}")


def _reports(cluster: ClusterSpec, app: str) -> dict[str, Any]:
    import ray

    from orchestrator.cluster import connect
    from pools.registry import NAMESPACE, registry_name

    connect(cluster)
    try:
        registry = ray.get_actor(registry_name(app), namespace=NAMESPACE)
    except ValueError:
        return {}
    return {r.replica_id: r for r in ray.get(registry.snapshot.remote(), timeout=10)}


def collect(dashboard_url: str, app: str | None) -> list[dict[str, Any]]:
    """One row per pool replica."""
    client = ServeClient(dashboard_url)
    topology = deployed_topology(client, app)
    details = client.application(topology.name) or {}
    reports = _reports(topology.cluster, topology.name)
    rows = []
    for pool in topology.pools:
        deployment = (details.get("deployments") or {}).get(f"pool-{pool.name}") or {}
        for replica in deployment.get("replicas") or []:
            rows.append(_row(pool.name, pool.role, replica, reports.get(replica["replica_id"])))
    return rows


def _row(pool: str, role: str, replica: dict[str, Any], report: Any) -> dict[str, Any]:
    row = {"pool": pool, "role": role, "replica": replica["replica_id"],
           "state": replica["state"], "node": replica.get("node_ip") or "-",
           "health": "healthy" if replica["state"] == "RUNNING" else "not ready"}
    if report is not None:
        load = report.load
        row |= {"cores": ",".join(map(str, report.cores)) or "-", "running": load.running,
                "waiting": load.waiting, "kv_usage": round(100 * load.kv_cache_usage, 1),
                "prefix_hit": round(100 * load.prefix_cache_hit_rate, 1),
                "engine_start_s": round(report.engine_start_s, 1), "engine": report.state}
    return row


def render(rows: list[dict[str, Any]]) -> str:
    table = [[title for _, title in _COLUMNS]]
    table += [[str(row.get(key, "-")) for key, _ in _COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(_COLUMNS))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip()
                     for line in table)


def remove_registries(cluster: ClusterSpec, apps: list[str]) -> None:
    """Kill the registry actors of removed applications (they are detached)."""
    import ray

    from orchestrator.cluster import connect
    from pools.registry import NAMESPACE, registry_name

    if not apps:
        return
    connect(cluster)
    for app in apps:
        try:
            ray.kill(ray.get_actor(registry_name(app), namespace=NAMESPACE))
        except ValueError:
            pass
