"""Tests for topology parsing: valid documents and the exact error lines of invalid ones."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import Topology, load_topology, parse_topology, routing_policy
from tokenfab.errors import TopologyError

TOPOLOGIES = Path(__file__).resolve().parents[2] / "deploy" / "topologies"
SOURCE = "t.yaml"
MINIMAL: dict[str, Any] = {
    "name": "t",
    "model": {"name": "m", "path": "/models/m"},
    "pools": [{"name": "main", "resources": {"kv_cache_bytes": "1MiB"}}],
}


def doc(**top: Any) -> dict[str, Any]:
    """MINIMAL with top-level fields replaced (a value of None removes the field)."""
    data = copy.deepcopy(MINIMAL) | top
    return {key: value for key, value in data.items() if value is not None}


def pool(**fields: Any) -> dict[str, Any]:
    """The minimal pool with fields replaced."""
    return copy.deepcopy(MINIMAL["pools"][0]) | fields


def with_pool(**fields: Any) -> dict[str, Any]:
    return doc(pools=[pool(**fields)])


MOE = {"name": "m", "path": "/models/m", "generate": "tiny-moe"}


def cpu(kv: Any) -> dict[str, Any]:
    return {"kv_cache_bytes": kv}


# (document, the pool's (replicas, min_replicas, max_replicas, gpus, kv_cache_bytes))
VALID: list[Any] = [
    pytest.param(MINIMAL, (1, None, None, 0, 1_048_576), id="minimal"),
    pytest.param(with_pool(replicas=3, min_replicas=2, max_replicas=4), (3, 2, 4, 0, 1_048_576),
                 id="min-max-replicas"),
    pytest.param(with_pool(replicas=1, min_replicas=0), (1, 0, None, 0, 1_048_576), id="min-zero"),
    pytest.param(with_pool(resources={"gpus": 1}), (1, None, None, 1, None), id="gpu-without-kv"),
    pytest.param(with_pool(resources=cpu("512MiB")), (1, None, None, 0, 536_870_912), id="512MiB"),
    pytest.param(with_pool(resources=cpu("0.5GiB")), (1, None, None, 0, 536_870_912), id="0.5GiB"),
    pytest.param(with_pool(resources=cpu(2_000_000)), (1, None, None, 0, 2_000_000), id="int-bytes"),
    pytest.param(with_pool(resources=cpu("2GB")), (1, None, None, 0, 2_000_000_000), id="2GB"),
    pytest.param(with_pool(resources=cpu("1 KiB")), (1, None, None, 0, 1024), id="space-KiB"),
    pytest.param(with_pool(resources=cpu("3k")), (1, None, None, 0, 3000), id="bare-k"),
    pytest.param(with_pool(resources={"cpus": 0.5, "kv_cache_bytes": "1MiB"}),
                 (1, None, None, 0, 1_048_576), id="half-a-cpu"),
]


@pytest.mark.parametrize(("data", "expected"), VALID)
def test_valid_topologies(data: dict[str, Any], expected: tuple[Any, ...]) -> None:
    topology = parse_topology(data, SOURCE)
    (only,) = topology.pools
    got = (only.replicas, only.min_replicas, only.max_replicas,
           only.resources.gpus, only.resources.kv_cache_bytes)
    assert got == expected


def test_minimal_topology_defaults() -> None:
    topology = parse_topology(MINIMAL, SOURCE)
    assert (topology.name, topology.model.dtype, topology.model.max_model_len) == ("t", "auto", 2048)
    assert (topology.pools[0].role, topology.gateway.port, topology.gateway.max_body_bytes) == (
        "unified", 8000, 1_048_576)
    assert topology.pool("main") is topology.pools[0]


OWNED = "max_model_len is set by tokenfab: use model.max_model_len"
INVALID: list[Any] = [
    pytest.param(doc(colour="red"), ["colour: Extra inputs are not permitted"], id="unknown-top-field"),
    pytest.param(with_pool(resources={"kv_cache_bytes": 1, "gpu": 1}),
                 ["pools.0.resources.gpu: Extra inputs are not permitted"], id="unknown-resource-field"),
    pytest.param(with_pool(role="encode"),
                 ["pools.0.role: Input should be 'unified', 'prefill' or 'decode'"], id="bad-role"),
    pytest.param(with_pool(replicas=0),
                 ["pools.0.replicas: Input should be greater than or equal to 1"], id="replicas-0"),
    pytest.param(with_pool(replicas=5, min_replicas=1, max_replicas=4),
                 ["pools.0: replicas=5 is above max_replicas=4"],
                 id="replicas-above-max"),
    pytest.param(with_pool(replicas=1, min_replicas=2, max_replicas=4),
                 ["pools.0: replicas=1 is below min_replicas=2"],
                 id="replicas-below-min"),
    pytest.param(with_pool(min_replicas=3, max_replicas=2),
                 ["pools.0: min_replicas=3 is larger than max_replicas=2"], id="min-above-max"),
    pytest.param(doc(pools=[pool(), pool()]),
                 ["pools: pool names must be unique, got ['main', 'main']"], id="duplicate-pools"),
    pytest.param(with_pool(role="prefill"),
                 ["pools: a prefill pool needs a decode pool and the other way round"],
                 id="prefill-without-decode"),
    pytest.param(with_pool(role="decode"),
                 ["pools: a prefill pool needs a decode pool and the other way round"],
                 id="decode-without-prefill"),
    pytest.param(with_pool(resources={}),
                 ["pools.0: resources.kv_cache_bytes is required on CPU (gpus: 0)"],
                 id="cpu-without-kv"),
    pytest.param(doc(engine_args={"max_model_len": 10}), [f"engine_args: {OWNED}"],
                 id="owned-arg-top-level"),
    # The pool's index is lost: the line cannot tell which pool (see the report).
    pytest.param(with_pool(engine_args={"max_model_len": 10}), [f"pools.0.engine_args: {OWNED}"],
                 id="owned-arg-in-pool"),
    pytest.param(with_pool(resources=cpu("12 parsecs")),
                 ["pools.0.resources.kv_cache_bytes: expected a byte size such as 512MiB or 2GiB, "
                  "got '12 parsecs'"], id="bad-byte-size"),
    pytest.param(with_pool(resources=cpu(0)),
                 ["pools.0.resources.kv_cache_bytes: Input should be greater than 0"], id="zero-bytes"),
    pytest.param(with_pool(resources=cpu(True)),
                 ["pools.0.resources.kv_cache_bytes: expected a byte size such as 512MiB, "
                  "not a boolean"], id="boolean-bytes"),
    pytest.param(with_pool(name="Main_Pool"),
                 ["pools.0.name: String should match pattern '^[a-z][a-z0-9-]{0,30}$'"],
                 id="bad-pool-name"),
    pytest.param([MINIMAL], ["(top level): expected a mapping of fields"], id="list-document"),
    pytest.param(None, ["(top level): expected a mapping of fields"], id="empty-document"),
    pytest.param(doc(model=None), ["(top level): model: field required (or models, to serve "
                                   "several)"], id="missing-model"),
    pytest.param(doc(models=[MINIMAL["model"]]), ["(top level): model and models: set one "
                                                  "(model for one, models for several)"],
                 id="model-and-models"),
    pytest.param(doc(model=None, models=[{"name": "a", "path": "/a"}, {"name": "a", "path": "/b"}],
                     pools=[pool(model="a")]),
                 ["(top level): models: the name 'a' is used twice (models and their adapters "
                  "share the `model` field of requests)"], id="two-models-one-name"),
    pytest.param(doc(model=None, models=[{"name": "a", "path": "/a"}, {"name": "b", "path": "/b"}],
                     pools=[pool(name="pa", model="a"), pool(name="pb", model="c")]),
                 ["(top level): pools.1.model (pb): no model 'c' (models: ['a', 'b'])"],
                 id="pool-names-unknown-model"),
    pytest.param(doc(model=None, models=[{"name": "a", "path": "/a"}, {"name": "b", "path": "/b"}],
                     pools=[pool(name="pa", model="a"), pool(name="pb")]),
                 ["(top level): pools.1.model (pb): name the model this pool serves, one of "
                  "['a', 'b']"], id="pool-without-model-of-several"),
    pytest.param(doc(model=None, models=[{"name": "a", "path": "/a"}, {"name": "b", "path": "/b"}],
                     pools=[pool(name="pa", model="a")]),
                 ["(top level): models.1 (b): no pool serves it"], id="model-without-pool"),
    pytest.param(doc(model=None, models=[{"name": "a", "path": "/a"}, {"name": "b", "path": "/b"}],
                     pools=[pool(name="pa", model="a"), pool(name="pb", model="b", role="prefill")]),
                 ["pools: a prefill pool needs a decode pool and the other way round (model b)"],
                 id="prefill-without-decode-of-a-model"),
    pytest.param(doc(model=MINIMAL["model"] | {"lora": {"adapters": [
        {"name": "m", "path": "/a"}]}}),
                 ["(top level): models: the name 'm' is used twice (models and their adapters "
                  "share the `model` field of requests)"], id="adapter-named-as-model"),
    pytest.param(doc(model=MINIMAL["model"] | {"lora": {"adapters": [
        {"name": "x", "path": "/a"}, {"name": "x", "path": "/b"}]}}),
                 ["model.lora: adapters: 'x' is declared twice"],
                 id="adapter-declared-twice"),
    pytest.param(doc(model=MINIMAL["model"] | {"lora": {"max_loras": 4, "max_cpu_loras": 2}}),
                 ["model.lora: max_cpu_loras (2) must be at least max_loras (4): a "
                  "batch's adapters are all loaded"], id="cpu-loras-under-loras"),
    pytest.param(doc(model=MINIMAL["model"] | {"lora": {"adapters": [
        {"name": "x", "path": "/a", "tenants": ["nobody"]}]}}),
                 ["(top level): model.lora.adapters.0.tenants (x): no tenant 'nobody' "
                  "(tenants: [])"], id="adapter-for-unknown-tenant"),
    pytest.param(doc(model=MINIMAL["model"] | {"lora": {"adapters": [
        {"name": "x", "path": "/a", "generate": 0}]}}),
                 ["(top level): model.lora.adapters.0.generate (x): tiny adapters are made for "
                  "the generated dense tiny model (generate: tiny)"], id="tiny-adapter-of-other"),
    pytest.param(with_pool(engine_args={"enable_lora": True}),
                 ["pools.0.engine_args: enable_lora is set by tokenfab: use model.lora"], id="enable-lora-is-owned"),
    pytest.param(doc(pools=[]),
                 ["pools: List should have at least 1 item after validation, not 0"], id="no-pools"),
    pytest.param(doc(autoscaler={"max_kv_usage": 1.5}),
                 ["autoscaler.max_kv_usage: Input should be less than or equal to 1"],
                 id="autoscaler-kv-above-one"),
    pytest.param(with_pool(parallel={"tensor": 2, "expert": True},
                           resources={"cpus": 2, "kv_cache_bytes": "1MiB"}),
                 ["pools.0: parallel.expert: GPU only (vLLM's CPU backend has no expert-parallel "
                  "MoE kernel); this pool runs on CPU (resources.gpus: 0)"], id="ep-on-cpu"),
    pytest.param(with_pool(parallel={"data": 2, "backend": "ray"},
                           resources={"cpus": 2, "kv_cache_bytes": "1MiB"}),
                 ["pools.0: parallel.backend: GPU only (vLLM's CPU backend has no Ray executor); "
                  "this pool runs on CPU (resources.gpus: 0)"], id="ray-ranks-on-cpu"),
    pytest.param(with_pool(parallel={"expert": True}, resources={"gpus": 1}),
                 ["pools.0: parallel.expert: expert parallelism needs more than one rank "
                  "(parallel.tensor x parallel.data > 1)"], id="ep-one-rank"),
    pytest.param(with_pool(parallel={"data": 2}, resources={"gpus": 1}),
                 ["pools.0: resources.gpus: 1 GPUs for parallel.tensor x parallel.data = 1 x 2 = "
                  "2 ranks; each rank takes one GPU"], id="gpus-not-ranks"),
    pytest.param(with_pool(parallel={"data": 2}, resources=cpu("1MiB")),
                 ["pools.0: resources.cpus: 1 for 2 ranks (parallel.tensor x parallel.data); "
                  "each rank needs a core"], id="a-core-per-rank"),
    pytest.param(with_pool(parallel={"data": 2}, resources={"cpus": 3, "kv_cache_bytes": "1MiB"}),
                 ["pools.0: resources.cpus: 3 pinned cores do not split evenly across 2 ranks "
                  "(parallel.tensor x parallel.data)"], id="cores-split-evenly"),
    pytest.param(doc(model=MOE, pools=[pool(parallel={"data": 2},
                                            resources={"cpus": 2, "kv_cache_bytes": "1MiB"})]),
                 ["(top level): pools.0.parallel.data (main): 2 data-parallel ranks of a "
                  "mixture-of-experts model need GPUs: vLLM's CPU backend cannot gather across "
                  "ranks for the experts (NotImplementedError in all_gatherv); on CPU an MoE model "
                  "runs as one rank, or split by parallel.tensor"], id="moe-ranks-on-cpu"),
    pytest.param(doc(model=MINIMAL["model"] | {"generate": "tiny"},
                     pools=[pool(parallel={"data": 2, "expert": True}, resources={"gpus": 2})]),
                 ["(top level): pools.0.parallel.expert (main): expert parallelism needs a "
                  "mixture-of-experts model; /models/m is dense"], id="ep-dense-model"),
    pytest.param(doc(model=MOE, engine_args={"enable_return_routed_experts": True}),
                 ["(top level): pools.0.engine_args.enable_return_routed_experts (main): vLLM "
                  "reports routed experts from its GPU model runner only (Model Runner V2, which "
                  "needs Triton); this pool runs on CPU (resources.gpus: 0)"],
                 id="routed-experts-on-cpu"),
    pytest.param(with_pool(engine_args={"data_parallel_size": 2}),
                 ["pools.0.engine_args: data_parallel_size is set by tokenfab: use "
                  "pools[].parallel.data"], id="owned-dp-arg"),
    pytest.param(doc(gateway={"colocate": True},
                     pools=[pool(name="p", role="prefill"), pool(name="d", role="decode")]),
                 ["(top level): gateway.colocate: the gateway is served from the replicas of a "
                  "single unified pool; this topology has ['p (prefill)', 'd (decode)']"],
                 id="colocate-pd"),
    pytest.param(doc(gateway={"colocate": True}, autoscaler={"enabled": True},
                     pools=[pool(replicas=1, min_replicas=0, max_replicas=3)]),
                 ["(top level): gateway.colocate: pool main may scale to zero replicas, and with "
                  "them the gateway: set min_replicas to 1 or more"], id="colocate-to-zero"),
    pytest.param(doc(gateway={"colocate": True}, autoscaler={"enabled": True},
                     auth={"enabled": True}, tenants=[{"name": "a", "api_keys": [
                         "sha256:" + "0" * 64], "limits": {"requests_per_minute": 3}}],
                     pools=[pool(replicas=1, min_replicas=1, max_replicas=4)]),
                 ["(top level): tenants.0.limits.requests_per_minute (a): 3 < the ingress "
                  "replicas (4) would refuse it forever: each ingress replica's share is under "
                  "one request"], id="colocate-rpm-below-max-replicas"),
    pytest.param(doc(gateway={"colocate": True, "replicas": 2}),
                 ["(top level): gateway.replicas: 2 with gateway.colocate: the pool's replicas "
                  "are the ingress replicas; leave it out"], id="colocate-gateway-replicas"),
    pytest.param(doc(autoscaler={"enabled": True, "rise_rps_per_s": 0.1},
                     pools=[pool(replicas=1, min_replicas=1, max_replicas=4)]),
                 ["(top level): autoscaler.rise_rps_per_s is kept in hand by the plan, which no "
                  "autoscaled pool has: set autoscaler.capacity_rps (or a pool's "
                  "autoscaling.capacity_rps)"], id="rise-without-plan"),
    pytest.param(doc(autoscaler={"enabled": True, "rise_rps_per_s": 0.1, "capacity_rps": 1},
                     pools=[pool(replicas=1, min_replicas=0, max_replicas=4)]),
                 ["(top level): autoscaler.rise_rps_per_s: pool main may scale to zero, and the "
                  "rise kept in hand would hold replicas while it is idle: set its min_replicas "
                  "to 1 or more"], id="rise-with-scale-to-zero"),
    pytest.param(doc(autoscaler={"enabled": True, "rise_rps_per_s": 0.1, "capacity_rps": 1,
                                 "policy": "ray_requests"},
                     pools=[pool(replicas=1, min_replicas=1, max_replicas=4)]),
                 ["(top level): autoscaler.rise_rps_per_s is kept in hand by tokenfab's plan: it "
                  "needs autoscaler.enabled and autoscaler.policy tokenfab"],
                 id="rise-with-ray-policy"),
    pytest.param(with_pool(role="encode", replicas=0),
                 ["pools.0.role: Input should be 'unified', 'prefill' or 'decode'",
                  "pools.0.replicas: Input should be greater than or equal to 1"], id="two-errors"),
]


@pytest.mark.parametrize(("data", "problems"), INVALID)
def test_invalid_topologies(data: Any, problems: list[str]) -> None:
    with pytest.raises(TopologyError) as caught:
        parse_topology(data, SOURCE)
    assert caught.value.problems == [f"{SOURCE}: {line}" for line in problems]
    assert str(caught.value) == "\n".join(caught.value.problems)


@pytest.mark.parametrize(("gateway", "expected"), [({}, 1), ({"replicas": 2}, 2),
                                                  ({"colocate": True}, 3)])
def test_ingress_replicas_share_the_tenants_limits(gateway: dict, expected: int) -> None:
    topology = parse_topology(doc(gateway=gateway, pools=[pool(replicas=3)]), SOURCE)
    assert topology.ingress_replicas() == expected


def test_load_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(TopologyError) as caught:
        load_topology(path)
    assert caught.value.problems == [f"{path}: cannot read: No such file or directory"]


def test_load_invalid_yaml(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("name: t\npools: [unclosed\n")
    with pytest.raises(TopologyError) as caught:
        load_topology(path)
    (problem,) = caught.value.problems
    assert problem.startswith(f"{path}: not valid YAML: ")


def test_load_names_the_file_in_field_errors(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: t\nmodel: {name: m, path: /m}\npools: [{name: main, replicas: 0}]\n")
    with pytest.raises(TopologyError) as caught:
        load_topology(path)
    assert caught.value.problems == [
        f"{path}: pools.0.replicas: Input should be greater than or equal to 1"]


@pytest.mark.parametrize("name", sorted(p.name for p in TOPOLOGIES.glob("*.yaml")))
def test_shipped_topologies_validate(name: str) -> None:
    assert isinstance(load_topology(TOPOLOGIES / name), Topology)


def test_shipped_topology_values() -> None:
    local = load_topology(TOPOLOGIES / "local.yaml")
    gpu = load_topology(TOPOLOGIES / "gpu-llama3-8b.yaml")
    assert (local.pools[0].resources.kv_cache_bytes, local.cluster.num_cpus) == (268_435_456, 2)
    assert (gpu.pools[0].replicas, gpu.pools[0].resources.gpus, gpu.cluster.node_ip) == (2, 1, None)


def test_parallel_shapes_that_run() -> None:
    """Dense data-parallel ranks on CPU cores; an MoE model with data and expert parallelism on
    GPUs, its ranks placed by vLLM across nodes."""
    dense = parse_topology(with_pool(parallel={"data": 2}, resources={
        "cpus": 2, "kv_cache_bytes": "1MiB"}), SOURCE).pools[0]
    assert (dense.parallel.data, dense.parallel.ranks) == (2, 2)
    topology = parse_topology(doc(model=MOE, pools=[
        pool(name="prefill", role="prefill", parallel={"data": 8, "expert": True},
             resources={"gpus": 8}),
        pool(name="decode", role="decode", resources={"gpus": 16},
             parallel={"data": 16, "expert": True, "backend": "ray"})]), SOURCE)
    wide = topology.pools[1]
    assert (wide.parallel.ranks, wide.parallel.expert, wide.resources.gpus) == (16, True, 16)
    # its ranks' KV events stay on their nodes: placed by load; an mp decode pool by the router
    assert [routing_policy(topology, p) for p in topology.pools] == ["kv_aware", "least_loaded"]
    local = parse_topology(doc(pools=[pool(name="p", role="prefill"),
                                      pool(name="d", role="decode")]), SOURCE)
    assert [routing_policy(local, p) for p in local.pools] == ["kv_aware", "kv_aware"]
    with pytest.raises(TopologyError, match=r"pools.0.parallel.backend \(main\): ray places "
                       "ranks on other nodes, where their KV events stay"):
        parse_topology(doc(model=MOE, pools=[pool(parallel={"data": 16, "backend": "ray"},
                                                  resources={"gpus": 16})]), SOURCE)
    assert parse_topology(doc(model=MOE, router={"policy": "least_loaded"}, pools=[pool(
        parallel={"data": 16, "backend": "ray"}, resources={"gpus": 16})]), SOURCE)


@pytest.mark.parametrize(("config", "moe"), [
    ({"num_local_experts": 8}, True), ({"num_experts": 60}, True), ({"n_routed_experts": 256}, True),
    ({"hidden_size": 256}, False), ({"num_experts": None}, False)])
def test_model_is_moe_from_its_config(tmp_path: Path, config: dict, moe: bool) -> None:
    import json

    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = parse_topology(doc(model={"name": "m", "path": str(tmp_path)}), SOURCE).model
    assert spec.is_moe() is moe
    assert parse_topology(doc(model={"name": "m", "path": "org/hub-id"}), SOURCE).model.is_moe() \
        is None  # nothing on this machine says
