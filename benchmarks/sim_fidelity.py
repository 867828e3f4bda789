"""The simulator against the real thing: the same trace window through 2 real replicas (the routing
benchmark's setup) and through the simulator, calibrated in the same run.

1. A local head; the routing benchmark's topology (2 unified replicas of the tiny model, one
   pinned core each, 24MiB KV cache, block 32) for round_robin, deployed, timed (the replica
   start latency) and warmed up.
2. `sim.calibrate` probes it through its gateway and fits the step-time law; then, on each
   deployment, calibration replays of other conversations of the trace (roots the window does
   not have) at each of --calibration-rates (default: the measured rates) fit the law's scale
   under load, the request overhead and what each request already on a replica adds to it,
   for their TTFT p50, p90 and p99 together (`sim.calibrate.fit_to_replay`): the `cpu-tiny`
   profile, written to sim/profiles/cpu-tiny.json.
3. Each policy replays the routing benchmark's sample at each rate (`routing.replay_rate`: cold
   caches, repeats of the sample for at least --min-replay-s of arrivals).
4. The simulator replays the same requests, replays and rates with the fitted profile and
   tokenfab's real router.

    .venv/bin/python benchmarks/sim_fidelity.py [--rates 2,10] [--policies round_robin,kv_aware]

Writes benchmarks/results/sim_fidelity.{json,md}: for each policy, rate and metric (TTFT p50,
TTFT p90, hit rate) the simulated and the real value and their relative error. The page is
rendered from the JSON alone (`markdown`): its command's rates and policies are the records'.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import msgspec

from benchmarks.common.machine import prioritise_client
from benchmarks.common.results import RESULTS, write
from benchmarks.common.traces import (BLOCK_TOKENS, MAX_BLOCKS, sample_by_root, single_token_words,
                                      upper_bound_hit_rate)
from benchmarks.routing import (ROOT_SHARE, SAMPLE_SEED, TRACE, kv_blocks_per_replica,
                                replay_rate, replays, summarize, sweep, topology)
from sim import params as profiles
from sim import workload
from sim.calibrate import calibrate, fit_to_replay
from sim.fidelity import METRICS
from sim.run import replay

MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS = 2048, 128  # vLLM's CPU defaults for its API server


def output_tokens(row: dict[str, Any]) -> int:
    return max(1, min(32, row["output_length"] // 8))  # as routing.replay sends max_tokens


def simulate(params: profiles.EngineParams, policy: str, rows: list[dict[str, Any]],
             index: int, rate: float, min_replay_s: float) -> dict[str, Any]:
    """The routing benchmark's replays of `rows` at `rate`, in the simulator."""

    def make(repeat: int, start: float) -> list:
        return workload.requests(rows, rate, tokens_per_id=BLOCK_TOKENS,
                                 block_size=params.block_size,
                                 max_prompt_tokens=MAX_BLOCKS * BLOCK_TOKENS + 1,
                                 output_tokens=output_tokens, start=start, exact_ids=True,
                                 namespace=1 + index * 100 + repeat)

    return replay(params, policy, 2, make, replays(len(rows), rate, min_replay_s))


def calibration_rows(window: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Conversations of the trace the window does not have (another seed's roots)."""
    roots = {row["hash_ids"][0] for row in window}
    return [row for row in sample_by_root(TRACE, ROOT_SHARE, SAMPLE_SEED + 1)
            if row["hash_ids"][0] not in roots]


def fit_deployment(probed: profiles.EngineParams, policy: str, gateway: str,
                   rows: list[dict[str, Any]], words: list[str],
                   rates: list[float]) -> tuple[profiles.EngineParams, dict[str, Any]]:
    """The probed law scaled to calibration replays of other conversations on this deployment,
    one at each of `rates` (the machine's speed drifts between deployments, and what the
    request path adds grows with the load)."""
    extra = calibration_rows(rows)
    replays, measured = [], []
    for i, rate in enumerate(rates):
        real = summarize(policy, rate, replay_rate(gateway, extra, words, 50 + i, rate, 0.0))
        replays.append((partial(simulate, policy=policy, rows=extra, index=50 + i, rate=rate,
                                min_replay_s=0.0), real))
        measured.append({"rate_rps": rate, "real": real})
    params, scale, error = fit_to_replay(probed, replays)
    print(f"{policy}: fitted to the calibration replays: step scale {scale:.2f}, overhead "
          f"{params.request_overhead_s * 1e3:.1f} ms + {params.overhead_per_stream_s * 1e3:.1f} "
          "ms per request on the replica")
    return params, {"requests": len(extra), "replays": measured, "step_scale": scale,
                    "request_overhead_s": params.request_overhead_s,
                    "overhead_per_stream_s": params.overhead_per_stream_s,
                    "squared_log_error": error}


def compare(real: dict[str, Any], sim: dict[str, Any], policy: str, rate: float) -> list[dict]:
    return [{"policy": policy, "load": f"{rate:g} req/s", "metric": m, "sim": sim[m],
             "real": real[m], "rel_err": (sim[m] - real[m]) / real[m] if real[m] else 0.0}
            for m in METRICS]


def markdown(result: dict[str, Any]) -> str:
    p, records = result["profile"], result["records"]
    rates = ",".join(dict.fromkeys(f"{r['real']['rate_rps']:g}" for r in records))
    policies = ",".join(dict.fromkeys(r["policy"] for r in records))
    lines = [
        "# Simulator fidelity: simulated against real replicas", "",
        f"`python benchmarks/sim_fidelity.py --rates {rates} --policies {policies}`: "
        f"{result['requests']} requests of the routing benchmark's sample (infinite-cache hit "
        f"rate {result['bound_hit_rate']:.3f}), 2 replicas of the tiny model (one pinned core "
        f"each, {p['kv_blocks']} KV blocks of {p['block_size']} tokens), then the same replays in "
        "the simulator with tokenfab's real router. Run took "
        f"{result['wall_s'] / 60:.1f} min.", "",
        f"The law fitted to {result['observations']} probes of an idle replica (median fit "
        f"error {result['fit_error']:.1%}), as scaled for the first deployment below and "
        f"written to sim/profiles/cpu-tiny.json: step = {p['step_base_s'] * 1e3:.2f} ms "
        f"+ {p['per_token_s'] * 1e6:.1f} us/token + {p['per_seq_s'] * 1e6:.1f} us/request "
        f"+ {p['per_kv_token_s'] * 1e9:.1f} ns/KV token + {p['per_attn_pair_s'] * 1e12:.2f} "
        f"ps/attention pair; request overhead {p['request_overhead_s'] * 1e3:.1f} ms + "
        f"{p['overhead_per_stream_s'] * 1e3:.1f} ms per request already on the replica; "
        f"replica start {p['start_latency_s']:.0f} s.", "",
        "Then, on each deployment before its measured replays, calibration replays of other "
        "conversations of the trace (roots the window does not have), one at each calibration "
        "rate, scale the law and set the request overhead and what each request already on the "
        "replica adds to it, fitted to their TTFT p50, p90 and p99 together "
        "(`sim.calibrate.fit_to_replay`):",
        "",
    ]
    for policy, c in result["calibration_replay"].items():
        seen = "; ".join(f"at {r['rate_rps']:g} req/s TTFT p50 {r['real']['ttft_p50_s']:.3f} s, "
                         f"p90 {r['real']['ttft_p90_s']:.3f} s, p99 {r['real']['ttft_p99_s']:.3f} s"
                         for r in c["replays"])
        lines.append(f"- {policy}: {c['requests']} requests, real {seen}: step terms "
                     f"x{c['step_scale']:.2f}, overhead {c['request_overhead_s'] * 1e3:.1f} ms "
                     f"+ {c['overhead_per_stream_s'] * 1e3:.1f} ms per request already on the "
                     "replica")
    lines += [
        "",
        "| policy | load | metric | simulated | real | error |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in result["fidelity"]:
        lines.append(f"| {r['policy']} | {r['load']} | {r['metric']} | {r['sim']:.3f} | "
                     f"{r['real']:.3f} | {r['rel_err']:+.1%} |")
    worst = max(result["fidelity"], key=lambda r: abs(r["rel_err"]))
    within = sum(abs(r["rel_err"]) <= 0.15 for r in result["fidelity"])
    lines += ["", f"{within} of {len(result['fidelity'])} within ±15%; the largest error: "
              f"{worst['policy']} {worst['load']} {worst['metric']} {worst['rel_err']:+.1%}.", ""]
    lines += ["Per record (real, then simulated):", "",
              "| policy | load | side | TTFT p50 (s) | TTFT p90 (s) | TTFT p99 (s) | hit rate "
              "| output tok/s | requests |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for rec in result["records"]:
        for side in ("real", "sim"):
            r = rec[side]
            lines.append(f"| {rec['policy']} | {rec['load']} | {side} | {r['ttft_p50_s']:.3f} | "
                         f"{r['ttft_p90_s']:.3f} | {r['ttft_p99_s']:.3f} | {r['hit_rate']:.3f} | "
                         f"{r['output_tok_s']:.1f} | {r['requests']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="2,10")
    parser.add_argument("--policies", default="round_robin,kv_aware")
    parser.add_argument("--kv-cache", default="24MiB")
    parser.add_argument("--min-replay-s", type=float, default=60.0)
    parser.add_argument("--limit", type=int, default=0, help="replay only the first N requests")
    parser.add_argument("--calibration-repeats", type=int, default=3)
    parser.add_argument("--calibration-rates", default="",
                        help="req/s of the calibration replays, comma-separated (default: --rates)")
    parser.add_argument("--profile-out", default=str(profiles.PROFILES / "cpu-tiny.json"))
    parser.add_argument("--out", default=str(RESULTS / "sim_fidelity.json"))
    parser.add_argument("--raw", default="", help="directory for per-request records")
    args = parser.parse_args()
    began = time.monotonic()
    prioritise_client(-10)
    rates = [float(r) for r in args.rates.split(",")]
    calibration_rates = [float(r) for r in (args.calibration_rates or args.rates).split(",")]
    rows = sample_by_root(TRACE, ROOT_SHARE, SAMPLE_SEED)
    if args.limit:
        rows = rows[:args.limit]
    specs = {p: topology(p, args.kv_cache) for p in args.policies.split(",")}
    first = next(iter(specs.values()))
    words = single_token_words(first.model.resolved_path)
    result: dict[str, Any] = {"args": vars(args), "bound_hit_rate": upper_bound_hit_rate(rows),
                              "requests": len(rows), "records": [], "fidelity": []}
    deploy_s: dict[str, float] = {}
    real: dict[tuple[str, float], dict[str, Any]] = {}
    started = time.monotonic()

    def capacity(gateway: str) -> int:
        deploy_s["first"] = time.monotonic() - started  # head up, 2 replicas deployed in parallel
        return kv_blocks_per_replica(gateway)

    probed, fitted = None, {}
    for policy, gateway, index, rate in sweep(specs, rows, words, rates, result,
                                              "kv_blocks_per_replica", capacity):
        if probed is None:
            print("calibrating")
            probed, error, observations = calibrate(
                f"{gateway}/v1", first.model.name, words, block_size=BLOCK_TOKENS,
                kv_blocks=result["kv_blocks_per_replica"],
                max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=MAX_NUM_SEQS,
                max_model_len=first.model.max_model_len, start_latency_s=deploy_s["first"],
                name="cpu-tiny", repeats=args.calibration_repeats)
            result.update(fit_error=error, observations=len(observations),
                          calibration=[vars(o) for o in observations], calibration_replay={})
            print(f"probed: {probed}")
        if policy not in fitted:  # this deployment, just before its measured replays
            fitted[policy], result["calibration_replay"][policy] = fit_deployment(
                probed, policy, gateway, rows, words, calibration_rates)
        results = replay_rate(gateway, rows, words, index, rate, args.min_replay_s)
        real[(policy, rate)] = summarize(policy, rate, results)
        if args.raw:
            _write(Path(args.raw) / f"real-{policy}-{rate:g}.json", results)
        print("real", json.dumps(real[(policy, rate)]))
    for (policy, rate), measured in real.items():
        index = rates.index(rate)
        simulated = simulate(fitted[policy], policy, rows, index, rate, args.min_replay_s)
        if args.raw:
            _write(Path(args.raw) / f"sim-{policy}-{rate:g}.json", simulated.pop("per_request"))
        simulated.pop("per_request", None)
        print("sim", json.dumps(simulated))
        result["records"].append({"policy": policy, "load": f"{rate:g} req/s",
                                  "real": measured, "sim": simulated})
        result["fidelity"] += compare(measured, simulated, policy, rate)
    params = fitted[next(iter(specs))]
    result["profile"] = msgspec.to_builtins(params)
    result["wall_s"] = time.monotonic() - began
    Path(args.profile_out).parent.mkdir(parents=True, exist_ok=True)
    profiles.dump(params, Path(args.profile_out))
    print(write(Path(args.out), result, markdown))


def _write(path: Path, rows: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
