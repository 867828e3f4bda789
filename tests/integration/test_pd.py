"""Prefill/decode disaggregation with real engines and real NIXL transfers (UCX over loopback).

Outputs are compared with the same bare-engine reference as the unified tests. Module order
matters: the test that kills the prefill replica runs last.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import ray
from ray import serve

from kvtransfer.nixl import reserve_side_channel
from kvtransfer.params import decode_body, prefill_body
from orchestrator.config import Topology
from orchestrator.status import gateway_url
from tests.integration.cases import CHATS, FALLBACK, PROMPTS
from tests.integration.conftest import ROOT, TOKENFAB, up
from tests.promql import dashboard_queries, dashboard_series, parse, scrape, series


TOPOLOGY = ROOT / "tests/integration/topology-pd.yaml"
MODEL = "tiny"
MIN_PROMPT_TOKENS = 64  # disaggregation.min_prompt_tokens in topology-pd.yaml


class PD:
    def __init__(self, topology: Topology, reference: dict[str, Any]) -> None:
        self.topology, self.reference = topology, reference
        self.root = gateway_url(topology)
        self.http = httpx.Client(base_url=f"{self.root}/v1", timeout=120, trust_env=False)

    def replicas(self) -> dict[str, dict[str, Any]]:
        reports = httpx.get(f"{self.root}/tokenfab/replicas", trust_env=False).json()
        return {report["pool"]: report for report in reports}

    def load(self, pool: str) -> dict[str, Any]:
        time.sleep(2.2)  # replicas report every second
        return self.replicas()[pool]["load"]

    def counters(self) -> dict[str, int]:
        return httpx.get(f"{self.root}/tokenfab/pd", trust_env=False).json()


@pytest.fixture(scope="module")
def pd(ray_cluster, reference: dict[str, Any]):
    with up(TOPOLOGY) as topology:
        yield PD(topology, reference)


@pytest.fixture(scope="module")
def handles(pd: PD):
    """Serve handles to the pools, for driving the two legs by hand."""
    ray.init(address=pd.topology.cluster.address, log_to_driver=False, logging_level="ERROR")
    yield {pool: serve.get_deployment_handle(f"pool-{pool}", pd.topology.name)
           for pool in ("prefill", "decode")}
    ray.shutdown()


@pytest.mark.parametrize("index", range(len(PROMPTS)), ids=[p.id for p in PROMPTS])
def test_completion_through_pd_equals_bare_engine(pd: PD, index: int) -> None:
    case, expected = PROMPTS[index], pd.reference["prompts"][index]
    before = pd.load("decode")
    response = pd.http.post("/completions", json={
        "model": MODEL, "prompt": case.prompt, "max_tokens": case.max_tokens, "temperature": 0,
        "return_token_ids": True})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["token_ids"] == expected["token_ids"]
    after = pd.load("decode")
    prompt_tokens = len(expected["prompt_token_ids"])
    transferred = after["prompt_tokens_transferred"] - before["prompt_tokens_transferred"]
    computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    if prompt_tokens >= MIN_PROMPT_TOKENS:  # the KV arrived over NIXL: decode computed nothing
        assert (transferred, computed) == (prompt_tokens, 0)
        assert after["kv_transfers"] > before["kv_transfers"]
    else:  # short prompts skip the prefill pool
        assert (transferred, computed) == (0, prompt_tokens)


@pytest.mark.parametrize("index", range(len(PROMPTS)), ids=[p.id for p in PROMPTS])
def test_streamed_completion_through_pd_equals_bare_engine(pd: PD, index: int) -> None:
    case, expected = PROMPTS[index], pd.reference["prompts"][index]
    body = {"model": MODEL, "prompt": case.prompt, "max_tokens": case.max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with pd.http.stream("POST", "/completions", json=body) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["text"] for e in events for c in e["choices"]) == expected["text"]
    assert events[-1]["usage"]["completion_tokens"] == case.max_tokens


@pytest.mark.parametrize("index", range(len(CHATS)), ids=[c.id for c in CHATS])
def test_chat_through_pd_equals_bare_engine(pd: PD, index: int) -> None:
    case, expected = CHATS[index], pd.reference["chats"][index]
    response = pd.http.post("/chat/completions", json={
        "model": MODEL, "messages": case.messages, "max_tokens": case.max_tokens,
        "temperature": 0, "return_token_ids": True})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == expected["token_ids"]


def test_pd_counters_and_status(pd: PD) -> None:
    counters = pd.counters()
    # Completions: 3 long prompts go through prefill. Streamed again, a prompt goes to decode
    # alone where decode holds all but fewer than MIN_PROMPT_TOKENS of it (in whole blocks, as
    # vLLM caches them: 128 tokens on CPU; the gateway reads them from decode's KV events and
    # its own dispatches there), and through prefill again where the rest is longer
    block = pd.replicas()["decode"]["block_size"]
    lengths = [len(p["prompt_token_ids"]) for p in pd.reference["prompts"]]
    long = [n for n in lengths if n >= MIN_PROMPT_TOKENS]
    held = [n for n in long if n - n // block * block < MIN_PROMPT_TOKENS]
    assert len(long) == 3 and held, (block, lengths)
    assert counters["skipped_short_prompt"] >= 2
    assert counters["skipped_cached_on_decode"] == len(held)
    assert counters["requests_disaggregated"] >= 2 * len(long) - len(held)
    assert counters.get("fallbacks", 0) == 0
    result = subprocess.run([TOKENFAB, "status", "--json", "--app", pd.topology.name,
                             "--dashboard", pd.topology.cluster.dashboard_url],
                            capture_output=True, text=True, timeout=60)
    rows = json.loads(result.stdout[result.stdout.index("["):])
    assert {row["role"] for row in rows} == {"prefill", "decode"}
    decode = next(row for row in rows if row["role"] == "decode")
    assert decode["kv_transfers"] >= 3 and decode["kv_transfer_bytes"] > 0
    table = subprocess.run([TOKENFAB, "status", "--app", pd.topology.name, "--dashboard",
                            pd.topology.cluster.dashboard_url], capture_output=True, text=True,
                           timeout=60).stdout
    assert f"requests_disaggregated={counters['requests_disaggregated']}" in table


def test_an_adapter_through_pd_equals_the_bare_engine_running_it(
        pd: PD, lora_reference: dict[str, Any]) -> None:
    """Both legs run the adapter: prefill computes the KV with it, decode pulls that KV (decode
    holds the prompt under the base model from the tests above, which is no hit for the adapter)
    and continues with it: the output is vLLM's own with the same LoRARequest."""
    case, expected = PROMPTS[2], lora_reference["adapters"]["lora-0"][2]
    before, counters = pd.load("decode"), pd.counters()
    response = pd.http.post("/completions", json={
        "model": "lora-0", "prompt": case.prompt, "max_tokens": case.max_tokens,
        "temperature": 0, "return_token_ids": True})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == expected["token_ids"]
    after, prompt_tokens = pd.load("decode"), len(expected["prompt_token_ids"])
    transferred = after["prompt_tokens_transferred"] - before["prompt_tokens_transferred"]
    computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    assert (transferred, computed) == (prompt_tokens, 0)
    assert pd.counters()["requests_disaggregated"] == counters["requests_disaggregated"] + 1
    assert {r["pool"]: r["adapters"] for r in pd.replicas().values()} == {
        "prefill": ["lora-0"], "decode": ["lora-0"]}


def test_bad_request_is_answered_once_not_retried(pd: PD) -> None:
    response = pd.http.post("/completions", json={"model": MODEL, "prompt": "word " * 100,
                                                  "temperature": "hot"})
    assert response.status_code == 400 and "temperature" in response.json()["error"]["message"]


def test_a_client_cannot_name_kv_to_pull(pd: PD) -> None:
    """kv_transfer_params names engines and blocks: from a client, decode would pull blocks of
    other tenants' prompts. A short prompt goes to decode alone, with the body as sent."""
    before = pd.load("decode")["generation_tokens"]
    response = pd.http.post("/completions", json={
        "model": MODEL, "prompt": "short", "max_tokens": 4,
        "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "any",
                               "remote_block_ids": [[0, 1, 2]]}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "kv_transfer_params" and "may not carry it" in error["message"]
    assert pd.load("decode")["generation_tokens"] == before  # no engine saw it


def test_client_disconnect_frees_both_engines(pd: PD) -> None:
    """A client that leaves mid-stream aborts the decode engine's request: it stops well short of
    its max_tokens (ignore_eos would generate every one of them), and both engines go idle."""
    prompt = "disconnect " + "green north " * 80
    max_tokens = 1800
    before = pd.load("decode")["generation_tokens"]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    with pd.http.stream("POST", "/completions", json=body) as response:
        chunks = response.iter_lines()
        for _ in range(10):
            next(chunks)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        loads = [report["load"] for report in pd.replicas().values()]
        if all(load["running"] == load["waiting"] == load["in_flight"] == 0 for load in loads):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"engines still busy after the client left: {loads}")
    generated = pd.load("decode")["generation_tokens"] - before
    assert 1 <= generated < max_tokens - 300, f"{generated} of {max_tokens} tokens generated"


def _leg(handle, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    head, payload = list(handle.options(stream=True).reply.remote("completions", body))
    return head.status, json.loads(payload)


def _prefilled(handles, body: dict[str, Any]) -> dict[str, Any]:
    status, reply = _leg(handles["prefill"], prefill_body(body))
    assert status == 200
    return reply["kv_transfer_params"]


def test_dashboard_reads_only_exported_series(pd: PD) -> None:
    """Every series the Grafana dashboard queries is exported: tokenfab's by the gateway, vLLM's
    by the Ray metrics agent; and vLLM's carry the replica ids the join to pools relies on."""
    for stream in (False, True):  # traffic of its own, so the test stands alone too
        response = pd.http.post("/completions", json={
            "model": MODEL, "prompt": "dashboard " + "green north " * 80, "max_tokens": 8,
            "stream": stream})
        assert response.status_code == 200, response.text
    time.sleep(2.2)  # replicas report every second
    # test_autoscaling checks the autoscaler's row; the MoE row's series need an MoE engine that
    # reports its experts (vLLM's GPU model runner: tests/unit/test_engine_metrics.py)
    wanted = dashboard_series(except_rows={"Autoscaler", "Mixture of experts"})
    gateway = scrape(f"{pd.root}/metrics")
    agent = f"http://{pd.topology.cluster.node_ip}:{pd.topology.cluster.metrics_export_port}"
    deadline = time.monotonic() + 60  # Ray's agent exports what engines recorded every few s
    while True:
        engine = scrape(f"{agent}/metrics")
        missing = wanted - {s.name for s in gateway} - {s.name for s in engine}
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert missing == set(), f"queried by the dashboard, exported by nobody: {sorted(missing)}"
    replicas = {s.labels["ReplicaId"]: s.labels["pool"] for s in gateway
                if s.name == "tokenfab_replica_info"}
    assert set(replicas.values()) == {"prefill", "decode"}
    ttft = {s.labels.get("ReplicaId") for s in engine
            if s.name == "ray_vllm_time_to_first_token_seconds_count" and s.value > 0}
    assert ttft & set(replicas), (ttft, replicas)  # vLLM's series join to this app's pools


# Series that no request of this module produces, each with the reason; a panel that reads only
# these may come back empty. Everything else the dashboard queries must return data.
EXPECTED_EMPTY = {
    "ray_tokenfab_autoscaler_desired_replicas": "this deployment's pools are fixed in size "
                                                "(test_autoscaling scrapes the autoscaler's series)",
    "ray_tokenfab_autoscaler_decisions_total": "as above",
    "tokenfab_replica_expert_routed_tokens_total": "no mixture-of-experts engine here",
    "tokenfab_gateway_rejections_total": "nothing is rejected (the panel shows rates above 0)",
    "tokenfab_pd_skipped_total": "present once a request skips the prefill leg",
    "tokenfab_pd_fallbacks_total": "present once a prefill leg fails",
}


def test_every_dashboard_panel_returns_data_from_a_real_prometheus(pd: PD, tmp_path) -> None:
    """Prometheus (Debian's package, fetched by scripts/setup.sh) scrapes the gateway and Ray's
    metrics agent each second while requests run; every query of every panel of the committed
    dashboard, as Grafana sends it, returns data, or reads only series EXPECTED_EMPTY lists."""
    binary = Path(sys.executable).parents[1] / "prometheus/usr/bin/prometheus"
    assert binary.exists(), f"{binary} is missing: scripts/setup.sh fetches it"
    gateway = httpx.URL(pd.root)
    cluster = pd.topology.cluster
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": "gateway", "metrics_path": f"{gateway.path.rstrip('/')}/metrics",
             "static_configs": [{"targets": [f"{gateway.host}:{gateway.port}"]}]},
            {"job_name": "ray", "static_configs": [
                {"targets": [f"{cluster.node_ip}:{cluster.metrics_export_port}"]}]}]}))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [str(binary), f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"))
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}/api/v1", trust_env=False, timeout=10)

    def scraping() -> bool:
        try:
            targets = api.get("/targets").json()["data"]["activeTargets"]
        except httpx.HTTPError:
            return False
        return len(targets) == 2 and all(t["health"] == "up" for t in targets)

    def without_data() -> list[str]:
        found = []
        for title, expr in dashboard_queries():
            query = expr.replace("$__rate_interval", "30s")
            answer = api.get("/query", params={"query": query}).json()
            assert answer["status"] == "success", (title, query, answer)
            if not answer["data"]["result"] and not series(parse(expr)) <= set(EXPECTED_EMPTY):
                found.append(f"{title}: {expr}")
        return found

    try:
        deadline = time.monotonic() + 60
        while not scraping():
            assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[-2000:]
            time.sleep(0.5)
        for i in range(12):  # traffic over a few scrapes: rates and histograms need two points
            for stream in (False, True):
                response = pd.http.post("/completions", json={
                    "model": MODEL, "prompt": f"panel {i} " + "green north " * 60,
                    "max_tokens": 8, "stream": stream})
                assert response.status_code == 200, response.text
            time.sleep(0.5)
        deadline = time.monotonic() + 60  # Ray's agent exports what engines recorded every few s
        while (missing := without_data()) and time.monotonic() < deadline:
            time.sleep(2)
        assert missing == [], f"panels with no data: {missing}"
    finally:
        api.close()
        server.terminate()
        server.wait(10)


def test_unreachable_side_channel_recomputes(pd: PD, handles) -> None:
    case, expected = PROMPTS[2], pd.reference["prompts"][2]
    body = {"model": MODEL, "prompt": case.prompt, "max_tokens": case.max_tokens,
            "temperature": 0, "return_token_ids": True}
    closed = reserve_side_channel("127.0.0.1").port  # free now, so nothing answers there
    params = _prefilled(handles, body) | {"remote_port": closed, "remote_engine_id": "gone"}
    before = pd.load("decode")
    status, reply = _leg(handles["decode"], decode_body(body, params))
    assert status == 200 and reply["choices"][0]["token_ids"] == expected["token_ids"]
    after = pd.load("decode")
    assert after["kv_transfer_failures"] > before["kv_transfer_failures"]
    assert after["prompt_tokens_transferred"] == before["prompt_tokens_transferred"]


def test_prefill_replica_killed_between_prefill_and_decode(pd: PD, handles) -> None:
    case, expected = PROMPTS[1], pd.reference["prompts"][1]
    body = {"model": MODEL, "prompt": case.prompt, "max_tokens": case.max_tokens,
            "temperature": 0, "return_token_ids": True}
    params = _prefilled(handles, body)
    _kill_tree(pd.replicas()["prefill"]["pid"])
    status, reply = _leg(handles["decode"], decode_body(body, params))
    assert status == 200 and reply["choices"][0]["token_ids"] == expected["token_ids"]
    # With the prefill pool gone, the gateway falls back to decode-only and says so.
    fallbacks = pd.counters().get("fallbacks", 0)
    response = pd.http.post("/completions", json={
        "model": MODEL, "prompt": FALLBACK.prompt, "max_tokens": FALLBACK.max_tokens,
        "temperature": 0, "return_token_ids": True})
    assert response.status_code == 200
    assert response.json()["choices"][0]["token_ids"] == pd.reference["fallback"]["token_ids"]
    assert pd.counters()["fallbacks"] == fallbacks + 1


def _kill_tree(pid: int) -> None:
    """SIGKILL a replica process and its engine processes, as a crash would."""
    process = psutil.Process(pid)
    for member in [*process.children(recursive=True), process]:
        try:
            os.kill(member.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
