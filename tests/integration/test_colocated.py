"""The gateway served from the pool's replicas (gateway.colocate, topology-colocated.yaml): each
replica's own process takes HTTP on the shared port, serves the requests it places on itself by
calls and those it places on the other replica over the channel, with the bare engine's answers."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from orchestrator.config import Topology
from orchestrator.status import gateway_url
from tests.integration.cases import PROMPTS
from tests.integration.conftest import ROOT, up

TOPOLOGY = ROOT / "tests/integration/topology-colocated.yaml"
ADMIN = {"authorization": "Bearer admin-key"}
TENANT = {"authorization": "Bearer alpha-key"}
CASE = 1  # one block of prompt, under the engine's cache block: never a prefix hit


@pytest.fixture(scope="module")
def colocated(ray_cluster) -> Topology:
    with up(TOPOLOGY) as topology:
        yield topology


def _streamed(response: httpx.Response) -> tuple[str, dict[str, Any]]:
    """The text and the usage of an SSE completion stream."""
    text, usage = "", {}
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line.removeprefix("data: "))
        text += "".join(choice["text"] for choice in chunk["choices"])
        usage = chunk.get("usage") or usage
    return text, usage


def test_each_replica_serves_http_and_places_on_itself_and_the_other(
        colocated: Topology, reference: dict[str, Any]) -> None:
    root = gateway_url(colocated)
    reports = httpx.get(f"{root}/tokenfab/replicas", headers=ADMIN, trust_env=False, timeout=30)
    assert reports.status_code == 200, reports.text
    pids = {r["replica_id"]: r["pid"] for r in reports.json()}
    assert len(pids) == 2
    case, expected = PROMPTS[CASE], reference["prompts"][CASE]
    body = {"model": "tiny", "prompt": case.prompt, "max_tokens": case.max_tokens,
            "temperature": 0}
    placed: set[tuple[str, str]] = set()  # (ingress, replica that served)
    deadline = time.monotonic() + 120
    while len(placed) < 4:
        assert time.monotonic() < deadline, f"placements seen: {placed}"
        with httpx.Client(base_url=root, trust_env=False, timeout=120) as client:  # one connection
            ingress = client.get("/tokenfab/router", headers=ADMIN).json()["ingress"]
            assert pids[ingress["replica"]] == ingress["pid"]  # the pool replica's own process
            whole = client.post("/v1/completions", headers=TENANT, json=body)
            assert whole.status_code == 200, whole.text
            assert whole.json()["choices"][0]["text"] == expected["text"]
            stream = client.post("/v1/completions", headers=TENANT, json=body | {
                "stream": True, "stream_options": {"include_usage": True}})
            assert stream.status_code == 200, stream.text
            text, usage = _streamed(stream)
            assert text == expected["text"] and usage["completion_tokens"] == case.max_tokens
            served = {whole.headers["x-tokenfab-replica"], stream.headers["x-tokenfab-replica"]}
            assert served == set(pids)  # round_robin: one here, one on the other replica
            placed |= {(ingress["replica"], replica) for replica in served}


def test_a_colocated_ingress_still_asks_for_a_key(colocated: Topology) -> None:
    response = httpx.post(f"{gateway_url(colocated)}/v1/completions", trust_env=False,
                          timeout=30, json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
