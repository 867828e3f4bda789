"""Two models and LoRA adapters behind one endpoint, on real engines (topology-lora.yaml):
requests go to their model's pool; adapter outputs equal vLLM's own with the same LoRARequest;
caches kept apart by adapter; adapters loaded and unloaded at run time on every ingress replica;
private adapters; the admin route's answers."""

from __future__ import annotations

import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from orchestrator.config import Topology
from orchestrator.status import ADMIN_KEY_ENV, gateway_url
from pools.tiny_lora import adapter_name
from tests.integration.cases import PROMPTS
from tests.integration.conftest import LORA_TOPOLOGY, ROOT, TOKENFAB, up
from tests.promql import scrape

MODEL, MOE = "tiny", "tiny-moe"
ALPHA, BETA, ADMIN = "alpha-key", "beta-key", "admin-key"
# Several KV blocks (128 tokens on CPU), unique to this module
LONG_PROMPT = "adapter cache probe: " + " ".join(f"word{i % 89} stone" for i in range(300))
RUNTIME = 3  # the tiny adapter loaded at run time (lora-3); the topology declares 0, 1 and 2


@pytest.fixture(scope="module")
def lora(ray_cluster, lora_reference: dict[str, Any]) -> Topology:
    with up(LORA_TOPOLOGY) as topology:
        yield topology


@pytest.fixture(scope="module")
def root(lora: Topology) -> str:
    return gateway_url(lora)


def _post(root: str, key: str | None, body: dict[str, Any], path: str = "/v1/completions",
          client: httpx.Client | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if client is not None:
        return client.post(f"{root}{path}", json=body, headers=headers)
    return httpx.post(f"{root}{path}", json=body, headers=headers, trust_env=False, timeout=120)


def _get(root: str, key: str | None, path: str) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{root}{path}", headers=headers, trust_env=False, timeout=30)


def _complete(root: str, model: str, prompt: str, max_tokens: int, key: str = ALPHA
              ) -> dict[str, Any]:
    response = _post(root, key, {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                 "temperature": 0, "return_token_ids": True})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("adapter", ["lora-0", "lora-1", "alpha-private"])
@pytest.mark.parametrize("index", range(3), ids=[p.id for p in PROMPTS[:3]])
def test_adapter_output_equals_vllm_with_the_same_lora_request(
        root: str, lora_reference: dict[str, Any], adapter: str, index: int) -> None:
    case, expected = PROMPTS[index], lora_reference["adapters"][adapter][index]
    answer = _complete(root, adapter, case.prompt, case.max_tokens)
    assert answer["choices"][0]["token_ids"] == expected["token_ids"]
    assert answer["model"] == adapter


def test_adapters_change_the_output_and_the_base_model_is_untouched(
        root: str, reference: dict[str, Any], lora_reference: dict[str, Any]) -> None:
    case = PROMPTS[1]
    base = _complete(root, MODEL, case.prompt, case.max_tokens)["choices"][0]["token_ids"]
    assert base == reference["prompts"][1]["token_ids"]  # the engine without LoRA
    outputs = {name: runs[1]["token_ids"] for name, runs in lora_reference["adapters"].items()}
    assert len({tuple(ids) for ids in [base, *outputs.values()]}) == 1 + len(outputs)


def _cached(root: str, model: str) -> int:
    answer = _complete(root, model, LONG_PROMPT, 2)
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_prefix_cached_under_one_adapter_is_no_hit_for_another(root: str) -> None:
    assert _cached(root, "lora-0") == 0
    assert _cached(root, "lora-0") >= 128  # the engine's own count: whole blocks
    assert _cached(root, "lora-1") == 0
    assert _cached(root, MODEL) == 0
    assert _cached(root, "lora-1") >= 128


def test_the_router_keys_its_block_map_by_adapter(root: str) -> None:
    """The router's explain answer for the prompt cached above: blocks held under lora-0 and
    lora-1, none under alpha-private (never sent), as the engine's KV events told it."""

    def held(model: str) -> int:
        answer = _post(root, ALPHA, {"model": model, "prompt": LONG_PROMPT, "max_tokens": 2},
                       path="/tokenfab/route/completions")
        assert answer.status_code == 200, answer.text
        return max(c["cached_tokens"] for c in answer.json()["main"]["candidates"])

    deadline = time.monotonic() + 10
    while held("lora-0") < 128 and time.monotonic() < deadline:
        time.sleep(0.2)  # the events reach the router within a moment
    assert held("lora-0") >= 128 and held("lora-1") >= 128
    assert held("alpha-private") == 0


def test_a_private_adapter_does_not_exist_for_other_tenants(root: str) -> None:
    body = {"prompt": "Hello", "max_tokens": 2}
    hidden = _post(root, BETA, body | {"model": "alpha-private"})
    unknown = _post(root, BETA, body | {"model": "alpha-nothing"})
    assert (hidden.status_code, unknown.status_code) == (404, 404)
    assert hidden.json()["error"] | {"message": ""} == unknown.json()["error"] | {"message": ""}
    assert "alpha-private" in hidden.json()["error"]["message"]
    assert _post(root, ALPHA, body | {"model": "alpha-private"}).status_code == 200
    assert _post(root, BETA, body | {"model": "lora-0"}).status_code == 403  # not in its models
    assert _post(root, BETA, body | {"model": "lora-1"}).status_code == 200


def test_models_lists_what_each_tenant_may_use_with_parents(root: str) -> None:
    def listed(key: str | None) -> dict[str, Any]:
        response = _get(root, key, "/v1/models")
        assert response.status_code == 200, response.text
        return {card["id"]: card["parent"] for card in response.json()["data"]}

    assert listed(ALPHA) == {MODEL: None, MOE: None, "lora-0": MODEL, "lora-1": MODEL,
                             "alpha-private": MODEL}
    assert listed(BETA) == {MODEL: None, "lora-1": MODEL}
    assert _get(root, None, "/v1/models").status_code == 401


def _tokenfab(*args: str) -> subprocess.CompletedProcess:
    env = os.environ | {ADMIN_KEY_ENV: ADMIN}
    return subprocess.run([TOKENFAB, *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)


def _every_ingress(root: str, check, replicas: int, within_s: float) -> float:
    """Seconds until `check(client)` held on each ingress replica: fresh connections land on the
    replicas at random; on each, the replica's id is asked first, then `check` runs."""
    started, passed = time.monotonic(), set()
    while len(passed) < replicas:
        assert time.monotonic() - started < within_s, f"only {passed} within {within_s} s"
        with httpx.Client(trust_env=False, timeout=60) as client:  # one connection: one replica
            router = client.get(f"{root}/tokenfab/router",
                                headers={"authorization": f"Bearer {ADMIN}"})
            ingress = router.json()["ingress"]["replica"]
            if check(client):
                passed.add(ingress)
                continue
        time.sleep(0.1)
    return time.monotonic() - started


def _served_by_every_ingress(root: str, model: str, status: int, replicas: int,
                             within_s: float) -> float:
    """Seconds until each ingress replica answered a request for `model` with `status`."""
    def answers(client: httpx.Client) -> bool:
        body = {"model": model, "prompt": "Hi", "max_tokens": 1}
        return _post(root, ALPHA, body, client=client).status_code == status

    return _every_ingress(root, answers, replicas, within_s)


def test_an_adapter_loaded_at_run_time_is_served_by_every_ingress_then_unloaded(
        root: str, lora: Topology) -> None:
    base = lora.model_of(lora.pool("main")).resolved_path
    made = _tokenfab("model", "tiny", "--out", base, "--if-missing", "--lora", str(RUNTIME + 1))
    assert made.returncode == 0, made.stderr
    path = f"{base}-lora/{adapter_name(RUNTIME)}"
    name = "runtime-3"
    assert _post(root, ALPHA, {"model": name, "prompt": "Hi", "max_tokens": 1}).status_code == 404
    loaded = _tokenfab("adapter", "load", name, path, "--app", lora.name,
                       "--dashboard", lora.cluster.dashboard_url)
    assert loaded.returncode == 0, loaded.stderr
    seconds = _served_by_every_ingress(root, name, 200, lora.gateway.replicas, within_s=5)
    listed = _tokenfab("adapter", "list", "--app", lora.name, "--dashboard",
                       lora.cluster.dashboard_url)
    assert name in listed.stdout and path in listed.stdout, listed.stdout
    unloaded = _tokenfab("adapter", "unload", name, "--app", lora.name, "--dashboard",
                         lora.cluster.dashboard_url)
    assert unloaded.returncode == 0, unloaded.stderr
    _served_by_every_ingress(root, name, 404, lora.gateway.replicas, within_s=5)
    again = _tokenfab("adapter", "unload", name, "--app", lora.name, "--dashboard",
                      lora.cluster.dashboard_url)
    assert again.returncode == 1 and "404" in again.stderr
    print(f"served by every ingress {seconds:.2f} s after the load")


def test_concurrent_first_requests_for_a_new_adapter_all_run(root: str, lora: Topology) -> None:
    """Requests that reach the engine together before it has ever seen the adapter: one
    registers it with vLLM (which refuses a second registration as a duplicate), all run."""
    name, path = "burst", f"{lora.model_of(lora.pool('main')).resolved_path}-lora/lora-{RUNTIME}"
    added = _post(root, ADMIN, {"name": name, "path": path}, path="/tokenfab/adapters")
    assert added.status_code == 200, added.text
    try:
        def lists_it(client: httpx.Client) -> bool:  # the gateway's list: no engine is asked
            models = client.get(f"{root}/v1/models", headers={"authorization": f"Bearer {ALPHA}"})
            return any(card["id"] == name for card in models.json()["data"])

        _every_ingress(root, lists_it, lora.gateway.replicas, within_s=5)
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: _post(root, ALPHA, {
                "model": name, "prompt": f"burst {i}", "max_tokens": 2}), range(4)))
        assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    finally:
        httpx.delete(f"{root}/tokenfab/adapters/{name}", trust_env=False,
                     headers={"authorization": f"Bearer {ADMIN}"})


def test_the_admin_route_checks_who_asks_and_what_is_loaded(root: str) -> None:
    route = "/tokenfab/adapters"
    body = {"name": "another", "path": "/nonexistent/adapter"}
    assert _post(root, None, body, path=route).status_code == 401
    assert _post(root, ALPHA, body, path=route).status_code == 403
    missing = _post(root, ADMIN, body, path=route)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "path"
    taken = _post(root, ADMIN, {"name": "lora-0", "path": "/tmp"}, path=route)
    assert taken.status_code == 409 and taken.json()["error"]["param"] == "name"
    stranger = _post(root, ADMIN, body | {"tenants": ["nobody"]}, path=route)
    assert stranger.status_code == 400 and stranger.json()["error"]["param"] == "tenants"
    extra = _post(root, ADMIN, body | {"rank": 8}, path=route)
    assert extra.status_code == 400 and extra.json()["error"]["param"] == "rank"
    declared = httpx.delete(f"{root}{route}/lora-0", headers={"authorization": f"Bearer {ADMIN}"},
                            trust_env=False)
    assert declared.status_code == 409


def test_replicas_report_the_adapters_they_hold(root: str) -> None:
    _complete(root, "lora-1", "Residency probe", 1)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        listed = {row["name"]: row for row in _get(root, ADMIN, "/tokenfab/adapters").json()}
        if listed["lora-1"]["held_by"]:
            break
        time.sleep(0.2)
    assert listed["lora-1"]["held_by"], listed
    assert listed["alpha-private"]["tenants"] == ["alpha"] and listed["lora-1"]["declared"]
    [report] = [r for r in _get(root, ADMIN, "/tokenfab/replicas").json() if r["pool"] == "main"]
    assert report["adapter_loads"] >= 3 and report["adapter_load_s"] > 0
    assert len(report["adapters"]) <= 2  # max_cpu_loras defaults to max_loras: 2


def test_every_ingress_counts_the_adapters_running_through_the_others(root: str) -> None:
    """A request's adapter runs on a replica: the ingress that sent it counts it at once; the
    other hears it from the replica (the channel's ADAPTERS frame), and both hear it end."""
    body = {"model": "lora-1", "prompt": "Keep going:", "max_tokens": 1900, "ignore_eos": True,
            "stream": True}

    def running(client: httpx.Client) -> dict[str, dict[str, int]]:
        router = client.get(f"{root}/tokenfab/router", headers={"authorization": f"Bearer {ADMIN}"})
        return {replica: view["running"]
                for replica, view in router.json()["pools"]["main"]["adapters"].items()}

    with httpx.Client(trust_env=False, timeout=120) as streaming, streaming.stream(
            "POST", f"{root}/v1/completions", json=body,
            headers={"authorization": f"Bearer {ALPHA}"}) as reply:
        assert reply.status_code == 200
        replica = reply.headers["x-tokenfab-replica"]
        chunks = reply.iter_raw()  # kept: a generator let go closes the stream
        next(chunks)  # generating
        _every_ingress(root, lambda c: running(c).get(replica, {}).get("lora-1", 0) >= 1,
                       2, within_s=5)
    # the client went away: the request is cancelled, and every ingress hears it end
    _every_ingress(root, lambda c: "lora-1" not in running(c).get(replica, {}), 2, within_s=5)


def test_each_model_is_served_by_its_own_pool(root: str, lora: Topology) -> None:
    replicas = {r["replica_id"]: r["pool"] for r in _get(root, ADMIN, "/tokenfab/replicas").json()}
    for model, pool in ((MODEL, "main"), (MOE, "moe"), ("lora-1", "main")):
        response = _post(root, ALPHA, {"model": model, "prompt": "Which pool?", "max_tokens": 2})
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model
        assert replicas[response.headers["x-tokenfab-replica"]] == pool
    assert _post(root, BETA, {"model": MOE, "prompt": "Hi", "max_tokens": 1}).status_code == 403
    explained = _post(root, ALPHA, {"model": MOE, "prompt": "Hi", "max_tokens": 1},
                      path="/tokenfab/route/completions").json()
    assert set(explained) == {"moe"}


def test_usage_and_metrics_are_labelled_by_model_and_adapter(root: str) -> None:
    samples = scrape(f"{root}/metrics", ADMIN)  # every ingress replica's series

    def total(name: str, **labels: str) -> float:
        return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())

    tokens, requests = "tokenfab_gateway_tokens_total", "tokenfab_gateway_requests_total"
    assert total(tokens, tenant="alpha", kind="completion", model="lora-0") >= 3 * 8
    assert total(tokens, tenant="alpha", kind="cached", model="lora-0") >= 128
    assert total(tokens, tenant="alpha", kind="completion", model=MOE) >= 2
    assert total(requests, tenant="alpha", code="200", model="alpha-private") >= 4
    assert total(requests, tenant="beta", code="404", model="-") >= 2  # names never read
    assert total(requests, tenant="beta", code="200", model="alpha-private") == 0
