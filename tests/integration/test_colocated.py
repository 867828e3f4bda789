"""The gateway served from the pool's replicas (gateway.colocate, topology-colocated.yaml): each
replica's own process takes HTTP on the shared port, serves the requests it places on itself by
calls and those it places on the other replica over the channel, with the bare engine's answers."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from orchestrator.config import Topology
from orchestrator.status import gateway_url
from tests.integration.cases import PROMPTS
from tests.integration.conftest import ROOT, TOKENFAB, up

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


def test_requests_taken_by_either_ingress_alternate_replicas(colocated: Topology) -> None:
    """Both ingresses draw round robin's turn from one node-wide ticket (router/turn.py): each
    request goes to the other replica than the one before, whichever listener took it."""
    root = gateway_url(colocated)
    body = {"model": "tiny", "prompt": PROMPTS[CASE].prompt, "max_tokens": 1}
    seen: list[tuple[str, str]] = []  # (ingress, replica that served)
    deadline = time.monotonic() + 120
    while sum(a[0] != b[0] for a, b in zip(seen, seen[1:])) < 4:
        assert time.monotonic() < deadline, f"the listeners took: {seen}"
        with httpx.Client(base_url=root, trust_env=False, timeout=120) as client:  # a new one
            ingress = client.get("/tokenfab/router", headers=ADMIN).json()["ingress"]["replica"]
            response = client.post("/v1/completions", headers=TENANT, json=body)
            assert response.status_code == 200, response.text
            seen.append((ingress, response.headers["x-tokenfab-replica"]))
    repeats = [i for i in range(1, len(seen)) if seen[i][1] == seen[i - 1][1]]
    assert not repeats, f"the same replica twice in a row at {repeats}: {seen}"


def test_a_colocated_ingress_still_asks_for_a_key(colocated: Topology) -> None:
    response = httpx.post(f"{gateway_url(colocated)}/v1/completions", trust_env=False,
                          timeout=30, json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_a_replica_scaled_away_finishes_the_streams_its_ingress_took(colocated: Topology) -> None:
    """Scale 2 -> 1 while each replica's listener streams a long reply: the replica Serve stops
    drains (no new connection, its streams finish whole), the other keeps serving."""
    root = gateway_url(colocated)
    body = {"model": "tiny", "prompt": "drain", "max_tokens": 2000, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    clients: dict[str, httpx.Client] = {}
    deadline = time.monotonic() + 60
    while len(clients) < 2:  # one connection on each replica's listener
        assert time.monotonic() < deadline, f"only {list(clients)} answered"
        client = httpx.Client(base_url=root, trust_env=False, timeout=300)
        replica = client.get("/tokenfab/router", headers=ADMIN).json()["ingress"]["replica"]
        if replica in clients:
            client.close()
        else:
            clients[replica] = client
    usages: dict[str, dict[str, Any]] = {}
    started = {replica: threading.Event() for replica in clients}
    ended: dict[str, float] = {}

    def stream(replica: str) -> None:
        with clients[replica].stream("POST", "/v1/completions", headers=TENANT,
                                     json=body) as response:
            assert response.status_code == 200
            lines = []
            for line in response.iter_lines():
                started[replica].set()
                lines.append(line)
        ended[replica] = time.monotonic()
        usages[replica] = _streamed(httpx.Response(200, text="\n".join(lines)))[1]

    def scale() -> subprocess.CompletedProcess:
        return subprocess.run(
            [TOKENFAB, "scale", "main", "1", "--app", colocated.name,
             "--dashboard", colocated.cluster.dashboard_url],
            capture_output=True, text=True, timeout=300, cwd=ROOT)

    with ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(stream, replica) for replica in clients]
        for event in started.values():
            assert event.wait(120)
        scaled = pool.submit(scale)
        deadline = time.monotonic() + 120
        while True:  # until the replica Serve stops says it drains (or is gone)
            assert time.monotonic() < deadline, "no replica began to drain"
            states = {r["replica_id"]: r["state"] for r in httpx.get(
                f"{root}/tokenfab/replicas", headers=ADMIN, trust_env=False, timeout=30).json()}
            if any(states.get(replica) != "ready" for replica in clients):
                break
            time.sleep(0.1)
        assert not ended, f"streams {list(ended)} ended before a replica drained: too short"
        assert scaled.result(timeout=300).returncode == 0
        for future in streams:
            future.result(timeout=300)
    assert {r: u["completion_tokens"] for r, u in usages.items()} == dict.fromkeys(clients, 2000)
    for client in clients.values():
        client.close()
    deadline = time.monotonic() + 120
    while len(left := httpx.get(f"{root}/tokenfab/replicas", headers=ADMIN, trust_env=False,
                                timeout=30).json()) != 1:  # the stopped one leaves the registry
        assert time.monotonic() < deadline, left
        time.sleep(0.5)
    assert left[0]["replica_id"] in clients
    after = httpx.post(f"{root}/v1/completions", headers=TENANT, trust_env=False, timeout=120,
                       json={"model": "tiny", "prompt": "after", "max_tokens": 2})
    assert after.status_code == 200, after.text
