"""Two ingress replicas on one port (topology-ingress.yaml): whichever one a scrape reaches,
/metrics answers every ingress replica's series, labelled by replica, with the same counts."""

from __future__ import annotations

import time

import httpx
import pytest

from orchestrator.config import Topology
from orchestrator.status import gateway_url
from tests.integration.conftest import ROOT, up
from tests.promql import scrape

TOPOLOGY = ROOT / "tests/integration/topology-ingress.yaml"
ADMIN, TENANT = "admin-key", "alpha-key"


@pytest.fixture(scope="module")
def ingress(ray_cluster) -> Topology:
    with up(TOPOLOGY) as topology:
        yield topology


def _answering(root: str) -> str:
    """The ingress replica that takes a new connection."""
    response = httpx.get(f"{root}/tokenfab/router", trust_env=False, timeout=30,
                         headers={"authorization": f"Bearer {ADMIN}"})
    assert response.status_code == 200, response.text
    return response.json()["ingress"]["replica"]


def _served(samples, replica: str | None = None) -> float:
    return sum(s.value for s in samples if s.name == "tokenfab_gateway_requests_total"
               and s.labels["tenant"] == "alpha" and s.labels["code"] == "200"
               and replica in (None, s.labels["ingress"]))


def test_metrics_are_the_same_whichever_ingress_answers(ingress: Topology) -> None:
    root = gateway_url(ingress)
    replicas: set[str] = set()
    deadline = time.monotonic() + 60
    while len(replicas) < 2:  # each new connection lands on either replica's listener
        assert time.monotonic() < deadline, f"only ingress replicas {replicas} answered"
        replicas.add(_answering(root))
    sent = 0
    deadline = time.monotonic() + 120
    while not all(_served(scrape(f"{root}/metrics", ADMIN), r) for r in replicas):
        assert time.monotonic() < deadline and sent < 40, \
            f"{sent} requests on new connections all reached one ingress replica"
        response = httpx.post(f"{root}/v1/completions", trust_env=False, timeout=120,
                              headers={"authorization": f"Bearer {TENANT}"},
                              json={"model": "tiny", "prompt": f"ingress {sent}", "max_tokens": 2})
        assert response.status_code == 200, response.text
        sent += 1
    scrapes = [scrape(f"{root}/metrics", ADMIN) for _ in range(12)]  # new connections each
    for samples in scrapes:
        assert {s.labels["ingress"] for s in samples
                if s.name == "tokenfab_gateway_requests_total"} == replicas
        assert _served(samples) == sent
        for replica in replicas:  # each series is one replica's own, the same in every scrape
            assert _served(samples, replica) == _served(scrapes[0], replica)
