"""The local Ray head: find it, start it pinned to the topology's node address, stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

from orchestrator.config import ClusterSpec
from tokenfab.errors import ClusterError

_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_DOCKER_CPU_WARNING": "1"}
# Ray replaces a loopback --node-ip-address by the machine's other interface unless told it runs
# a single-machine cluster; this is how loopback-only clusters (tests, `local.yaml`) stay on lo.
_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def ray_env(cluster: ClusterSpec) -> dict[str, str]:
    """Environment for Ray processes and drivers of this cluster."""
    loopback = cluster.node_ip is not None and cluster.node_ip.startswith("127.")
    return _ENV | (_LOOPBACK_ENV if loopback else {})


def ray_executable() -> str:
    return str(Path(sys.executable).with_name("ray"))


def ray_auth_headers() -> dict[str, str]:
    """The header that authenticates this user to a Ray dashboard with token authentication
    (Ray turns it on for clusters started where a token exists): the token from RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, as Ray's own clients find it. Empty without one."""
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    if not token:
        path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray/auth_token")
        try:
            token = path.expanduser().read_text().strip()
        except OSError:
            return {}
    return {"authorization": f"Bearer {token}"} if token else {}


def dashboard_up(url: str, timeout_s: float = 2.0) -> bool:
    try:
        return httpx.get(f"{url}/api/version", timeout=timeout_s, trust_env=False,
                         headers=ray_auth_headers()).is_success
    except httpx.HTTPError:
        return False


def start_head(cluster: ClusterSpec, timeout_s: float = 120.0) -> None:
    """Start a Ray head on this machine, bound to `cluster.node_ip`, and wait for its dashboard."""
    host, port = cluster.address.rsplit(":", 1)
    dashboard = urlparse(cluster.dashboard_url)
    command = [
        ray_executable(), "start", "--head", f"--port={port}",
        f"--dashboard-host={dashboard.hostname}", f"--dashboard-port={dashboard.port or 8265}",
        "--disable-usage-stats",
    ]
    if cluster.node_ip is not None:
        command.append(f"--node-ip-address={cluster.node_ip}")
    if cluster.num_cpus is not None:
        command.append(f"--num-cpus={cluster.num_cpus}")
    if cluster.metrics_export_port is not None:
        command.append(f"--metrics-export-port={cluster.metrics_export_port}")
    # A session of its own: the terminal's Ctrl-C must reach `tokenfab up`, which then removes the
    # deployment in order, not the Ray daemons underneath it.
    result = subprocess.run(command, env=os.environ | ray_env(cluster), capture_output=True,
                            text=True, start_new_session=True)
    if result.returncode != 0:
        raise ClusterError(f"`ray start --head` failed:\n{result.stdout}\n{result.stderr}")
    deadline = time.monotonic() + timeout_s
    while not dashboard_up(cluster.dashboard_url):
        if time.monotonic() > deadline:
            raise ClusterError(f"Ray dashboard did not come up at {cluster.dashboard_url}")
        time.sleep(1.0)


def stop_ray() -> None:
    """Stop every Ray process on this machine, then engine processes they orphaned."""
    subprocess.run([ray_executable(), "stop", "--force"], env=os.environ | _ENV,
                   capture_output=True, check=False)
    for pid in orphaned_engine_processes():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def orphaned_engine_processes() -> list[int]:
    """vLLM processes (titled `VLLM::...`) whose parent died: a killed replica leaves them."""
    orphans = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text()
        except OSError:
            continue
        name, rest = fields[fields.index("(") + 1:fields.rindex(")")], fields[fields.rindex(")") + 2:]
        if name.startswith("VLLM::") and rest.split()[1] == "1":
            orphans.append(int(stat.parent.name))
    return orphans
