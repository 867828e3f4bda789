"""Deploys topologies through Ray Serve's declarative REST API on the Ray dashboard.

The same Serve config document is what KubeRay's RayService applies, so a topology deploys the same
way from `tokenfab up`, from `ray job submit`, and on Kubernetes. Replica counts are passed as
per-deployment overrides, so changing only them scales in place without restarting engines.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from orchestrator.cluster import ray_auth_headers
from orchestrator.config import Topology, parse_topology, pool_deployment_name
from tokenfab.errors import ClusterError

IMPORT_PATH = "orchestrator.app:build_app"
_API = "/api/serve/applications/"


def _without_counts(topology: Topology) -> dict[str, Any]:
    """The topology with every pool at its lowest valid count. Serve hashes `args` into the
    code version and restarts replicas when it changes, so counts travel as overrides instead."""
    data = topology.model_dump(mode="json")
    for spec, pool in zip(topology.pools, data["pools"]):
        if not topology.autoscaled(spec):  # autoscaled: `replicas` is Serve's initial count
            pool["replicas"] = max(1, pool["min_replicas"] or 0)
    return data


def application_config(topology: Topology) -> dict[str, Any]:
    """The Serve application entry for one topology."""
    return {
        "name": topology.name,
        "route_prefix": None,  # the gateway serves HTTP itself (gateway.ingress), not Serve's proxy
        "import_path": IMPORT_PATH,
        "args": {"topology": _without_counts(topology)},
        "deployments": [  # autoscaled pools: Serve owns the count (autoscaler.serve_policy)
            {"name": pool_deployment_name(pool.name)}
            | ({} if topology.autoscaled(pool) else {"num_replicas": pool.replicas})
            for pool in topology.pools
        ],
    }


def topology_of(app_config: dict[str, Any]) -> Topology:
    """Inverse of application_config: the topology with its replica counts restored."""
    data = dict(app_config["args"]["topology"])
    counts = {d["name"]: d.get("num_replicas") for d in app_config.get("deployments") or []}
    data["pools"] = [
        pool | {"replicas": counts.get(pool_deployment_name(pool["name"])) or pool["replicas"]}
        for pool in data["pools"]
    ]
    return parse_topology(data, f"application {app_config['name']}")


class ServeClient:
    """Talks to the dashboard's Serve REST API; translates transport errors to ClusterError."""

    def __init__(self, dashboard_url: str, timeout_s: float = 30.0) -> None:
        self._http = httpx.Client(base_url=dashboard_url, timeout=timeout_s, trust_env=False,
                                  headers=ray_auth_headers())
        self._url = dashboard_url

    def _call(self, method: str, body: Any = None) -> httpx.Response:
        try:
            response = self._http.request(method, _API, json=body)
        except httpx.HTTPError as exc:
            raise ClusterError(f"Ray dashboard at {self._url} is unreachable: {exc}") from exc
        if response.status_code >= 400:
            raise ClusterError(f"Serve rejected {method} ({response.status_code}): {response.text}")
        return response

    def details(self) -> dict[str, Any]:
        return self._call("GET").json()

    def deployed_apps(self) -> list[dict[str, Any]]:
        apps = self.details().get("applications") or {}
        return [app["deployed_app_config"] for app in apps.values()
                if app.get("deployed_app_config")]

    def deploy(self, topology: Topology) -> None:
        """Add or replace this topology's application; other applications stay as they are."""
        apps = [app for app in self.deployed_apps() if app["name"] != topology.name]
        apps.append(application_config(topology))
        self.put(apps)

    def put(self, apps: list[dict[str, Any]]) -> None:
        config = {"proxy_location": "Disabled", "applications": apps}
        self._call("PUT", config)

    def delete(self, name: str) -> bool:
        """Remove one application; shut Serve down when it was the last. False if absent."""
        apps = self.deployed_apps()
        rest = [app for app in apps if app["name"] != name]
        if len(rest) == len(apps):
            return False
        if rest:
            self.put(rest)
        else:
            self._call("DELETE")
        return True

    def application(self, name: str) -> dict[str, Any] | None:
        return (self.details().get("applications") or {}).get(name)


def wait_until_running(
    client: ServeClient,
    name: str,
    timeout_s: float,
    progress: Callable[[str], None],
    poll_s: float = 2.0,
) -> dict[str, Any]:
    """Poll until the application is RUNNING; report each change of state through `progress`."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        app = client.application(name)
        line = describe(app)
        if line != last:
            progress(line)
            last = line
        status = (app or {}).get("status")
        if status == "RUNNING":
            return app
        if status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise ClusterError(f"application {name} is {status}: {(app or {}).get('message', '')}")
        time.sleep(poll_s)
    raise ClusterError(f"application {name} not running after {timeout_s:g} s: {last}")


def wait_until_gone(client: ServeClient, name: str, timeout_s: float, poll_s: float = 1.0) -> None:
    """Wait until Serve has drained and removed the application (its engines are shut down)."""
    deadline = time.monotonic() + timeout_s
    while client.application(name) is not None:
        if time.monotonic() > deadline:
            raise ClusterError(f"application {name} still present after {timeout_s:g} s")
        time.sleep(poll_s)


def describe(app: dict[str, Any] | None) -> str:
    """One line: application status, then each deployment's replica states."""
    if not app:
        return "waiting for Serve to accept the application"
    parts = [f"application {app.get('status')}"]
    for name, deployment in sorted((app.get("deployments") or {}).items()):
        states: dict[str, int] = {}
        for replica in deployment.get("replicas") or []:
            states[replica["state"]] = states.get(replica["state"], 0) + 1
        summary = ", ".join(f"{n} {s.lower()}" for s, n in sorted(states.items())) or "no replicas"
        parts.append(f"{name}: {summary}")
    return "; ".join(parts)
