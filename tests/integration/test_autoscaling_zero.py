"""Scale to zero with a real engine (topology-zero.yaml): a pool of 0..1 replicas goes to zero
when idle; a request that arrives then is held while a replica starts, and is answered."""

from __future__ import annotations

import time

import httpx
import pytest

from orchestrator.config import Topology
from orchestrator.status import gateway_url
from tests.integration.conftest import ROOT, up
from tests.integration.scaling import wait_for

ZERO = ROOT / "tests/integration/topology-zero.yaml"
TO_ZERO_BOUND_S = 60  # 5 s idle, then the drain of the replica
COLD_START_BOUND_S = 150  # a decision within ~1 s, then an engine start
# A replica takes requests over the data channel as soon as its engine is up, before Serve's
# controller has seen its constructor return and marks it RUNNING; on a busy machine that can
# come seconds after the reply.
SERVE_SEES_IT_S = 30


@pytest.fixture(scope="module")
def zero(ray_cluster) -> Topology:
    with up(ZERO) as topology:
        yield topology


def test_idle_pool_goes_to_zero_and_a_request_brings_it_back(zero: Topology) -> None:
    root = gateway_url(zero)
    to_zero_s = wait_for(zero, "main", 0, TO_ZERO_BOUND_S)
    ready = httpx.get(f"{root}/ready", trust_env=False)
    assert ready.status_code == 503 and "main" in ready.json()["error"]["message"]
    started = time.monotonic()
    response = httpx.post(f"{root}/v1/completions", trust_env=False, timeout=COLD_START_BOUND_S,
                          json={"model": "tiny", "prompt": "wake up", "max_tokens": 4})
    cold_s = time.monotonic() - started
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    wait_for(zero, "main", 1, SERVE_SEES_IT_S)
    assert cold_s > 3, "answered too fast for a replica that had to start"
    print(f"to zero after {to_zero_s:.0f} s idle; a request at zero answered in {cold_s:.0f} s")
