"""The autoscaler with real engines: a pool of 1..2 replicas scales up under sustained load and
back down after it, and no request fails during either transition (topology-autoscale.yaml)."""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest

from orchestrator.config import Topology
from orchestrator.status import gateway_url
from tests.integration.conftest import ROOT, TOKENFAB, up
from tests.integration.scaling import Load, running, wait_for, wait_served
from tests.promql import scrape

TOPOLOGY = ROOT / "tests/integration/topology-autoscale.yaml"
SCALE_UP_BOUND_S = 120  # decision within ~1 s, then an engine start (40-60 s on 2 busy cores)
SCALE_DOWN_BOUND_S = 60  # 5 s calm, then the drain of one replica
TRICKLE_PACE_S = 0.25


@pytest.fixture(scope="module")
def scaled(ray_cluster) -> Topology:
    with up(TOPOLOGY) as topology:
        yield topology


def test_scales_up_under_load_and_down_after_without_failures(scaled: Topology) -> None:
    root = gateway_url(scaled)
    assert running(scaled, "main") == 1
    with Load(root, clients=8, max_tokens=64) as heavy:
        up_s = wait_for(scaled, "main", 2, SCALE_UP_BOUND_S)
        wait_served(scaled, "main", 2)  # traffic reaches the new replica
    assert heavy.statuses and set(heavy.statuses) == {200}, heavy.statuses
    decision = httpx.get(f"{root}/tokenfab/autoscaler", trust_env=False).json()
    assert decision and decision[0]["pool"] == "main"
    # calm, but never idle: at most 4 req/s, under what one replica serves (capacity_rps 20,
    # 13.9 req/s with the headroom counted twice); back to back, one client at the suite's
    # priority sends 33 req/s, and the plan rightly kept 2 replicas
    with Load(root, clients=1, max_tokens=8, pace_s=TRICKLE_PACE_S) as trickle:
        down_s = wait_for(scaled, "main", 1, SCALE_DOWN_BOUND_S)
        trickle.answered_more(2)  # and after the scale-down
    assert trickle.statuses and set(trickle.statuses) == {200}, trickle.statuses
    (record,) = httpx.get(f"{root}/tokenfab/autoscaler", trust_env=False).json()
    assert (record["current"], record["desired"]) in ((1, 1), (2, 1))
    print(f"scale-up {up_s:.0f} s, scale-down {down_s:.0f} s; {len(heavy.statuses)} requests "
          f"under load, {len(trickle.statuses)} while scaling down")
    status = subprocess.run([TOKENFAB, "status", "--dashboard", scaled.cluster.dashboard_url,
                             "--app", scaled.name], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and "autoscaler:" in status.stdout, status.stdout
    assert "main: " in status.stdout and "bounds 1..2" in status.stdout
    assert "last change" in status.stdout and "2 -> 1: calm for" in status.stdout, status.stdout


def test_dashboard_autoscaler_row_reads_exported_series(scaled: Topology) -> None:
    """The Grafana dashboard's autoscaler row: its series come from the gateway and from the
    head's Ray metrics agent, where Serve runs the policy; both directions were counted."""
    from tests.promql import dashboard_series

    wanted = dashboard_series(rows={"Autoscaler"})
    agent = f"http://{scaled.cluster.node_ip}:{scaled.cluster.metrics_export_port}/metrics"
    deadline = time.monotonic() + 60  # Ray's agent exports what it got every few seconds
    while True:
        samples = scrape(f"{gateway_url(scaled)}/metrics") + scrape(agent)
        missing = wanted - {s.name for s in samples}
        directions = {s.labels["direction"] for s in samples
                      if s.name == "ray_tokenfab_autoscaler_decisions_total"
                      and s.labels.get("pool") == "main" and s.value >= 1}
        if (not missing and directions == {"up", "down"}) or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert missing == set(), f"queried by the dashboard, exported by nobody: {sorted(missing)}"
    assert directions == {"up", "down"}


def test_manual_scale_of_an_autoscaled_pool_is_refused(scaled: Topology) -> None:
    result = subprocess.run([TOKENFAB, "scale", "main", "2", "--dashboard",
                             scaled.cluster.dashboard_url, "--app", scaled.name],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "autoscaled between 1 and 2" in result.stderr

