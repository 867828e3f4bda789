"""What sealing the data channel costs: CPU and time per streamed token, sealed (AES-256-GCM
records, channel/seal.py) against the same channel in plaintext, side by side.

One process holds both ends, a replica's `ChannelServer` and a gateway's `ReplicaLink`, on
127.0.0.1: the CPU counted is what both ends of the data channel spend, the replica's frames
and the gateway's reading of them. Each request carries a prompt of `--prompt-bytes` and gets
`--tokens` chunks of a chat stream's size (one engine step: every running stream sends one,
then the loop turns), with `--streams` requests running at once. The plaintext runs are the
channel with its sealing taken out (`Sealer` and `Opener` made to return None, so the writer and
reader keep the frames as they are): the channel as it was before it was sealed.

Repeats alternate the two (plaintext first in even repeats, sealed first in odd ones) so that
drift hits both. A ratio is a win or a loss only where the ranges do not overlap.

    .venv/bin/python benchmarks/channel_seal.py [--streams 1,32] [--tokens 256] [--repeats 7]

Writes benchmarks/results/channel_seal.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.common import results
from benchmarks.common.intervals import aggregate, verdict
from benchmarks.common.results import RESULTS
from channel import seal
from channel.client import ReplicaLink
from channel.frames import Request, Usage
from channel.server import ChannelServer, ReplySink

SECRET = b"b" * 32
CHUNK = (b'data: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk",'
         b'"created":1765000000,"model":"tiny","choices":[{"index":0,"delta":{"content":'
         b'" word"},"logprobs":null,"finish_reason":null}]}\n\n')


class Streamer:
    """A replica's handler: `tokens` chunks per request, one per turn of the loop."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def admit(self) -> str | None:
        return None

    def release(self) -> None:
        pass

    async def serve(self, request: Request, reply: ReplySink) -> None:
        reply.head(200, True, "bench")
        for _ in range(self.tokens):
            await asyncio.sleep(0)
            reply.data(CHUNK, True)
        reply.end(Usage(len(request.body) // 4, self.tokens, 0))


@contextmanager
def plaintext() -> Iterator[None]:
    """The channel without its sealing, for the comparison only."""
    sealer, opener = seal.Sealer, seal.Opener
    seal.Sealer = seal.Opener = lambda key: None  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        seal.Sealer, seal.Opener = sealer, opener  # type: ignore[misc]


async def one_run(streams: int, tokens: int, prompt_bytes: int) -> dict[str, float]:
    server = ChannelServer(SECRET, Streamer(tokens), "bench")
    port = await server.start("127.0.0.1")
    link = ReplicaLink("bench", "127.0.0.1", port, SECRET, "gw-bench")
    await link.connect()
    body = json.dumps({"model": "tiny", "prompt": "x" * prompt_bytes}).encode()
    received = [0]

    def sink(chunk: bytes, token: bool) -> None:
        received[0] += token

    began_cpu, began = time.process_time(), time.perf_counter()
    opened = [link.open(Request("completions", body)) for _ in range(streams)]
    for stream in opened:
        stream.attach(sink)
    for stream in opened:
        await stream.end
    cpu, wall = time.process_time() - began_cpu, time.perf_counter() - began
    link.close()
    server.close()
    assert received[0] == streams * tokens, (received[0], streams * tokens)
    return {"cpu_us_per_token": cpu / received[0] * 1e6,
            "wall_us_per_token": wall / received[0] * 1e6}


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    records = []
    for repeat in range(args.repeats):
        for streams in args.streams:
            modes = ["plaintext", "sealed"] if repeat % 2 == 0 else ["sealed", "plaintext"]
            for mode in modes:
                if mode == "plaintext":
                    with plaintext():
                        run = asyncio.run(one_run(streams, args.tokens, args.prompt_bytes))
                else:
                    run = asyncio.run(one_run(streams, args.tokens, args.prompt_bytes))
                records.append({"mode": mode, "streams": streams, "repeat": repeat, **run})
                print(f"{mode:9s} streams {streams:3d} repeat {repeat}: "
                      f"{run['cpu_us_per_token']:.1f} us CPU/token", flush=True)
    return records


FIELDS = ("cpu_us_per_token", "wall_us_per_token")


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [
        "# Sealing the data channel: CPU per token, sealed against plaintext", "",
        f"`{result['command']}`: both ends of the channel in one process on 127.0.0.1, "
        f"{a['tokens']} chunks of {result['chunk_bytes']} bytes per request (one per turn of "
        f"the loop, as an engine step sends them), a {a['prompt_bytes']}-byte prompt each, "
        f"{a['repeats']} repeats alternating the two. Each figure: the median, min-max in "
        "brackets; a ratio is a win or a loss only where the ranges do not overlap.", "",
        "| streams at once | mode | CPU per token (us) | wall per token (us) |",
        "|---:|---|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['streams']} | {row['mode']} | " + " | ".join(
            f"{row[f]:.1f} [{row[f + '_range'][0]:.1f}-{row[f + '_range'][1]:.1f}]"
            for f in FIELDS) + " |")
    lines += ["", "Sealed / plaintext:", ""]
    for ratio in result["ratios"]:
        lines.append(f"- {ratio['streams']} at once: CPU per token {ratio['cpu']:.2f} "
                     f"({ratio['cpu_verdict']}), {ratio['cpu_added_us']:+.1f} us a token")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,32", help="requests running at once")
    parser.add_argument("--tokens", type=int, default=256, help="chunks per request")
    parser.add_argument("--prompt-bytes", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(RESULTS / "channel_seal.json"))
    args = parser.parse_args()
    args.streams = [int(n) for n in args.streams.split(",")]
    records = measure(args)
    rows = aggregate(records, ("streams", "mode"), FIELDS)
    ratios = []
    for streams in args.streams:
        plain, sealed = ({r["mode"]: r for r in rows if r["streams"] == streams}[m]
                         for m in ("plaintext", "sealed"))
        ratios.append({"streams": streams,
                       "cpu": sealed["cpu_us_per_token"] / plain["cpu_us_per_token"],
                       "cpu_verdict": verdict(sealed, plain, "cpu_us_per_token"),
                       "cpu_added_us": sealed["cpu_us_per_token"] - plain["cpu_us_per_token"]})
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    result = {"command": results.command(), "args": settings, "chunk_bytes": len(CHUNK),
              "rows": rows, "ratios": ratios}
    print(results.write(Path(args.out), result, markdown))


if __name__ == "__main__":
    main()
