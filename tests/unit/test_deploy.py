"""Tests for the Serve application config of a topology and its inverse."""

from __future__ import annotations

from typing import Any

from orchestrator.config import Topology, parse_topology
from orchestrator.deploy import IMPORT_PATH, application_config, topology_of


def topology(main: int = 3, side: int = 1, **engine_args: Any) -> Topology:
    """Two CPU pools: `main` autoscales within 2..4, `side` has no bounds."""
    return parse_topology({
        "name": "app",
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
    assert (config["name"], config["route_prefix"], config["import_path"]) == ("app", "/llm", IMPORT_PATH)
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
