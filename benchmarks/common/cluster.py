"""A benchmark's deployment: its topology of the tiny model on its own local Ray head, deployed
and removed. Every real-engine benchmark builds its topology here, so they differ only in what
they set on purpose (pools, router, gateway, ports), and each gets a Ray head of its own ports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchestrator import deploy
from orchestrator.config import Topology, parse_topology
from orchestrator.status import gateway_url

TINY_MODEL_PATH = "~/.cache/tokenfab/models/tiny-llama"
TINY_MODEL = {"name": "tiny", "path": TINY_MODEL_PATH, "generate": "tiny", "dtype": "bfloat16",
              "max_model_len": 2048}


def tiny_model_dir() -> Path:
    return Path(TINY_MODEL_PATH).expanduser()


def local_head(port: int, dashboard_port: int, **settings: Any) -> dict[str, Any]:
    """The `cluster` section of a head on loopback at `port`, its dashboard at `dashboard_port`."""
    return {"node_ip": "127.0.0.1", "address": f"127.0.0.1:{port}",
            "dashboard_url": f"http://127.0.0.1:{dashboard_port}", "num_cpus": 2} | settings


def tiny_topology(name: str, pools: list[dict[str, Any]], *, gateway: dict[str, Any],
                  cluster: dict[str, Any], block_size: int | None = None,
                  model: dict[str, Any] | None = None, **sections: Any) -> Topology:
    """The tiny model (eager, as the tests run it) in `pools` behind a gateway on loopback;
    `model` overrides fields of the tiny model, `sections` are further topology sections."""
    engine_args: dict[str, Any] = {"enforce_eager": True}
    if block_size is not None:
        engine_args["block_size"] = block_size
    return parse_topology({
        "name": name, "model": TINY_MODEL | (model or {}), "engine_args": engine_args,
        "pools": pools, "gateway": {"host": "127.0.0.1"} | gateway, "cluster": cluster,
        **sections,
    }, f"benchmark topology {name}")


def deployed(topology: Topology) -> str:
    """Deploy `topology`, wait until every replica runs, return the gateway's base URL."""
    client = deploy.ServeClient(topology.cluster.dashboard_url)
    client.deploy(topology)
    deploy.wait_until_running(client, topology.name, 900, lambda line: print("  ", line))
    return gateway_url(topology)


def remove(topology: Topology) -> None:
    client = deploy.ServeClient(topology.cluster.dashboard_url)
    client.delete(topology.name)
    deploy.wait_until_gone(client, topology.name, 300)
