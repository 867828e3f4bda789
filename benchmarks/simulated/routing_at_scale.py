"""Routing at 16-256 replicas against other routers' own algorithms, in simulation: goodput at a
TTFT target, latency at two loads, hit rate and load imbalance per policy.

Every policy routes the same requests through a simulated pool of engines of one GPU profile
(`sim.cluster.SimCluster`): tokenfab's policies with its real router code and defaults (a replica
takes no more requests at its engine's max_num_seqs in flight), the target below as the pool's
TTFT target (kv_aware skips replicas estimated past it; the ports have no such setting); the
others with their ports (`sim.baselines`: sglang-router 0.3.2 cache_aware, vllm-router 0.1.17 cache_aware, Dynamo's
KV router cost), round_robin as the reference. Two workloads with prefix sharing:
- `mooncake`: a Mooncake-format trace (`--trace`; one hash id per 512 tokens), tiled (each copy
  with ids of its own, its arrivals rotated: more conversations, the same shape of reuse, as
  benchmarks/simulated/simulator.py does) and cut to `--window-s` seconds of arrivals at the rate;
- `users`: chat users as a closed loop (`sim.users`): `--system-prompts` system prompts (2-8 ids,
  Zipf popularity) shared by multi-turn conversations (geometric turns, mean 4; each turn sends
  the whole conversation so far, one id of user text and one of the last answer more each time),
  each turn sent `--think-s` (mean, exponential) after the answer it follows has ended. The load
  is a number of users: a rate r stands for r x think-time users, and what they send (less, as
  answers take time) is the rate reported;
- `sessions`: the same conversations as an open loop: sessions starting as a Poisson stream,
  turns following after exponential think times of 30 s, then the whole trace squeezed to the
  rate, so that a turn can arrive before the answer it carries exists
  (docs/analysis/routing_at_scale-notes.md). Kept to reproduce earlier results.

The target: TTFT p90 at most `--slo-factor` times the floor's p90, the floor being each request
alone on an idle engine whose cache holds every block seen before it (no router can do better).
Goodput: per (workload, replicas, policy), the highest rate at which the TTFT p90 meets the target
and every request finishes, over `--window-s` seconds of arrivals (long enough that a rate past
capacity queues past the target), found by rates x1.5 from a start (per replica: `--start-rate`
at the first scale, then the best goodput of the scale before) until one misses, then
`--bisect` halvings between the last met and that one (down by /1.5 where the first misses). Then each policy is replayed at 50% and
90% of the best policy's goodput: TTFT p50/p90/p99, hit rate and imbalance (max over mean requests
on a replica, sampled each simulated second while any is busy, averaged).

    .venv/bin/python benchmarks/simulated/routing_at_scale.py [--replicas 16,64,256] [--workloads mooncake,sessions]
        [--policies round_robin,kv_aware,sglang:cache_aware,vllm-router:cache_aware,dynamo:kv]

Writes benchmarks/results/routing_at_scale.{json,md}; the ports' validation against the real
routers at 2 engines comes from benchmarks/results/port_fidelity.json when it exists.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import results
from benchmarks.common.results import RESULTS, ROOT, TRACE
from sim import params as profiles
from sim import workload
from sim.cluster import SimCluster
from sim.engine import SimRequest
from sim.loop import EventLoop
from sim.params import EngineParams
from sim.feeds import Closed, Feed, Fixed
from sim.users import Shape
from tokenfab.stats import percentile

POLICIES = "round_robin,kv_aware,sglang:cache_aware,vllm-router:cache_aware,dynamo:kv"
TOKENS_PER_ID = 512
BASELINES = ("sglang:cache_aware", "vllm-router:cache_aware", "dynamo:kv")
DEFAULT_OUT = RESULTS / "routing_at_scale.json"


# --- Workloads --------------------------------------------------------------------------------

def sessions(count: int, system_prompts: int, seed: int) -> list[dict[str, Any]]:
    """Mooncake-format rows of `count` requests: multi-turn sessions over shared system prompts.

    Example: a session on system prompt [0, 1] sends [0, 1, u1], then [0, 1, u1, a1, u2], ..."""
    rng = random.Random(seed)
    prompts = [list(range(1_000 * p, 1_000 * p + rng.randint(2, 8))) for p in range(system_prompts)]
    weights = [1 / (rank + 1) for rank in range(system_prompts)]  # Zipf, s = 1
    rows, serial, start_ms = [], 10**9, 0.0
    while len(rows) < count:
        start_ms += rng.expovariate(1 / 2_000)  # a session every 2 s of trace time
        history = list(rng.choices(prompts, weights)[0])
        at_ms, turns = start_ms, 1 + int(rng.expovariate(1 / 3))
        for _ in range(turns):
            history.append(serial)  # the user's next message
            rows.append({"timestamp": at_ms, "input_length": len(history) * TOKENS_PER_ID,
                         "output_length": rng.randint(64, 512), "hash_ids": list(history)})
            history.append(serial + 1)  # the answer, sent back with the next turn
            serial += 2
            at_ms += rng.expovariate(1 / 30_000)  # reading and typing
    rows.sort(key=lambda row: row["timestamp"])
    return rows[:count]


def make_rows(name: str, base: list[dict[str, Any]], replicas: int, rate: float,
              args: argparse.Namespace) -> list[dict[str, Any]]:
    """`--window-s` of arrivals at `rate` (req/s, the whole pool): so many requests that a rate
    past the pool's capacity builds a queue longer than the target, whatever the scale."""
    count = max(100, round(rate * args.window_s))
    if name == "sessions":
        return sessions(count, args.system_prompts * max(1, replicas // 16), args.seed)
    # the first `count` of the tiled trace: a stretch of time in which every copy keeps its reuse
    return workload.tile(base, max(1, math.ceil(count / len(base))), seed=args.seed)[:count]


def build(params: EngineParams, rows: list[dict[str, Any]], rate: float,
          args: argparse.Namespace) -> list[SimRequest]:
    return workload.requests(
        rows, rate, tokens_per_id=TOKENS_PER_ID, block_size=params.block_size,
        max_prompt_tokens=params.max_model_len - args.max_output_tokens,
        output_tokens=lambda row: max(1, min(args.max_output_tokens, row["output_length"])))


def feed(params: EngineParams, name: str, base: list[dict[str, Any]], replicas: int,
         rate: float, args: argparse.Namespace) -> Feed:
    """Workload `name` at `rate` req/s (the whole pool). For `users`, the rate is nominal: as
    many users as would send it if answers took no time (rate x think time); what they send is
    the replay's `rate_rps`."""
    if name == "users":
        shape = Shape(tokens_per_id=TOKENS_PER_ID, block_size=params.block_size,
                      max_prompt_tokens=params.max_model_len - args.max_output_tokens,
                      max_output_tokens=args.max_output_tokens, think_s=args.think_s,
                      window_s=args.window_s)
        return Closed(max(1, round(rate * args.think_s)), shape,
                      args.system_prompts * max(1, replicas // 16), args.seed)
    return Fixed(build(params, make_rows(name, base, replicas, rate, args), rate, args), rate)


def sent_at(params: EngineParams, name: str, base: list[dict[str, Any]], replicas: int,
            rate: float, args: argparse.Namespace) -> list[SimRequest]:
    """The requests workload `name` sends at `rate` (users: as they send them to round_robin)."""
    load = feed(params, name, base, replicas, rate, args)
    if isinstance(load, Closed):
        replay(params, "round_robin", replicas, load, args.seed)
    return load.sent


# --- One replay -------------------------------------------------------------------------------

def replay(params: EngineParams, policy: str, replicas: int, feed: Feed, seed: int,
           ttft_target_s: float = 0.0) -> dict[str, Any]:
    """The feed's requests through a cold pool; latency, hit rate, imbalance and the load sent."""
    loop = EventLoop()
    sim = SimCluster(loop, params, policy, replicas, seed=seed, ttft_target_s=ttft_target_s,
                     on_finished=feed.finished)
    ratios: list[float] = []

    def sample() -> None:
        loads = [r.engine.load() for r in sim.replicas.values()]
        if sum(loads):
            ratios.append(max(loads) / (sum(loads) / len(loads)))
        if loop.pending():  # requests in flight, or users still to send
            loop.after(1.0, sample)

    feed.start(loop, sim.submit)
    loop.after(1.0, sample)
    loop.run()
    requests = feed.sent
    done = [r for r in requests if r.first_token is not None and r.finished is not None]
    ttft = np.array([r.first_token - r.arrival for r in done])
    prompt = sum(r.prompt_tokens for r in done)
    return {"requests": len(requests), "unfinished": len(requests) - len(done),
            "rate_rps": feed.rate_rps,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
            "ttft_p99_s": percentile(ttft, 99),
            "hit_rate": sum(r.cached_tokens for r in done) / prompt if prompt else 0.0,
            "imbalance": float(np.mean(ratios)) if ratios else 1.0}


def floor_p90(params: EngineParams, name: str, base: list[dict[str, Any]],
              args: argparse.Namespace) -> float:
    """TTFT p90 with each request alone on one idle engine whose cache holds every block: one
    replica, a cache that never evicts, arrivals an hour apart (in the order they were sent, for
    users: as 16 replicas' worth of them send at 1 req/s each)."""
    if name == "users":
        requests = [SimRequest(r.request_id, 3600.0 * i, r.prompt_tokens, r.block_hashes,
                               r.output_tokens)
                    for i, r in enumerate(sent_at(params, name, base, 16, 16.0, args)[:1000])]
    else:
        requests = build(params, make_rows(name, base, 16, 1.0, args)[:1000], 1 / 3600, args)
    blocks = len({h for r in requests for h in r.block_hashes}) + 2 * len(requests) \
        + sum(r.output_tokens for r in requests) // params.block_size
    big = params.with_kv_blocks(blocks + params.max_model_len // params.block_size)
    return replay(big, "round_robin", 1, Fixed(requests, 1 / 3600), args.seed)["ttft_p90_s"]


def engine_seconds(params: EngineParams, prompt: int, cached: int, output: int
                   ) -> tuple[float, float]:
    """The least engine time one request takes under the profile's step law, with its step base
    shared by a batch of any size: (prefill, prefill and decode). Its prefill computes
    `prompt - cached` tokens, then each of `output - 1` decode steps one token
    over a context one longer each time."""
    p, new = params, prompt - cached
    prefill = (p.per_token_s * new + p.per_seq_s + p.per_kv_token_s * prompt
               + p.per_attn_pair_s * new * (cached + new / 2))
    steps = output - 1
    context = steps * prompt + steps * (steps + 1) / 2  # summed over the decode steps
    decode = (steps * (p.per_token_s + p.per_seq_s) + p.per_kv_token_s * context
              + p.per_attn_pair_s * (context + steps / 2))
    return prefill, prefill + decode


def capacity(params: EngineParams, requests: list[SimRequest], replicas: int) -> dict[str, float]:
    """The highest rate any policy could sustain on these requests: every leading block seen
    before anywhere cached (`reuse_bound`, the hit rate of an infinite shared cache) and the
    work spread perfectly. `capacity_rps`: replicas over the mean engine seconds of a request;
    `prefill_capacity_rps`: the same counting prefills only (first tokens can outpace decodes
    for a while)."""
    hit = prompt = prefill = total = 0.0
    for request, cached in workload.reusable_tokens(requests, params.block_size):
        first, whole = engine_seconds(params, request.prompt_tokens, cached,
                                      request.output_tokens)
        hit, prompt = hit + cached, prompt + request.prompt_tokens
        prefill, total = prefill + first, total + whole
    n = len(requests)
    return {"reuse_bound": hit / prompt, "capacity_rps": replicas * n / total,
            "prefill_capacity_rps": replicas * n / prefill}


def meets(result: dict[str, Any], slo_s: float) -> bool:
    return not result["unfinished"] and result["ttft_p90_s"] <= slo_s


def goodput(params: EngineParams, name: str, base: list[dict[str, Any]], policy: str,
            replicas: int, slo_s: float, start: float, args: argparse.Namespace
            ) -> tuple[float, float, list[dict[str, Any]]]:
    """The highest load meeting the target, searched from `start` req/s per replica (nominal
    for users): (the rate sent there, that nominal rate for the whole pool, every probe)."""
    probes: list[dict[str, Any]] = []
    sent: dict[float, float] = {}

    def probe(per_replica: float) -> bool:
        result = replay(params, policy, replicas,
                        feed(params, name, base, replicas, per_replica * replicas, args),
                        args.seed, slo_s)
        probes.append({"rate_per_replica": per_replica, **result})
        sent[per_replica] = result["rate_rps"]
        return meets(result, slo_s)

    if probe(start):
        low, high = start, start * 1.5
        while probe(high):
            low, high = high, high * 1.5
            if high > 64 * start:
                raise RuntimeError(f"{policy} at {replicas} replicas met the target at "
                                   f"{low:g} req/s per replica: raise --start-rate")
    else:
        low, high = start / 1.5, start
        while not probe(low):
            low, high = low / 1.5, low
            if low < start / 64:
                return 0.0, 0.0, probes
    for _ in range(args.bisect):
        middle = (low + high) / 2
        low, high = (middle, high) if probe(middle) else (low, middle)
    return sent[low], low * replicas, probes


# --- The run ----------------------------------------------------------------------------------

def run_scale(params: EngineParams, name: str, base: list[dict[str, Any]], replicas: int,
              slo_s: float, start: float, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each policy's goodput at this scale (searched from `start` req/s per replica), then each
    policy at 50% and 90% of the best one's."""
    policies = [p for p in args.policies.split(",")
                if replicas <= args.max_replicas.get(p, replicas)]
    found = {}
    for policy in policies:
        began = time.monotonic()
        found[policy] = goodput(params, name, base, policy, replicas, slo_s, start, args)
        print(f"{name}, {replicas} replicas, {policy}: goodput {found[policy][0]:.1f} req/s "
              f"({len(found[policy][2])} probes, {time.monotonic() - began:.0f} s)", flush=True)
    best = max(nominal for _, nominal, _ in found.values())
    records = []
    for policy in policies:
        rate, nominal, probes = found[policy]
        record = {"workload": name, "replicas": replicas, "policy": policy,
                  "goodput_rps": rate, "goodput_load_rps": nominal, "probes": len(probes)}
        for share in (0.5, 0.9):
            load = feed(params, name, base, replicas, share * best, args)
            record[f"at_{round(share * 100)}pct"] = replay(params, policy, replicas, load,
                                                           args.seed, slo_s)
        records.append(record)
    return records


def verdicts(records: list[dict[str, Any]]) -> list[str]:
    """kv_aware's goodput against the best ported baseline's, per workload and scale (target
    1.3x at 64 replicas and more)."""
    lines = []
    for name, replicas, records_at in scales(records):
        at = {r["policy"]: r for r in records_at}
        ported = [at[p] for p in BASELINES if p in at]
        if "kv_aware" not in at or not ported:
            continue
        best = max(ported, key=lambda r: r["goodput_rps"])
        ratio = at["kv_aware"]["goodput_rps"] / best["goodput_rps"] if best["goodput_rps"] else \
            math.inf
        target = "" if replicas < 64 else \
            f"; target >= 1.3: {'met' if ratio >= 1.3 else 'not met'}"
        lines.append(f"{name}, {replicas} replicas: kv_aware's goodput "
                     f"{at['kv_aware']['goodput_rps']:.1f} req/s, {ratio:.2f}x the best ported "
                     f"baseline's ({best['policy']}, {best['goodput_rps']:.1f}){target}")
    return lines


def scales(records: list[dict[str, Any]]) -> list[tuple[str, int, list[dict[str, Any]]]]:
    """(workload, replicas, its records) in the order first seen."""
    keys = dict.fromkeys((r["workload"], r["replicas"]) for r in records)
    return [(name, replicas, [r for r in records if (r["workload"], r["replicas"]) ==
                              (name, replicas)]) for name, replicas in keys]


def with_capacities(params: EngineParams, base: list[dict[str, Any]],
                    records: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Each record gets the capacity of its (workload, replicas) on the window at its best
    policy's goodput."""
    for name, replicas, at in scales(records):
        rate = max(r.get("goodput_load_rps", r["goodput_rps"]) for r in at)
        bound = capacity(params, sent_at(params, name, base, replicas, rate, args), replicas)
        for record in at:
            record["capacity"] = bound


def markdown(result: dict[str, Any]) -> str:
    p, a = result["profile"], result["args"]
    lines = [
        "# Routing at scale against other routers' algorithms, simulated", "",
        f"`{result['command']}`. Run took {result['wall_s'] / 60:.1f} min. Simulated engines of "
        f"profile `{p['name']}` ({p['source']}): KV cache {p['kv_blocks']} blocks of "
        f"{p['block_size']} tokens, {p['max_num_batched_tokens']} tokens per step. "
        f"Each replay: {a['window_s']:g} s of arrivals; outputs up to "
        f"{a['max_output_tokens']} tokens. The simulation is deterministic: a point is one run."
        + (f" `users`: a closed loop of chat users who think {a['think_s']:g} s (mean) between "
           "an answer and their next turn; the load searched is their number (a rate r stands "
           "for r x think-time users), and the goodput and the rates at 50% and 90% are what "
           "they sent." if "users" in a["workloads"].split(",") else ""),
        "",
        "Policies: tokenfab's (its router code and defaults: a replica takes no more requests "
        f"at its engine's max_num_seqs, {p['max_num_seqs']}, in flight; the target below as the "
        "pool's TTFT target, `router.ttft_target_s`) and ports of sglang-router 0.3.2 "
        "cache_aware, vllm-router 0.1.17 cache_aware and Dynamo's KV router (`sim/baselines*.py` "
        "name their source files).", "",
        "Floor and target (TTFT p90 at most "
        f"{a['slo_factor']:g}x the floor's p90): " + ", ".join(
            f"{name} floor {f['floor_p90_s'] * 1000:.0f} ms, target {f['slo_s'] * 1000:.0f} ms"
            for name, f in result["targets"].items()) + ".", "",
        "| workload | replicas | policy | goodput (req/s) | TTFT p50 / p90 / p99 at 50% (s) | "
        "TTFT p50 / p90 / p99 at 90% (s) | hit rate at 50% / 90% | imbalance at 50% / 90% |",
        "|---|---:|---|---:|---|---|---|---|",
    ]
    for r in result["records"]:
        half, most = r["at_50pct"], r["at_90pct"]
        lines.append(
            f"| {r['workload']} | {r['replicas']} | {r['policy']} | {r['goodput_rps']:.1f} | "
            + " | ".join(f"{x['ttft_p50_s']:.3f} / {x['ttft_p90_s']:.3f} / {x['ttft_p99_s']:.3f}"
                         for x in (half, most))
            + f" | {half['hit_rate']:.3f} / {most['hit_rate']:.3f} | "
            f"{half['imbalance']:.2f} / {most['imbalance']:.2f} |")
    lines += ["", "Capacity: the highest rate any policy could sustain on the window at the "
              "best goodput: every leading block seen before anywhere cached (the reuse bound), "
              "the work spread perfectly, each step's base time shared by a batch of any size. "
              "Prefill capacity counts the prefills only. A replay's "
              f"{a['window_s']:g} s of arrivals lets a pool run above these for a while, its "
              "queue growing within the target, so a goodput can exceed them.", "",
              "| workload | replicas | reuse bound | capacity (req/s) | prefill capacity (req/s) "
              "| best goodput / capacity |", "|---|---:|---:|---:|---:|---:|"]
    for name, replicas, at in scales(result["records"]):
        bound = at[0].get("capacity")
        if bound:
            best = max(r["goodput_rps"] for r in at)
            lines.append(f"| {name} | {replicas} | {bound['reuse_bound']:.3f} | "
                         f"{bound['capacity_rps']:.1f} | {bound['prefill_capacity_rps']:.1f} | "
                         f"{best / bound['capacity_rps']:.2f} |")
    lines += ["", "Verdicts:", ""] + [f"- {line}" for line in result["verdicts"]]
    fidelity = result.get("validation")
    if fidelity:
        lines += ["", "Validation of the ports against the real routers at 2 engines "
                  "(port_fidelity.json; decision agreement: the port choosing before each "
                  "request from the real router's own history):", "",
                  "| port | load | agreement | decision agreement | hit rate, port | "
                  "hit rate, real | difference |", "|---|---:|---:|---:|---:|---:|---:|"]
        for v in fidelity:
            decided = v.get("decision_agreement")
            lines.append(f"| {v['policy']} | {v['rate_rps']:g} req/s | {v['agreement']:.3f} | "
                         f"{'-' if decided is None else format(decided, '.3f')} | "
                         f"{v['sim_hit_rate']:.3f} | {v['real_hit_rate']:.3f} | "
                         f"{v['hit_rate_diff']:+.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="16,64,256")
    parser.add_argument("--workloads", default="mooncake,users",
                        help="mooncake, users (a closed loop), sessions (an open loop)")
    parser.add_argument("--policies", default=POLICIES)
    parser.add_argument("--trace", default=str(TRACE), help="the mooncake workload's trace")
    parser.add_argument("--profile", default="h100-llama-3.1-8b")
    parser.add_argument("--window-s", type=float, default=40.0,
                        help="seconds of arrivals in each replay")
    parser.add_argument("--max-output-tokens", type=int, default=1024)
    parser.add_argument("--system-prompts", type=int, default=16,
                        help="the sessions and users workloads' system prompts per 16 replicas")
    parser.add_argument("--think-s", type=float, default=10.0,
                        help="the users workload's mean think time between turns (s)")
    parser.add_argument("--slo-factor", type=float, default=3.0)
    parser.add_argument("--start-rate", type=float, default=1.0, help="req/s per replica")
    parser.add_argument("--bisect", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-replicas", default="dynamo:kv=64",
                        help="policies run only up to so many replicas (the Dynamo port's "
                        "decisions and events cost the simulator minutes a replay at 256)")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--report", action="store_true",
                        help="rewrite the results' capacities and report from --out, run nothing")
    args = parser.parse_args()
    if args.report:
        report(Path(args.out), args.trace)
        return
    args.max_replicas = {k: int(v) for k, v in (item.split("=") for item in
                                                 filter(None, args.max_replicas.split(",")))}

    began = time.monotonic()
    params = profiles.load(args.profile)
    base = workload.read_trace(Path(args.trace))
    records, targets = [], {}
    for name in args.workloads.split(","):
        floor = floor_p90(params, name, base, args)
        targets[name] = {"floor_p90_s": floor, "slo_s": args.slo_factor * floor}
        print(f"{name}: floor TTFT p90 {floor:.3f} s, target {args.slo_factor * floor:.3f} s")
        start = args.start_rate
        for replicas in (int(n) for n in args.replicas.split(",")):
            records += run_scale(params, name, base, replicas, targets[name]["slo_s"], start,
                                 args)
            # the next scale's search starts at this one's best goodput per replica
            start = max(r["goodput_load_rps"] for r in records if r["workload"] == name
                        and r["replicas"] == replicas) / replicas or args.start_rate
            write(Path(args.out), params, args, targets, records, began)
    print(write(Path(args.out), params, args, targets, records, began))


def report(out: Path, trace: str) -> None:
    """The capacities and the report again from a results file (its own settings)."""
    result = json.loads(out.read_text())
    args = argparse.Namespace(**result["args"])
    params = profiles.load(args.profile)
    with_capacities(params, workload.read_trace(Path(trace)), result["records"], args)
    result["validation"] = validation()
    print(results.write(out, result, markdown))


def validation() -> list[dict[str, Any]] | None:
    """The ports' lines of the latest port_fidelity.json, when it exists."""
    fidelity = RESULTS / "port_fidelity.json"
    return json.loads(fidelity.read_text())["ports"] if fidelity.exists() else None


def write(out: Path, params: EngineParams, args: argparse.Namespace, targets: dict[str, Any],
          records: list[dict[str, Any]], began: float) -> str:
    """The results so far (after each scale: a long run that stops keeps what it measured)."""
    import msgspec

    out = out.resolve()
    with_capacities(params, workload.read_trace(Path(args.trace)), records, args)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "trace", "report")}
    result = {"command": "python benchmarks/simulated/routing_at_scale.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in settings.items()
                  if k != "max_replicas") + " --max-replicas " + ",".join(
                  f"{k}={v}" for k, v in args.max_replicas.items()),
              "profile": msgspec.to_builtins(params), "args": settings, "targets": targets,
              "records": records, "verdicts": verdicts(records),
              "validation": validation(),
              "wall_s": time.monotonic() - began}
    if out != DEFAULT_OUT:
        result["command"] += f" --out {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}"
    return results.write(out, result, markdown)


if __name__ == "__main__":
    main()
