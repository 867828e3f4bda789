"""Prefill and decode pools scale independently, with real engines and NIXL transfers
(topology-pd-autoscale.yaml): long prompts grow the prefill pool while decode stays at one
replica, short prompts with long outputs grow the decode pool while prefill stays at one, each
comes back to one after its load, and no request fails throughout."""

from __future__ import annotations

import itertools
import time

import httpx
import pytest

from orchestrator.config import Topology
from orchestrator.status import gateway_url
from tests.integration.cases import _words
from tests.integration.conftest import ROOT, up
from tests.integration.scaling import Load, running, wait_for

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


def test_prefill_and_decode_pools_scale_independently(pd: Topology) -> None:
    root = gateway_url(pd)
    assert (running(pd, "prefill"), running(pd, "decode")) == (1, 1)
    before = _paths(root)

    with Load(root, clients=6, max_tokens=2, prompt=_long_prompt) as prompts:
        prefill_up_s = wait_for(pd, "prefill", 2, SCALE_UP_BOUND_S, watch={"decode": 1})
        time.sleep(3)  # traffic reaches the new prefill replica
    decisions = _decisions(root)
    reason = decisions["prefill"]["last_change"]
    assert reason.startswith("1 -> 2: ")
    assert decisions["decode"]["last_change"].startswith("0 -> 1: below min_replicas")
    with Load(root, clients=1, max_tokens=2, prompt=_long_prompt) as trickle:
        prefill_down_s = wait_for(pd, "prefill", 1, SCALE_DOWN_BOUND_S, watch={"decode": 1})
    assert prompts.statuses and set(prompts.statuses) == {200}, prompts.statuses
    assert trickle.statuses and set(trickle.statuses) == {200}, trickle.statuses
    after = _paths(root)
    sent = len(prompts.statuses) + len(trickle.statuses)
    print(f"prefill: up {prefill_up_s:.0f} s ({reason}), down {prefill_down_s:.0f} s; "
          f"{sent} requests; P/D counters {after}")
    # every long prompt went through the prefill pool (a fallback is decode recomputing it)
    assert _delta(after, before, "requests_disaggregated") == sent

    with Load(root, clients=16, max_tokens=64, prompt=_short_prompt) as generations:
        decode_up_s = wait_for(pd, "decode", 2, SCALE_UP_BOUND_S, watch={"prefill": 1})
        time.sleep(3)
    decisions = _decisions(root)
    reason = decisions["decode"]["last_change"]
    assert reason.startswith("1 -> 2: ")
    assert decisions["prefill"]["last_change"].startswith("2 -> 1: calm")
    with Load(root, clients=1, max_tokens=8, prompt=_short_prompt) as trickle:
        decode_down_s = wait_for(pd, "decode", 1, SCALE_DOWN_BOUND_S, watch={"prefill": 1})
    assert generations.statuses and set(generations.statuses) == {200}, generations.statuses
    assert trickle.statuses and set(trickle.statuses) == {200}, trickle.statuses
    final, sent = _paths(root), len(generations.statuses) + len(trickle.statuses)
    print(f"decode: up {decode_up_s:.0f} s ({reason}), down {decode_down_s:.0f} s; "
          f"{sent} requests; P/D counters {final}")
    assert _delta(final, after, "skipped_short_prompt") == sent  # decode alone served them
