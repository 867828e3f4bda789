"""Prefill/decode disaggregation against unified engines, same cores, same engine count, one run.

Load: steady interactive streams (short prompts, streamed) plus a long prompt every few seconds.
On unified engines a long prefill stalls the decode steps of every stream beside it; with P/D the
long prefill runs on the prefill engine and decode streams keep their pace. Reports inter-token
latency (ITL) p50/p99, TTFT p50/p90 and output tokens/s per setup, the ratios, and KV transfer
throughput against a plain memory copy of the same bytes.

    .venv/bin/python benchmarks/pd_itl.py [--seconds 60]

The client runs in a scheduling group of its own at nice -10 (`machine.prioritise_client`, as
h2h.py's): the engines spin on the same 2 cores, and a client left in the shell's group waited
for a CPU 22-34 s of a 60 s load, which showed as bursts of tokens, TTFT p90 of 0.35-0.59 s and
output tokens/s 15-30% lower (against 2.3-2.6 s waited, TTFT p90 0.02 s, prioritised; P/D setup).
Each record says how long the client waited (`client_waited_s`).

Writes benchmarks/results/pd.json, pd.md and pd_itl.png. Needs the `bench` extra (matplotlib).
The page is rendered from the JSON alone (`markdown`), which records the command and arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.common.client import one_request
from benchmarks.common.cluster import TINY_MODEL, deployed, local_head, remove
from benchmarks.common.machine import prioritise_client, waited_for_cpu_s
from benchmarks.common.results import RESULTS, command, write
from orchestrator import cluster
from orchestrator.config import parse_topology
from tokenfab.stats import percentile

BASE = {
    "model": TINY_MODEL, "engine_args": {"enforce_eager": True},
    "gateway": {"host": "127.0.0.1", "port": 8020}, "cluster": local_head(6391, 8276),
}
RESOURCES = {"cpus": 1, "kv_cache_bytes": "256MiB"}
SETUPS = {
    "unified": BASE | {"name": "bench-unified", "pools": [
        {"name": "main", "role": "unified", "replicas": 2, "resources": RESOURCES}]},
    "pd": BASE | {"name": "bench-pd", "pools": [
        {"name": "prefill", "role": "prefill", "replicas": 1, "resources": RESOURCES},
        {"name": "decode", "role": "decode", "replicas": 1, "resources": RESOURCES}],
        "disaggregation": {"min_prompt_tokens": 256, "nixl_progress_delay_us": 1000}},
}
INTERACTIVE_STREAMS = 4
INTERACTIVE_TOKENS = 48
LONG_EVERY_S = 2.0
LONG_WORDS = 700  # about 1,750 tokens of the tiny model's tokenizer


async def interactive(client: httpx.AsyncClient, index: int, until: float, out: list) -> None:
    turn = 0
    while time.monotonic() < until:
        body = {"model": "tiny", "prompt": f"stream {index} turn {turn}: tell me a story",
                "max_tokens": INTERACTIVE_TOKENS, "ignore_eos": True, "stream": True}
        r = await one_request(client, body, "/completions")
        if r["status"] != 200:  # the run measures nothing once a stream fails: stop it
            raise RuntimeError(f"stream {index} turn {turn}: {r['status']} {r['error']}")
        out.append({"sent": r["sent"], "stamps": [r["sent"] + at for at, _ in r["chunks"]]})
        turn += 1


async def long_prompts(client: httpx.AsyncClient, until: float, out: list) -> None:
    words = ["river", "stone", "light", "market", "quiet", "engine", "paper", "green"]
    index = 0
    while time.monotonic() < until:
        prompt = f"document {index}: " + " ".join(words[(i * 7 + index) % 8]
                                                   for i in range(LONG_WORDS))
        sent = time.monotonic()
        response = await client.post("/completions", json={"model": "tiny", "prompt": prompt,
                                                             "max_tokens": 4, "ignore_eos": True})
        out.append({"sent": sent, "done": time.monotonic(), "status": response.status_code})
        index += 1
        await asyncio.sleep(max(0.0, LONG_EVERY_S - (time.monotonic() - sent)))


async def run_load(base_url: str, seconds: float) -> dict[str, Any]:
    streams: list[dict] = []
    longs: list[dict] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=300, trust_env=False) as client:
        await client.post("/completions",
                          json={"model": "tiny", "prompt": "warm up", "max_tokens": 4})
        started, waited = time.monotonic(), waited_for_cpu_s()
        until = started + seconds
        await asyncio.gather(long_prompts(client, until, longs),
                             *(interactive(client, i, until, streams)
                               for i in range(INTERACTIVE_STREAMS)))
    return {"started": started, "streams": streams, "longs": longs,
            "elapsed": time.monotonic() - started, "client_waited_s": waited_for_cpu_s() - waited}


def summarize(setup: str, load: dict[str, Any]) -> dict[str, Any]:
    """ITL is taken per request, as its mean gap between tokens after the first: on two busy cores
    the client receives tokens in bursts, so single gaps measure the relay, not the engine. The
    worst single gap of each request (`stall`) shows the pauses a long prefill causes."""
    done = [s["stamps"] for s in load["streams"] if len(s["stamps"]) > 1]
    itl = [(stamps[-1] - stamps[0]) / (len(stamps) - 1) for stamps in done]
    stall = [max(b - a for a, b in zip(stamps, stamps[1:])) for stamps in done]
    ttft = [s["stamps"][0] - s["sent"] for s in load["streams"] if s["stamps"]]
    tokens = sum(len(s["stamps"]) for s in load["streams"]) + 4 * len(load["longs"])
    q = percentile
    return {"setup": setup, "itl_p50_s": q(itl, 50), "itl_p99_s": q(itl, 99),
            "stall_p50_s": q(stall, 50), "stall_p99_s": q(stall, 99),
            "ttft_p50_s": q(ttft, 50), "ttft_p90_s": q(ttft, 90),
            "output_tok_s": tokens / load["elapsed"], "long_prompts": len(load["longs"]),
            "interactive_requests": len(load["streams"]),
            "client_waited_s": load["client_waited_s"]}


def itl_series(load: dict[str, Any]) -> tuple[list[float], list[float]]:
    points = sorted((b - load["started"], b - a) for s in load["streams"]
                    for a, b in zip(s["stamps"], s["stamps"][1:]))
    return [t for t, _ in points], [v * 1000 for _, v in points]


def transfers(base_root: str) -> list[dict[str, Any]]:
    """KV transfer throughput for several prompt sizes (from the decode engine's own NIXL stats)
    against numpy copying the same number of bytes."""
    records = []
    vocab = ["stone", "river", "light", "paper", "green", "north", "cloud", "silver", "table"]
    for index, words in enumerate((60, 250, 500, 760)):
        before = _decode_load(base_root)
        # A fresh first word each time: no prefix of an earlier prompt is cached on either side.
        prompt = " ".join(vocab[(i * (index + 2) + index) % len(vocab)] for i in range(words))
        prompt = f"{vocab[index]}{index} transfer {prompt}"
        httpx.post(f"{base_root}/v1/completions", trust_env=False, timeout=120,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
        after = _decode_load(base_root)
        moved = after["kv_transfer_bytes"] - before["kv_transfer_bytes"]
        seconds = after["kv_transfer_seconds"] - before["kv_transfer_seconds"]
        if moved and seconds:
            records.append({"bytes": moved, "nixl_gbps": moved / seconds / 1e9,
                            "memcpy_gbps": _memcpy_gbps(moved)})
    return records


def _decode_load(base_root: str) -> dict[str, Any]:
    time.sleep(2.2)
    reports = httpx.get(f"{base_root}/tokenfab/replicas", trust_env=False).json()
    return next(r["load"] for r in reports if r["pool"] == "decode")


def _memcpy_gbps(size: int, repeats: int = 20) -> float:
    source, target = np.ones(size, dtype=np.uint8), np.empty(size, dtype=np.uint8)
    best = min(_timed_copy(source, target) for _ in range(repeats))
    return size / best / 1e9


def _timed_copy(source: np.ndarray, target: np.ndarray) -> float:
    started = time.perf_counter()
    np.copyto(target, source)
    return time.perf_counter() - started


def plot(series: dict[str, tuple[list[float], list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for setup, (times, itl_ms) in series.items():
        ax.plot(times, itl_ms, ".", markersize=3, alpha=0.6, label=setup)
    ax.set_xlabel("time since load start (s)")
    ax.set_ylabel("inter-token latency (ms)")
    ax.set_yscale("log")
    ax.set_title("Interactive streams beside periodic long prompts: unified vs prefill/decode")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(result: dict[str, Any]) -> str:
    records, transfer = result["records"], result["transfer"]
    lines = [f"# Prefill/decode disaggregation vs unified engines "
             f"({result['args']['seconds']:g} s of load per setup)",
             "", "2 CPU cores; unified: 2 replicas routed least-loaded; pd: 1 prefill + 1 decode. "
             f"{INTERACTIVE_STREAMS} streaming clients ({INTERACTIVE_TOKENS} tokens each turn) "
             f"plus a ~1,750-token prompt every {LONG_EVERY_S:g} s. Reproduce: "
             f"`{result['command']}`.",
             "ITL: each request's mean gap between tokens after the first (client side), p50/p99 "
             "over requests; stall: each request's longest single gap. The p99s and stalls are "
             "where long prefills show.",
             "The client runs in a scheduling group of its own at nice "
             f"{result['scheduling']['client_nice']} (`prioritise_client` in machine.py); "
             "client waited: the seconds its event loop was "
             "ready to run but waited for a CPU during the load (its latencies are late by that "
             "much, not the system's).",
             "", "| setup | ITL p50 (ms) | ITL p99 (ms) | stall p50 (ms) | stall p99 (ms) | "
             "TTFT p50 (ms) | TTFT p90 (ms) | output tok/s | client waited (s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        lines.append(f"| {r['setup']} | {1000 * r['itl_p50_s']:.1f} | "
                     f"{1000 * r['itl_p99_s']:.1f} | "
                     f"{1000 * r['stall_p50_s']:.1f} | {1000 * r['stall_p99_s']:.1f} | "
                     f"{1000 * r['ttft_p50_s']:.1f} | {1000 * r['ttft_p90_s']:.1f} | "
                     f"{r['output_tok_s']:.1f} | {r['client_waited_s']:.1f} |")
    by = {r["setup"]: r for r in records}
    pd, unified = by["pd"], by["unified"]
    lines += ["", f"ITL p99 pd/unified = {pd['itl_p99_s'] / unified['itl_p99_s']:.2f}; "
              f"throughput pd/unified = {pd['output_tok_s'] / unified['output_tok_s']:.2f}.",
              "", "![ITL over time](pd_itl.png)", "",
              "## KV transfer throughput (NIXL, UCX over loopback)",
              "", "Bytes and seconds as the decode engine's NixlConnector reports them for one "
              "pull (prompts of ~300 to ~1,900 tokens; shorter ones skip the transfer); memcpy: "
              "numpy copying the same number of bytes, best of 20 (cache-resident at these sizes).",
              "", "| bytes | NIXL GB/s | memcpy GB/s | ratio |", "| --- | --- | --- | --- |"]
    for t in transfer:
        lines.append(f"| {t['bytes']} | {t['nixl_gbps']:.2f} | {t['memcpy_gbps']:.2f} | "
                     f"{t['nixl_gbps'] / t['memcpy_gbps']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--client-nice", type=int, default=-10,
                        help="the client's scheduling priority (see machine.prioritise_client)")
    args = parser.parse_args()
    scheduling = prioritise_client(args.client_nice)
    topologies = {name: parse_topology(doc, name) for name, doc in SETUPS.items()}
    cluster.start_head(topologies["pd"].cluster)
    records, series, transfer = [], {}, []
    try:
        for name, topology in topologies.items():
            print(f"{name}: deploying")
            root = deployed(topology)
            load = asyncio.run(run_load(f"{root}/v1", args.seconds))
            records.append(summarize(name, load))
            series[name] = itl_series(load)
            print(json.dumps(records[-1]))
            if name == "pd":
                transfer = transfers(root)
            remove(topology)
    finally:
        cluster.stop_ray(topologies["pd"].cluster.dashboard_url)
    result = {"command": command(), "args": vars(args), "records": records,
              "transfer": transfer, "scheduling": scheduling}
    print(write(RESULTS / "pd.json", result, markdown))
    plot(series, RESULTS / "pd_itl.png")  # from the raw streams, which the JSON lacks


if __name__ == "__main__":
    main()
