"""Tests for the Serve application config of a topology and its inverse."""

from __future__ import annotations

from typing import Any

from orchestrator.config import Topology, parse_topology
from orchestrator.deploy import IMPORT_PATH, application_config, topology_of


def topology(main: int = 3, side: int = 1, autoscaler: bool = False,
             **engine_args: Any) -> Topology:
    """Two CPU pools: `main` has bounds 2..4 (scaled by hand unless `autoscaler`), `side` none."""
    return parse_topology({
        "name": "app",
        "autoscaler": {"enabled": autoscaler},
        "model": {"name": "m", "path": "/models/m"},
        "engine_args": engine_args,
        "gateway": {"route_prefix": "/llm"},
        "pools": [
            {"name": "main", "replicas": main, "min_replicas": 2, "max_replicas": 4,
             "resources": {"kv_cache_bytes": "1MiB"}},
            {"name": "side", "replicas": side, "resources": {"kv_cache_bytes": "1MiB"}},
        ],
    })


def test_counts_travel_as_overrides() -> None:
    config = application_config(topology(main=3, side=1))
    # no Serve HTTP route: the gateway serves `gateway.route_prefix` itself
    assert (config["name"], config["route_prefix"], config["import_path"]) == ("app", None, IMPORT_PATH)
    assert config["args"]["topology"]["gateway"]["route_prefix"] == "/llm"
    assert config["deployments"] == [
        {"name": "pool-main", "num_replicas": 3},
        {"name": "pool-side", "num_replicas": 1},
    ]
    args_pools = config["args"]["topology"]["pools"]
    assert [(p["name"], p["replicas"]) for p in args_pools] == [("main", 2), ("side", 1)]


def test_args_topology_is_valid_and_at_lowest_counts() -> None:
    args = application_config(topology(main=4, side=3))["args"]["topology"]
    assert [p.replicas for p in parse_topology(args).pools] == [2, 1]


def test_round_trip() -> None:
    for original in (topology(main=3, side=1), topology(main=4, side=5), topology(main=2, side=2)):
        assert topology_of(application_config(original)) == original


def test_only_counts_differ_gives_identical_args() -> None:
    assert application_config(topology(main=2, side=1))["args"] == \
        application_config(topology(main=4, side=7))["args"]


def test_engine_args_change_args() -> None:
    assert application_config(topology(max_num_seqs=4))["args"] != \
        application_config(topology(max_num_seqs=8))["args"]


def test_autoscaled_pool_count_belongs_to_serve() -> None:
    from orchestrator.app import autoscaling_config

    original = topology(main=3, side=1, autoscaler=True)
    config = application_config(original)
    assert config["deployments"] == [{"name": "pool-main"}, {"name": "pool-side", "num_replicas": 1}]
    assert [p["replicas"] for p in config["args"]["topology"]["pools"]] == [3, 1]  # initial
    assert topology_of(config) == original
    scaling = autoscaling_config(original, original.pools[0])
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["initial_replicas"]) == (2, 4, 3)
    assert scaling["policy"]["policy_function"] == "autoscaler.serve_policy:PoolPolicy"
    kwargs = scaling["policy"]["policy_kwargs"]
    assert (kwargs["app"], kwargs["pool"], kwargs["role"]) == ("app", "main", "unified")
    from autoscaler.policy import Targets

    Targets(**{k: v for k, v in kwargs.items() if k not in ("app", "pool", "sink")})
    from autoscaler.records import load_sink
    from pools.registry import record_scale

    assert load_sink(kwargs["sink"]) is record_scale  # where decisions are kept


def test_ranks_placed_by_vllm_stay_on_the_pools_nodes() -> None:
    """With parallel.backend ray, vLLM places a replica's ranks on any node with free GPUs; the
    replica restricts it to the nodes that offer the pool's Ray resources (its worker group)."""
    from pools.deployment import nodes_offering

    nodes = [
        {"NodeManagerAddress": "10.0.0.3", "Alive": True, "Resources": {"GPU": 8, "tokenfab-decode": 1000}},
        {"NodeManagerAddress": "10.0.0.2", "Alive": True, "Resources": {"GPU": 8, "tokenfab-decode": 1000}},
        {"NodeManagerAddress": "10.0.0.4", "Alive": True, "Resources": {"GPU": 8, "tokenfab-prefill": 1000}},
        {"NodeManagerAddress": "10.0.0.5", "Alive": False, "Resources": {"GPU": 8, "tokenfab-decode": 1000}},
    ]
    assert nodes_offering({"tokenfab-decode": 1}, nodes) == ["10.0.0.2", "10.0.0.3"]
    assert nodes_offering({}, nodes) == ["10.0.0.2", "10.0.0.3", "10.0.0.4"]
