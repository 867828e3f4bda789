"""One Ray cluster and one two-replica deployment for the whole integration session.

The deployment is made the way an operator would: `ray job submit` running `python -m
orchestrator up` against a local head. Reference outputs come from a bare vLLM engine run first.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import sys
from dataclasses import dataclass
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchestrator import cluster
from orchestrator.config import Topology, load_topology
from orchestrator.status import gateway_url

ROOT = Path(__file__).resolve().parents[2]

# Where this user has a Ray token (~/.ray/auth_token: Ray 2.60 writes one the first time a bare
# `ray.init()` starts a local cluster), `ray start` turns token authentication on for every head
# it starts, but `ray.init(address=...)` and `ray job submit` send the token only in token mode:
# say so, for this process and the ones it starts, or they are refused ("InvalidAuthToken").
if cluster.ray_auth_headers():
    os.environ.setdefault("RAY_AUTH_MODE", "token")
LORA_TOPOLOGY = ROOT / "tests/integration/topology-lora.yaml"
TOPOLOGY = ROOT / "tests/integration/topology.yaml"
TOKENFAB = str(Path(sys.executable).with_name("tokenfab"))


@dataclass(frozen=True)
class Deployment:
    topology: Topology
    base_url: str  # http://host:port/v1
    reference: dict[str, Any]
    job_log: str

    def tokenfab(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        dashboard = ["--dashboard", self.topology.cluster.dashboard_url]
        return subprocess.run([TOKENFAB, *args, *dashboard], capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT)


def event_credentials(topology: Topology):
    """The keys the application's routers present to the replicas' KV event relays, read from
    the GCS as any process of the cluster can (and nothing outside it)."""
    import ray

    from orchestrator.gateway.ingress import event_credentials as credentials

    initialised = ray.is_initialized()
    if not initialised:
        ray.init(address=topology.cluster.address, log_to_driver=False, logging_level="ERROR",
                 _node_ip_address=topology.cluster.address.rsplit(":", 1)[0])
    try:
        return credentials(topology.name)
    finally:
        if not initialised:
            ray.shutdown()


STACK = ("ray", "gcs_server", "raylet", "VLLM::", "vllm", "tokenfab", "dashboard")


def listeners_outside_loopback(wildcards: bool = True) -> list[tuple]:
    """Listening sockets of the stack's processes (Ray's, vLLM's, tokenfab's: by name or
    command line) on an address outside 127.0.0.0/8, wildcards included unless `wildcards` is
    False. Other programs of the machine (a CI agent, say) are not the suite's to judge."""
    import ipaddress

    import psutil

    offenders = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.status != psutil.CONN_LISTEN or conn.pid is None:
            continue
        address = ipaddress.ip_address(conn.laddr.ip)
        address = getattr(address, "ipv4_mapped", None) or address  # ::ffff:127.0.0.1
        if address.is_loopback or (not wildcards and address.is_unspecified):
            continue
        try:
            process = psutil.Process(conn.pid)
            command = f"{process.name()} {' '.join(process.cmdline())}"
        except psutil.Error:
            continue  # gone meanwhile
        if any(mark in command for mark in STACK):
            offenders.append((conn.laddr, conn.pid, process.name()))
    return offenders


def _run(command: list[str], timeout: float) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{command} failed ({result.returncode}):\n{output[-4000:]}"
    return output


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Greedy outputs of a bare vLLM engine with the suite's model and engine settings."""
    topology = load_topology(TOPOLOGY)
    _run([TOKENFAB, "model", "tiny", "--out", topology.model.resolved_path, "--if-missing"], 120)
    out = tmp_path_factory.mktemp("reference") / "reference.json"
    _run([sys.executable, "-m", "tests.integration.reference", str(TOPOLOGY), str(out)], 600)
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def lora_reference(tmp_path_factory: pytest.TempPathFactory, reference: dict[str, Any]
                   ) -> dict[str, Any]:
    """Greedy outputs of a bare vLLM engine running topology-lora.yaml's declared adapters
    (vLLM's own LoRARequest), with the suite's engine settings: `adapters[name][i]` is
    PROMPTS[i] under that adapter."""
    out = tmp_path_factory.mktemp("lora-reference") / "reference.json"
    _run([sys.executable, "-m", "tests.integration.reference", str(LORA_TOPOLOGY), str(out)], 600)
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def ray_cluster(request: pytest.FixtureRequest, reference: dict[str, Any]):
    """A local Ray head for the whole session (started after the reference engine is gone)."""
    request.config._tokenfab_cluster_used = True
    topology = load_topology(TOPOLOGY)
    try:
        cluster.start_head(topology.cluster)
        yield topology.cluster
    finally:
        subprocess.run([TOKENFAB, "down", "--dashboard", topology.cluster.dashboard_url,
                        "--stop-ray"], capture_output=True, timeout=300)


@contextlib.contextmanager
def up(path: Path) -> Iterator[Topology]:
    """A topology deployed with `tokenfab up` on the session cluster, removed afterwards."""
    topology = load_topology(path)
    result = subprocess.run([TOKENFAB, "up", str(path), "--timeout", "600"], cwd=ROOT,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    try:
        yield topology
    finally:
        remove_app(topology.name, topology.cluster.dashboard_url)


def remove_app(name: str, dashboard_url: str) -> None:
    subprocess.run([TOKENFAB, "down", "--app", name, "--dashboard", dashboard_url],
                   capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def deployment(ray_cluster, reference: dict[str, Any]):
    """The two-replica unified deployment, made with `ray job submit` as an operator would."""
    topology = load_topology(TOPOLOGY)
    command = [
        str(Path(sys.executable).with_name("ray")), "job", "submit",
        "--address", topology.cluster.dashboard_url, "--working-dir", str(ROOT), "--",
        sys.executable, "-m", "orchestrator", "up", str(TOPOLOGY.relative_to(ROOT)),
        "--timeout", "600",
    ]
    for _ in range(30):  # the head's job agent registers a little after the dashboard is up
        result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
        if "No available agent" not in result.stdout + result.stderr:
            break
        time.sleep(2)
    job_log = result.stdout + result.stderr
    assert result.returncode == 0, f"{command} failed ({result.returncode}):\n{job_log[-4000:]}"
    yield Deployment(topology, f"{gateway_url(topology)}/v1", reference, job_log)
    remove_app(topology.name, topology.cluster.dashboard_url)


@pytest.fixture(scope="module")
def http(deployment: Deployment):
    with httpx.Client(base_url=deployment.base_url, timeout=120, trust_env=False) as client:
        yield client


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The two-node test runs last, on its own cluster beside the session's idle head: started
    first, it left the session head's job agent unavailable to `ray job submit`."""
    items.sort(key=lambda item: item.module.__name__.endswith("test_multinode"))
