"""python -m sim calibrate | replay: measure an engine's profile, or replay a trace in simulation.

    python -m sim calibrate --url http://127.0.0.1:8000 --model tiny \\
        --model-path ~/.cache/tokenfab/models/tiny-llama --kv-blocks 384 --out my-profile.json
    python -m sim replay --profile h100-llama-3.1-8b --trace ../shared/traces/synthetic_trace.jsonl \\
        --policy kv_aware --replicas 64 --rate 64
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sim import params as profiles
from sim import workload
from sim.run import replay


def _calibrate(args: argparse.Namespace) -> None:
    from sim.calibrate import calibrate, single_token_words

    words = single_token_words(args.model_path)
    params, error, observations = calibrate(
        f"{args.url.rstrip('/')}/v1", args.model, words, block_size=args.block_size,
        kv_blocks=args.kv_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        start_latency_s=args.start_latency_s, name=Path(args.out).stem, repeats=args.repeats,
        headers={"authorization": f"Bearer {args.api_key}"} if args.api_key else None)
    profiles.dump(params, Path(args.out))
    print(f"{len(observations)} probes, median fit error {error:.1%}; wrote {args.out}")


def _replay(args: argparse.Namespace) -> None:
    params = profiles.load(args.profile)
    rows = workload.tile(workload.read_trace(Path(args.trace)), args.copies, args.seed)

    def make(index: int, start: float) -> list:
        return workload.requests(
            rows, args.rate, tokens_per_id=args.tokens_per_id, block_size=params.block_size,
            max_prompt_tokens=params.max_model_len - args.max_output_tokens, start=start,
            output_tokens=lambda row: max(1, min(args.max_output_tokens, row["output_length"])))

    result = replay(params, args.policy, args.replicas, make, seed=args.seed)
    result.pop("per_request")
    json.dump(result, sys.stdout, indent=2)
    print()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sim", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    cal = commands.add_parser("calibrate", help="fit a profile to a running tokenfab gateway's "
                              "engines (run it on an otherwise idle deployment)")
    cal.add_argument("--url", required=True, help="the gateway, e.g. http://127.0.0.1:8000")
    cal.add_argument("--model", required=True, help="the served model name")
    cal.add_argument("--model-path", required=True, help="its tokenizer (for exact prompts)")
    cal.add_argument("--kv-blocks", type=int, required=True, help="KV blocks of one replica "
                     "(tokenfab status shows them)")
    cal.add_argument("--block-size", type=int, default=32)
    cal.add_argument("--max-model-len", type=int, default=2048)
    cal.add_argument("--max-num-batched-tokens", type=int, default=2048)
    cal.add_argument("--max-num-seqs", type=int, default=128)
    cal.add_argument("--start-latency-s", type=float, default=40.0,
                     help="a replica's start, measured apart (e.g. a deploy timed)")
    cal.add_argument("--repeats", type=int, default=3)
    cal.add_argument("--api-key", default="", help="a tenant key, if the gateway asks for one")
    cal.add_argument("--out", required=True)
    cal.set_defaults(run=_calibrate)
    rep = commands.add_parser("replay", help="replay a Mooncake-format trace in simulation")
    rep.add_argument("--profile", required=True, help="a profile name (sim/profiles) or file")
    rep.add_argument("--trace", required=True)
    rep.add_argument("--policy", default="kv_aware")
    rep.add_argument("--replicas", type=int, default=2)
    rep.add_argument("--rate", type=float, required=True, help="mean arrivals per second")
    rep.add_argument("--copies", type=int, default=1, help="tile the trace this many times")
    rep.add_argument("--tokens-per-id", type=int, default=512)
    rep.add_argument("--max-output-tokens", type=int, default=1024)
    rep.add_argument("--seed", type=int, default=0)
    rep.set_defaults(run=_replay)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
