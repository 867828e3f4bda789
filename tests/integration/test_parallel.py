"""Engines split across ranks: a replica with two data-parallel ranks, each a routing target
with its own KV cache and event stream (topology-dp.yaml), and a tiny mixture-of-experts model
(topology-moe.yaml). Both against a bare vLLM engine's greedy outputs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchestrator.config import Topology, load_topology
from orchestrator.status import gateway_url
from tests.integration.cases import CHATS, PROMPTS
from tests.integration.conftest import ROOT, TOKENFAB, remove_app, up

DP = ROOT / "tests/integration/topology-dp.yaml"
MOE = ROOT / "tests/integration/topology-moe.yaml"
BLOCK = 128  # the CPU backend's KV block size


def _post(root: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{root}{path}", json=body, timeout=120, trust_env=False)


def _get(root: str, path: str) -> Any:
    response = httpx.get(f"{root}{path}", timeout=30, trust_env=False)
    assert response.status_code == 200, response.text
    return response.json()


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _assert_equal_to_reference(root: str, model: str, reference: dict[str, Any]) -> None:
    for case, expected in zip(PROMPTS, reference["prompts"], strict=True):
        response = _post(root, "/v1/completions", {
            "model": model, "prompt": case.prompt, "max_tokens": case.max_tokens,
            "temperature": 0, "return_token_ids": True})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["prompt_token_ids"] == expected["prompt_token_ids"], case.id
        assert (choice["token_ids"], choice["text"]) == (expected["token_ids"], expected["text"]), \
            case.id
    for case, expected in zip(CHATS, reference["chats"], strict=True):
        response = _post(root, "/v1/chat/completions", {
            "model": model, "messages": case.messages, "max_tokens": case.max_tokens,
            "temperature": 0, "return_token_ids": True})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["token_ids"] == expected["token_ids"], case.id
        assert body["choices"][0]["message"]["content"] == expected["text"], case.id


# -- data parallelism ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dp(ray_cluster) -> Topology:
    with up(DP) as topology:
        yield topology


def _ranks(root: str) -> tuple[str, dict[int, dict[str, Any]]]:
    """The one replica's id and its ranks' reports (load, event endpoints) by rank."""
    [replica] = _get(root, "/tokenfab/replicas")
    return replica["replica_id"], {rank["rank"]: rank for rank in replica["ranks"]}


def test_dp_replica_serves_outputs_equal_to_the_bare_engine(dp: Topology,
                                                            reference: dict[str, Any]) -> None:
    root = gateway_url(dp)
    _assert_equal_to_reference(root, dp.model.name, reference)
    replica, ranks = _ranks(root)
    assert sorted(ranks) == [0, 1]
    # each rank's own cache: 64 MiB of 128-token blocks at 4 KiB a token (4 layers x K and V x
    # 2 KV heads x 64 dims x float32); vLLM's front end reports both ranks' together
    [report] = _get(root, "/tokenfab/replicas")
    assert report["kv_blocks"] == (64 << 20) // (BLOCK * 4096) == 128
    assert report["max_num_seqs"] == 24  # each rank's batch, as the engine was configured
    routed = _get(root, "/tokenfab/router")["pools"]["main"]["replicas"]
    assert sorted(routed) == [f"{replica}/dp0", f"{replica}/dp1"]  # the router's targets


def test_a_shared_prefix_lands_on_the_rank_that_holds_it(dp: Topology) -> None:
    """New prefixes until both ranks hold blocks in the router's map (each from its own rank's
    events); then each prefix's follow-ups run where its blocks are, as the engine confirms: its
    cached tokens, counted on that rank."""
    root = gateway_url(dp)
    replica, _ = _ranks(root)
    holders: dict[str, str] = {}  # prefix -> the target whose blocks it is
    for i in range(8):
        prefix = f"rank probe {i} " + " ".join(f"p{i}w{j % 41}" for j in range(260))
        first = _post(root, "/v1/completions", {"model": "tiny", "prompt": prefix + " one",
                                                "max_tokens": 2})
        assert first.status_code == 200, first.text
        full = first.json()["usage"]["prompt_tokens"] // BLOCK

        def holder() -> str | None:
            explained = _post(root, "/tokenfab/route/completions",
                              {"model": "tiny", "prompt": prefix + " two"}).json()["main"]
            held = [c["replica"] for c in explained["candidates"]
                    if c["cached_tokens"] >= BLOCK * (full - 1)]
            return held[0] if len(held) == 1 else None

        _wait(lambda: holder() is not None, 20, f"prefix {i}'s blocks in the map")
        holders[prefix] = holder()
        if len(set(holders.values())) == 2:
            break
    assert set(holders.values()) == {f"{replica}/dp0", f"{replica}/dp1"}, holders
    routed = _get(root, "/tokenfab/router")["pools"]["main"]["replicas"]
    assert all(routed[target]["cached_blocks"] > 0 and routed[target]["malformed_batches"] == 0
               for target in holders.values())

    for prefix, target in holders.items():
        rank = int(target.rsplit("/dp", 1)[1])
        before, cached = _ranks(root)[1], 0
        for turn in ("two", "three", "four"):
            response = _post(root, "/v1/completions", {"model": "tiny", "prompt": f"{prefix} {turn}",
                                                       "max_tokens": 2})
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= \
                BLOCK * (usage["prompt_tokens"] // BLOCK - 1)

        def hits(ranks: dict[int, dict[str, Any]], r: int) -> int:
            return ranks[r]["load"]["prompt_tokens_local_hit"]

        # every hit the answers report, counted by the holder's engine (reports lag up to 1 s)
        _wait(lambda: hits(_ranks(root)[1], rank) - hits(before, rank) >= cached, 10,
              f"{target}'s engine to count the hits")
        assert hits(_ranks(root)[1], rank) - hits(before, rank) == cached
        assert hits(_ranks(root)[1], 1 - rank) == hits(before, 1 - rank)  # none on the other


def test_an_adapter_runs_on_the_rank_the_router_chose(dp: Topology,
                                                     lora_reference: dict[str, Any]) -> None:
    """Requests for an adapter, each placed on a rank: vLLM's own output with the same
    LoRARequest, and the slots the router followed freed on every rank when they ended."""
    root = gateway_url(dp)
    for case, expected in zip(PROMPTS[:3], lora_reference["adapters"]["lora-0"], strict=False):
        response = _post(root, "/v1/completions", {
            "model": "lora-0", "prompt": f"{case.prompt}", "max_tokens": case.max_tokens,
            "temperature": 0, "return_token_ids": True})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == expected["token_ids"]
    _wait(lambda: _get(root, "/tokenfab/replicas")[0]["adapters"] == ["lora-0"], 5,
          "the replica to report the adapter its ranks hold")  # it reports every second
    [replica] = _get(root, "/tokenfab/replicas")
    adapters = _get(root, "/tokenfab/router")["pools"]["main"]["adapters"]
    assert set(adapters) <= {f"{replica['replica_id']}/dp{rank}" for rank in (0, 1)}
    assert adapters and all(entry["running"] == {} for entry in adapters.values())


def test_status_shows_each_rank(dp: Topology) -> None:
    root = gateway_url(dp)
    replica, _ = _ranks(root)
    result = subprocess.run([TOKENFAB, "status", "--json", "--dashboard", dp.cluster.dashboard_url],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    rows = {row["replica"]: row for row in json.loads(result.stdout[result.stdout.index("["):])}
    assert {f"{replica}/dp0", f"{replica}/dp1"} <= set(rows)
    assert rows[replica]["cores"] == "0,1"  # the replica holds both cores, one per rank
    assert all(rows[f"{replica}/dp{r}"]["cached_blocks"] > 0 for r in (0, 1))
    metrics = httpx.get(f"{root}/metrics", timeout=30, trust_env=False).text
    assert f'replica="{replica}/dp1"' in metrics


# -- mixture of experts ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_reference(dp: Topology, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Greedy outputs of a bare vLLM engine on the tiny MoE model, run once the data-parallel
    replica is gone (the cores are the MoE engines' then)."""
    remove_app(dp.name, dp.cluster.dashboard_url)
    topology = load_topology(MOE)
    for command in ([TOKENFAB, "model", "tiny", "--moe", "--out", topology.model.resolved_path,
                     "--if-missing"],
                    [sys.executable, "-m", "tests.integration.reference", str(MOE),
                     str(out := tmp_path_factory.mktemp("moe") / "reference.json")]):
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return json.loads(Path(out).read_text())


def test_moe_engine_serves_outputs_equal_to_the_bare_engine(moe_reference: dict[str, Any]) -> None:
    with up(MOE) as topology:
        _assert_equal_to_reference(gateway_url(topology), topology.model.name, moe_reference)


def test_moe_with_data_parallel_ranks_on_cpu_is_refused_by_name(tmp_path: Path) -> None:
    topology = MOE.read_text().replace("replicas: 1\n", "replicas: 1\n    parallel: {data: 2}\n") \
        .replace("cpus: 1,", "cpus: 2,")
    path = tmp_path / "moe-dp.yaml"
    path.write_text(topology)
    result = subprocess.run([TOKENFAB, "up", str(path)], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode != 0
    assert "pools.0.parallel.data (main)" in result.stderr + result.stdout
    assert "need GPUs" in result.stderr + result.stdout
