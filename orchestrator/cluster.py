"""The local Ray head: find it, start it pinned to the topology's node address, stop it.

A head tokenfab starts runs in a session of its own (`ray start` is its leader); every Ray
daemon, worker and engine process under it keeps that session id, even once orphaned. The
session is recorded per dashboard (`STATE_DIR`), and stopping kills only this user's processes
of that session: never another user's Ray, nor a Ray that tokenfab did not start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlparse

import httpx

from orchestrator.config import ClusterSpec
from tokenfab.errors import ClusterError

STATE_DIR = Path("~/.cache/tokenfab/ray-heads")  # one JSON file per head this user started
STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL what is left after this

_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_DOCKER_CPU_WARNING": "1"}
# Ray replaces a loopback --node-ip-address by the machine's other interface unless told it runs
# a single-machine cluster; this is how loopback-only clusters (tests, `local.yaml`) stay on lo.
_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def ray_env(cluster: ClusterSpec) -> dict[str, str]:
    """Environment for Ray processes and drivers of this cluster."""
    loopback = cluster.node_ip is not None and cluster.node_ip.startswith("127.")
    serve = {} if cluster.serve_control_loop_s is None else \
        {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": f"{cluster.serve_control_loop_s:g}"}
    return _ENV | (_LOOPBACK_ENV if loopback else {}) | serve


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
    if not cluster.log_monitor:
        command.append("--include-log-monitor=False")
    # A session of its own: the terminal's Ctrl-C must reach `tokenfab up`, which then removes the
    # deployment in order, not the Ray daemons underneath it; and the session id is what proves
    # later which processes are this head's.
    starter = subprocess.Popen(command, env=os.environ | ray_env(cluster), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err = starter.communicate()
    if starter.returncode != 0:
        raise ClusterError(f"`ray start --head` failed:\n{out}\n{err}")
    _record_head(cluster.dashboard_url, starter.pid)  # its daemons keep the session id
    deadline = time.monotonic() + timeout_s
    while not dashboard_up(cluster.dashboard_url):
        if time.monotonic() > deadline:
            raise ClusterError(f"Ray dashboard did not come up at {cluster.dashboard_url}")
        time.sleep(1.0)


def _state_file(dashboard_url: str) -> Path:
    url = urlparse(dashboard_url)
    return STATE_DIR.expanduser() / f"{url.hostname}-{url.port or 8265}.json"


def _record_head(dashboard_url: str, session: int) -> None:
    path = _state_file(dashboard_url)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"session": session}))


def stop_ray(dashboard_url: str) -> None:
    """Stop the Ray head tokenfab started for `dashboard_url`: SIGTERM every process of this user
    in its session (daemons, workers, engines, orphaned ones too), SIGKILL what is left after
    STOP_GRACE_S. ClusterError if tokenfab recorded no such head."""
    path = _state_file(dashboard_url)
    try:
        session = json.loads(path.read_text())["session"]
    except (OSError, ValueError, KeyError) as exc:
        raise ClusterError(f"no Ray head started by tokenfab is recorded for {dashboard_url} "
                           f"({path}); stop a Ray you started yourself with `ray stop`") from exc
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        for pid in session_processes(session):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while session_processes(session) and time.monotonic() < deadline:
            time.sleep(0.2)
    path.unlink(missing_ok=True)


class _Process(NamedTuple):
    pid: int
    name: str
    state: str
    ppid: int
    session: int


def _own_processes() -> Iterator[_Process]:
    """This user's processes, from /proc/PID/stat (one that ends meanwhile is skipped)."""
    uid = os.getuid()
    for pid_dir in Path("/proc").glob("[0-9]*"):
        try:
            if pid_dir.stat().st_uid != uid:
                continue
            stat = (pid_dir / "stat").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:]
        state, ppid, _, session = rest.split()[:4]
        yield _Process(int(pid_dir.name), name, state, int(ppid), int(session))


def session_processes(session: int) -> list[int]:
    """This user's live processes in `session` (zombies are already dead), this one aside."""
    return [p.pid for p in _own_processes()
            if p.session == session and p.state != "Z" and p.pid != os.getpid()]


def orphaned_engine_processes() -> list[int]:
    """This user's vLLM processes (titled `VLLM::...`) whose parent died: a killed replica
    leaves them."""
    return [p.pid for p in _own_processes() if p.name.startswith("VLLM::") and p.ppid == 1]
