"""Prefill and decode pools scale independently, with real engines and NIXL transfers
(topology-pd-autoscale.yaml): long prompts grow the prefill pool while decode stays at one
replica, short prompts with long outputs grow the decode pool while prefill stays at one, each
comes back to one after its load, and no request fails throughout."""

from __future__ import annotations

import itertools

import httpx
import pytest

from orchestrator.config import Topology
from orchestrator.status import gateway_url
from tests.integration.cases import _words
from tests.integration.conftest import ROOT, up
from tests.integration.scaling import Load, running, wait_for, wait_served

TOPOLOGY = ROOT / "tests/integration/topology-pd-autoscale.yaml"
SCALE_UP_BOUND_S = 150  # a decision within seconds, then an engine start on 2 busy cores
SCALE_DOWN_BOUND_S = 60
LONG = _words("prefill-heavy", 600)


_unique = itertools.count()


def _long_prompt(client: int, n: int) -> str:  # unique from the first block: no cache hits
    return f"{next(_unique)} {client} {n} " + LONG


def _short_prompt(client: int, n: int) -> str:
    return f"Hello {client} {n}"


@pytest.fixture(scope="module")
def pd(ray_cluster) -> Topology:
    with up(TOPOLOGY) as topology:
        yield topology


def _decisions(root: str) -> dict[str, dict]:
    return {r["pool"]: r for r in httpx.get(f"{root}/tokenfab/autoscaler", trust_env=False).json()}


def _paths(root: str) -> dict[str, int]:
    return httpx.get(f"{root}/tokenfab/pd", trust_env=False).json()


def _delta(after: dict[str, int], before: dict[str, int], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def _up_then_down(pd: Topology, pool: str, other: str, others_change: str,
                  clients: int, max_tokens: int, prompt) -> int:
    """Load that grows `pool` to 2 replicas, then a trickle that brings it back to 1, while
    `other` stays at 1 replica throughout; returns the requests sent (every one answered 200)."""
    root = gateway_url(pd)
    with Load(root, clients=clients, max_tokens=max_tokens, prompt=prompt) as heavy:
        up_s = wait_for(pd, pool, 2, SCALE_UP_BOUND_S, watch={other: 1})
        wait_served(pd, pool, 2)  # traffic reaches the new replica
        # read under the load: once it stops, the last requests may end more than the
        # scale-down delay apart, and the calm pool steps down before this could read it
        decisions = _decisions(root)
    reason = decisions[pool]["last_change"]
    assert reason.startswith("1 -> 2: "), decisions
    assert decisions[other]["last_change"].startswith(others_change), decisions
    with Load(root, clients=1, max_tokens=min(max_tokens, 8), prompt=prompt) as trickle:
        down_s = wait_for(pd, pool, 1, SCALE_DOWN_BOUND_S, watch={other: 1})
    assert heavy.statuses and set(heavy.statuses) == {200}, heavy.statuses
    assert trickle.statuses and set(trickle.statuses) == {200}, trickle.statuses
    sent = len(heavy.statuses) + len(trickle.statuses)
    print(f"{pool}: up {up_s:.0f} s ({reason}), down {down_s:.0f} s; {sent} requests; "
          f"P/D counters {_paths(root)}")
    return sent


def test_prefill_and_decode_pools_scale_independently(pd: Topology) -> None:
    root = gateway_url(pd)
    assert (running(pd, "prefill"), running(pd, "decode")) == (1, 1)
    before = _paths(root)
    sent = _up_then_down(pd, "prefill", "decode", "0 -> 1: below min_replicas",
                         clients=6, max_tokens=2, prompt=_long_prompt)
    after = _paths(root)
    # every long prompt went through the prefill pool (a fallback is decode recomputing it)
    assert _delta(after, before, "requests_disaggregated") == sent
    sent = _up_then_down(pd, "decode", "prefill", "2 -> 1: calm",
                         clients=16, max_tokens=64, prompt=_short_prompt)
    assert _delta(_paths(root), after, "skipped_short_prompt") == sent  # decode alone served them
