"""The ported routers (sim/baselines*.py) against the real ones: the same window through the real
sglang-router and vllm-router before 2 vLLM engines, and through the simulator with each port.

Real: two vLLM servers of the tiny model (one pinned core each, eager, block 32, 24MiB KV cache,
prefix caching on: h2h.py's engines), each logging which requests it received (engine_log.py, a
middleware: no hop is added), behind each router in turn; the h2h's window (116 requests sampled
by conversation root, 32 output tokens each) replayed at each rate with cold caches. Simulated:
the same requests, arrivals and rate through 2 engines of the `cpu-tiny` profile (fitted to
these engines by benchmarks/sim_fidelity.py) routed by the port. Per (router, rate):
- agreement: the share of requests the port sent to the same engine as the real router, under
  the better of the two ways of pairing the engines with the port's replicas (the engines are
  alike, and a router's worker order is its own);
- decision agreement: the real router's decisions replayed one at a time through the port
  (`sim.decisions`): before each request the port holds what the real router's earlier
  decisions left and the requests then in flight per engine, and chooses; the share it chose
  alike (one choice made differently no longer carries over to the later turns);
- hit rate: the engines' cached prompt tokens over prompt tokens, real (from usage) and
  simulated, and their difference (the target: within 0.03).

    .venv/bin/python benchmarks/port_fidelity.py [--rates 3.5,12] [--routers sglang,vllm-router]

Writes benchmarks/results/port_fidelity.{json,md} (routing_at_scale.py quotes the ports' lines).
Dynamo's KV router is not validated: it needs NATS, etcd and its own engine workers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.common.baseline import (Session, reset_prefix_caches, routed, start_engine,
                                        wait_ready)
from benchmarks.common.client import MAX_TOKENS, body, replay, warm_up
from benchmarks.common.cluster import tiny_model_dir
from benchmarks.common.engine_log import digest
from benchmarks.common.machine import prioritise_client
from benchmarks.common.results import RESULTS, TRACE, write
from benchmarks.common.traces import (BLOCK_TOKENS, MAX_BLOCKS, Prompts, sample_by_root,
                                      single_token_words)
from sim import params as profiles
from sim import workload
from sim.cluster import SimCluster
from sim.decisions import Decision
from sim.decisions import agreement as decision_agreement
from sim.engine import SimRequest
from sim.loop import EventLoop

MODEL = str(tiny_model_dir())
ENGINE_PORTS, ROUTER_PORT, METRICS_PORT = (8144, 8145), 8152, 8162
ROUTERS = {"sglang": ("sglang-router", "sglang:cache_aware"),
           "vllm-router": ("vllm-router", "vllm-router:cache_aware")}


def real_run(session: Session, system: str, urls: list[str], logs: Path, rows: list[dict],
             words: list[str], namespace: int, rate: float) -> dict[str, Any]:
    """The window through the real router: each request's engine (index into `urls`) and the
    hit rate the engines reported."""
    with routed(session, system, "cache_aware", ROUTER_PORT, METRICS_PORT, urls, logs) as url:
        warm_up(url, rows, Prompts(words, 90_000 + namespace))
        reset_prefix_caches(urls)
        for port in ENGINE_PORTS:
            (logs / f"requests-{port}.jsonl").write_text("")
        prompts = Prompts(words, namespace)
        results = asyncio.run(replay(url, rows, prompts, rate))
        reset_prefix_caches(urls)
    served = {}
    for index, port in enumerate(ENGINE_PORTS):
        for line in (logs / f"requests-{port}.jsonl").read_text().splitlines():
            served[json.loads(line)["prompt"]] = index
    engines = [served.get(digest(body(prompts.prompt(row))["prompt"])) for row in rows]
    usages = [r["usage"] for r in results if r["status"] == 200]
    prompt = sum(u.get("prompt_tokens", 0) for u in usages)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages)
    return {"engines": engines, "hit_rate": cached / prompt if prompt else 0.0,
            "failed": sum(r["status"] != 200 for r in results),
            "sent": [r["sent"] for r in results], "done": [r["done"] for r in results]}


def window(rows: list[dict], rate: float) -> list[SimRequest]:
    """The window's requests as the simulator sees them: a prompt's blocks are its hash ids."""
    return workload.requests(rows, rate, tokens_per_id=BLOCK_TOKENS, block_size=BLOCK_TOKENS,
                             max_prompt_tokens=MAX_BLOCKS * BLOCK_TOKENS + 1,
                             output_tokens=lambda row: MAX_TOKENS, exact_ids=True)


def simulated(port: str, rows: list[dict], rate: float) -> dict[str, Any]:
    """The window through the port in the simulator: each request's engine and the hit rate."""
    params = profiles.load("cpu-tiny")
    assert params.block_size == BLOCK_TOKENS, "the profile's blocks are the engines' blocks"
    requests = window(rows, rate)
    loop = EventLoop()
    sim = SimCluster(loop, params, port, 2)
    sim.submit(requests)
    loop.run()
    prompt = sum(r.prompt_tokens for r in requests)
    return {"engines": [int(r.replica[1:]) for r in requests],
            "hit_rate": sum(r.cached_tokens for r in requests) / prompt if prompt else 0.0}


def agreement(real: list[int | None], sim: list[int], crosswise: bool | None = None
              ) -> tuple[float, bool]:
    """The share of requests placed alike, and whether the engines are paired crosswise: as
    `crosswise` says, or the better pairing where it is None.

    Example: real [0, 0, 1, None], sim [1, 1, 0, 0] -> 0.75, crosswise."""
    same = sum(a == b for a, b in zip(real, sim))
    crossed = sum(a is not None and a != b for a, b in zip(real, sim))
    if crosswise is None:
        crosswise = crossed > same
    return (crossed if crosswise else same) / len(real), crosswise


def window_rows() -> list[dict]:
    return sample_by_root(TRACE, 0.03, 0)


def replay_decisions(record: dict[str, Any], rows: list[dict]) -> None:
    """Adds to `record` the real router's decisions replayed one at a time through the port
    (`sim.decisions`): the decision agreement, the port's choices, and their pairing."""
    requests = window(rows, record["rate_rps"])
    if len(requests) != len(record["real_sent"]):
        raise ValueError(f"{len(record['real_sent'])} requests recorded, the window has "
                         f"{len(requests)}")
    decisions = [Decision(tuple(r.block_hashes), r.prompt_tokens, sent, done, engine)
                 for r, sent, done, engine in zip(requests, record["real_sent"],
                                                  record["real_done"], record["real_engines"])]
    share, choices, crosswise = decision_agreement(record["policy"], BLOCK_TOKENS, decisions)
    record.update(decision_agreement=share, decision_choices=choices,
                  decision_crosswise=crosswise)


def finish(result: dict[str, Any], out: Path) -> None:
    """Both agreements (the whole replay's under the pairing the decision replay found, which
    tells the router's worker order), then the results."""
    rows = window_rows()
    for record in result["records"]:
        if "real_sent" in record:
            replay_decisions(record, rows)
        record["agreement"], record["crosswise"] = agreement(
            record["real_engines"], record["sim_engines"], record.get("decision_crosswise"))
    result["ports"] = [{"policy": r["policy"], "rate_rps": r["rate_rps"],
                        "agreement": r["agreement"],
                        "decision_agreement": r.get("decision_agreement"),
                        "sim_hit_rate": r["sim_hit_rate"],
                        "real_hit_rate": r["real_hit_rate"], "hit_rate_diff": r["hit_rate_diff"]}
                       for r in result["records"]]
    print(write(out, result, markdown))


def markdown(result: dict[str, Any]) -> str:
    lines = ["# The ported routers against the real ones, at 2 engines", "",
             f"`{result['command']}`. {result['requests']} requests (the h2h's window), 2 engines "
             "of the tiny model; simulated with the `cpu-tiny` profile. Run took "
             f"{result['wall_s'] / 60:.1f} min.", "",
             "Agreement: the share of requests the port, replaying the whole window, sent to "
             "the same engine as the real router. Decision agreement: the same share with the "
             "port choosing before each request from the real router's own history (the prompts "
             "it had sent where, and the requests then in flight on each engine), so that one "
             "different choice does not carry over to every later turn of its conversation "
             "(`sim/decisions.py`).", "",
             "| router | port | load | agreement | decision agreement | hit rate, real | "
             "hit rate, port | difference | within 0.03 |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in result["records"]:
        decided = r.get("decision_agreement")
        lines.append(f"| {r['router']} | {r['policy']} | {r['rate_rps']:g} req/s | "
                     f"{r['agreement']:.3f} | "
                     f"{'-' if decided is None else format(decided, '.3f')} | "
                     f"{r['real_hit_rate']:.3f} | {r['sim_hit_rate']:.3f} "
                     f"| {r['hit_rate_diff']:+.3f} | "
                     f"{'yes' if abs(r['hit_rate_diff']) <= 0.03 else 'no'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="3.5,12")
    parser.add_argument("--routers", default="sglang,vllm-router")
    parser.add_argument("--logs", default="/tmp/port-fidelity-logs")
    parser.add_argument("--out", default=str(RESULTS / "port_fidelity.json"))
    parser.add_argument("--report", default="", help="only recompute the agreement and rewrite "
                        "the report from this results JSON")
    args = parser.parse_args()
    if args.report:
        finish(json.loads(Path(args.report).read_text()), Path(args.out))
        return
    prioritise_client(-10)
    began = time.monotonic()
    rows = window_rows()
    words = single_token_words(MODEL)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    session = Session()
    urls = [f"http://127.0.0.1:{port}" for port in ENGINE_PORTS]
    records = []
    try:
        engines = [start_engine(session, MODEL, core, port, 24 << 20, logs,
                                ("--middleware", "benchmarks.common.engine_log.RequestLog"),
                                {"ENGINE_REQUEST_LOG": str(logs / f"requests-{port}.jsonl")})
                   for core, port in enumerate(ENGINE_PORTS)]
        for url, engine in zip(urls, engines):
            wait_ready(url, engine, 900, "/health")
        for k, name in enumerate(args.routers.split(",")):
            system, port = ROUTERS[name]
            for i, rate in enumerate(float(r) for r in args.rates.split(",")):
                real = real_run(session, system, urls, logs, rows, words, 1 + 10 * k + i, rate)
                sim = simulated(port, rows, rate)
                share, crosswise = agreement(real["engines"], sim["engines"])
                records.append({"router": system, "policy": port, "rate_rps": rate,
                                "agreement": share, "crosswise": crosswise,
                                "unlogged": sum(e is None for e in real["engines"]),
                                "real_hit_rate": real["hit_rate"], "sim_hit_rate": sim["hit_rate"],
                                "hit_rate_diff": sim["hit_rate"] - real["hit_rate"],
                                "failed": real["failed"], "real_engines": real["engines"],
                                "sim_engines": sim["engines"], "real_sent": real["sent"],
                                "real_done": real["done"]})
                print({k: v for k, v in records[-1].items() if k not in
                       ("real_engines", "sim_engines", "real_sent", "real_done")})
    finally:
        session.close()
    result = {"command": "python benchmarks/port_fidelity.py --rates " + args.rates
              + " --routers " + args.routers, "requests": len(rows), "records": records,
              "wall_s": time.monotonic() - began}
    finish(result, Path(args.out))


if __name__ == "__main__":
    main()
