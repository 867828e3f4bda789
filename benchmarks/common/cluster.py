"""Deploying and removing a benchmark's topologies on the benchmark's own local Ray head."""

from __future__ import annotations

from orchestrator import deploy
from orchestrator.config import Topology
from orchestrator.status import gateway_url


def deployed(topology: Topology) -> str:
    """Deploy `topology`, wait until every replica runs, return the gateway's base URL."""
    client = deploy.ServeClient(topology.cluster.dashboard_url)
    client.deploy(topology)
    deploy.wait_until_running(client, topology.name, 900, lambda line: print("  ", line))
    return gateway_url(topology)


def remove(topology: Topology) -> None:
    client = deploy.ServeClient(topology.cluster.dashboard_url)
    client.delete(topology.name)
    deploy.wait_until_gone(client, topology.name, 300)
