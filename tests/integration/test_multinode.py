"""Two Ray nodes with their own loopback addresses (127.0.0.2 and 127.0.0.3): prefill on one,
decode on the other. Requests, KV events and NIXL transfers cross nodes, every address comes from
Ray, and nothing listens on an address outside 127.0.0.0/8.

Why not the session's head on 127.0.0.1: a node joining a cluster needs Ray's multi-node mode,
and in that mode Ray 2.60 rewrites "127.0.0.1" in the head's address to the machine's other
interface and dials that. Addresses elsewhere in 127.0.0.0/8 are kept as given."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from orchestrator.cluster import orphaned_engine_processes
from orchestrator.config import load_topology
from orchestrator.status import gateway_url
from tests.integration.cases import PROMPTS
from tests.integration.conftest import (ROOT, TOKENFAB, event_credentials,
                                        listeners_outside_loopback, remove_app)

TOPOLOGY = ROOT / "tests/integration/topology-multinode.yaml"
HEAD, NODE2 = "127.0.0.2", "127.0.0.3"


def _cluster_processes() -> list[psutil.Process]:
    """This module's Ray processes (their command lines name its node addresses)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if (HEAD in cmdline or NODE2 in cmdline) and "ray" in cmdline:
            found.append(proc)
    return found


def _start(ray: str, *args: str) -> None:
    env = os.environ | {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
    result = subprocess.run([ray, "start", "--disable-usage-stats", "--num-cpus=1", *args],
                            capture_output=True, text=True, timeout=120, env=env,
                            start_new_session=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def multinode(reference: dict[str, Any]):
    topology = load_topology(TOPOLOGY)
    ray = str(Path(sys.executable).with_name("ray"))
    port = topology.cluster.address.rsplit(":", 1)[1]
    try:
        _start(ray, "--head", f"--port={port}", f"--node-ip-address={HEAD}",
               f"--dashboard-host={HEAD}", "--dashboard-port=8278")
        _start(ray, f"--address={topology.cluster.address}", f"--node-ip-address={NODE2}")
        result = subprocess.run([TOKENFAB, "up", str(TOPOLOGY), "--timeout", "600"], cwd=ROOT,
                                capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, result.stdout + result.stderr
        yield topology, reference
        remove_app(topology.name, topology.cluster.dashboard_url)
    finally:  # this cluster only: the session's, on 127.0.0.1, may be running beside it
        for proc in _cluster_processes():
            try:
                proc.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(_cluster_processes(), timeout=30)
        for proc in _cluster_processes():
            proc.kill()
        time.sleep(1)
        for pid in orphaned_engine_processes():
            os.kill(pid, signal.SIGKILL)


def _reports(root: str) -> dict[str, dict[str, Any]]:
    return {r["pool"]: r for r in httpx.get(f"{root}/tokenfab/replicas", trust_env=False).json()}


def test_pools_run_on_their_nodes_with_node_addresses(multinode) -> None:
    topology, _ = multinode
    reports = _reports(gateway_url(topology))
    assert reports["prefill"]["node_ip"] == HEAD
    assert reports["decode"]["node_ip"] == NODE2
    assert reports["decode"]["kv_events_endpoint"].startswith(f"tcp://{NODE2}:")
    assert reports["decode"]["kv_replay_endpoint"].startswith(f"tcp://{NODE2}:")
    assert reports["decode"]["side_channel"].startswith(f"{NODE2}:")
    assert reports["prefill"]["kv_events_endpoint"].startswith(f"tcp://{HEAD}:")


def test_request_crosses_nodes_and_equals_the_bare_engine(multinode) -> None:
    import zmq

    from router.events import BlockStored, decode_batch

    topology, reference = multinode
    root = gateway_url(topology)
    decode_events = _reports(root)["decode"]["kv_events_endpoint"]
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    event_credentials(topology).apply(socket, decode_events)  # CURVE, the application's keys
    socket.connect(decode_events)  # the decode engine's events, from the other node, over tcp
    time.sleep(0.5)
    index = max(range(len(PROMPTS)), key=lambda i: len(reference["prompts"][i]["prompt_token_ids"]))
    case, expected = PROMPTS[index], reference["prompts"][index]
    try:
        response = httpx.post(f"{root}/v1/completions", trust_env=False, timeout=120, json={
            "model": "tiny", "prompt": case.prompt, "max_tokens": case.max_tokens,
            "temperature": 0, "return_token_ids": True})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == expected["token_ids"]
        stored = []
        deadline = time.monotonic() + 15
        while not stored and time.monotonic() < deadline:
            if socket.poll(500, zmq.POLLIN):
                _topic, _seq, payload = socket.recv_multipart()
                stored += [e for e in decode_batch(payload).events if isinstance(e, BlockStored)]
        assert stored, f"no BlockStored event from the decode engine on {NODE2}"
    finally:
        context.destroy(linger=0)
    time.sleep(2.2)  # replicas report every second
    decode = _reports(root)["decode"]["load"]
    assert decode["kv_transfers"] >= 1 and decode["kv_transfer_failures"] == 0
    assert decode["prompt_tokens_transferred"] >= len(expected["prompt_token_ids"])
    assert httpx.get(f"{root}/tokenfab/pd", trust_env=False).json()["requests_disaggregated"] >= 1
    router = httpx.get(f"{root}/tokenfab/router", trust_env=False).json()["pools"]["prefill"]
    assert sum(r["cached_blocks"] for r in router["replicas"].values()) > 0  # events over tcp


def test_nothing_listens_outside_loopback(multinode) -> None:
    """Every listening socket of this user's processes is on 127.0.0.0/8, or a wildcard: in
    multi-node mode Ray's own daemons (GCS, raylets) bind every interface. On a single-node
    loopback cluster nothing does (test_serving)."""
    assert listeners_outside_loopback(wildcards=False) == []
