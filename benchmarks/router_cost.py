"""What a routing decision and the block map cost, at cluster scale, on one core.

Builds a block map of about 1M (block, replica) pairs over 256 replicas (2,000 documents of 512
blocks of 16 tokens = 8k tokens each; 100 shared system prompts of 128 blocks at the head of the
documents, so popular blocks have many holders), then times:
- a kv_aware decision for an 8k-token request among 256 replicas (prefix lookups, the
  shortlist's snapshots, scoring, ranking, and recording the dispatch), excluding tokenisation;
- tokenisation plus vLLM block hashing of an 8k-token prompt (the gateway's part);
- ingest: decoding vLLM-format KVEventBatch payloads (BlockStored with token ids) and applying
  them to the map, blocks per second on one core;
- a full collection of Python's garbage collector, in this process before the map is built
  and with it (the map's share of every such pause, which stalls the ingress event loop).

Each replica reports a KV capacity (`KV_BLOCKS`), as started engines do, so the cache-room
scorer's part of a decision is counted.

    .venv/bin/python benchmarks/router_cost.py [--out benchmarks/results/router_cost.json]

Writes benchmarks/results/router_cost.json and router_cost.md, the page rendered from the JSON
alone (`markdown`): each number against its target (decision p99 < 1 ms, ingest > 500k
blocks/s) as a ratio. It takes no other argument, so the page's command is always the same.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from benchmarks.common.results import RESULTS, ROOT, write
from orchestrator.config import load_topology
from pools.tokenizer import PromptTokenCounter
from router.events import BlockStored, KVEventBatch, decode_batch
from router.hashing import PrefixBlockHasher
from router.index import KVBlockIndex, ReplicaId
from router.policies import build_policy
from router.service import RoutingService
from router.wire import ReplicaView, RouteKey
from tokenfab.stats import percentile

REPLICAS, DOCS, DOC_BLOCKS, SYSTEMS, SYSTEM_BLOCKS, BLOCK = 256, 2000, 512, 100, 128, 16
KV_BLOCKS = 8192  # each replica's reported capacity: about twice what it holds here
TARGET_DECISION_P99_MS, TARGET_INGEST = 1.0, 500_000


def build_map(rng: random.Random) -> tuple[RoutingService, list[list[bytes]], list[ReplicaId]]:
    replicas = [ReplicaId(f"replica-{i:03d}") for i in range(REPLICAS)]
    views = [ReplicaView(replica=r, pool="main", block_size=BLOCK, kv_blocks=KV_BLOCKS)
             for r in replicas]
    service = RoutingService("main", build_policy("kv_aware", rng=rng), PrefixBlockHasher,
                             follow_events=False, max_index_entries=2_000_000)
    service.set_replicas(views)  # as the gateway does from the registry
    systems = [[rng.randbytes(32) for _ in range(SYSTEM_BLOCKS)] for _ in range(SYSTEMS)]
    docs = []
    for _ in range(DOCS):
        doc = rng.choice(systems) + [rng.randbytes(32) for _ in range(DOC_BLOCKS - SYSTEM_BLOCKS)]
        service._index.add(rng.choice(replicas), doc, "GPU")
        docs.append(doc)
    return service, docs, replicas


def time_decisions(service: RoutingService, docs: list[list[bytes]], replicas: list[ReplicaId],
                   rng: random.Random, count: int = 3000) -> np.ndarray:
    samples = []
    for i in range(count):
        doc = rng.choice(docs)
        shared = rng.randrange(SYSTEM_BLOCKS, DOC_BLOCKS)
        hashes = doc[:shared] + [rng.randbytes(32) for _ in range(DOC_BLOCKS - shared)]
        key = RouteKey(f"r{i}", DOC_BLOCKS * BLOCK, BLOCK, hashes)
        started = time.perf_counter()
        service.dispatched(key, service.rank(key, replicas)[0])
        samples.append(time.perf_counter() - started)
        service.finished(key.request_id)
    return np.array(samples) * 1000


def time_tokenize_hash(model_path: str, count: int = 30) -> np.ndarray:
    counter, hasher = PromptTokenCounter(model_path), PrefixBlockHasher(BLOCK)
    words = "the quick brown fox jumps over a lazy dog while seven green parrots sing".split()
    text = " ".join(words[i % len(words)] + str(i % 97) for i in range(6000))
    tokens = counter.prompts("completions", {"prompt": text})[0]
    text = counter._tokenizer.decode(tokens[:8192], skip_special_tokens=True)
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        ids = counter.prompts("completions", {"prompt": text})[0]
        hasher.block_hashes(ids)
        samples.append(time.perf_counter() - started)
    print(f"tokenise+hash prompt: {len(ids)} tokens")
    return np.array(samples) * 1000


def ingest_rate(rng: random.Random, batches: int = 4000, blocks_per_event: int = 32) -> float:
    encoder = msgspec.msgpack.Encoder()
    payloads = []
    for _ in range(batches):
        hashes = [rng.randbytes(32) for _ in range(blocks_per_event)]
        event = BlockStored(block_hashes=hashes, parent_block_hash=None,
                            token_ids=[rng.randrange(32000)
                                       for _ in range(blocks_per_event * BLOCK)],
                            block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None)
        payloads.append(encoder.encode(KVEventBatch(ts=time.time(), events=[event])))
    index = KVBlockIndex(max_entries=10_000_000)
    replicas = [ReplicaId(f"replica-{i:03d}") for i in range(REPLICAS)]
    started = time.perf_counter()
    for i, payload in enumerate(payloads):
        index.apply(replicas[i % REPLICAS], decode_batch(payload))
    return batches * blocks_per_event / (time.perf_counter() - started)


def full_collection_ms(repeats: int = 3) -> float:
    """The median wall time of a full garbage collection in this process."""
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        gc.collect()
        samples.append((time.perf_counter() - started) * 1000)
    return float(np.median(samples))


def markdown(result: dict[str, Any]) -> str:
    r = result
    return (
        "# Router cost\n\n`python benchmarks/router_cost.py` (one core of this machine): "
        f"{r['index_entries']:,} (block, replica) pairs over {r['replicas']} replicas, "
        f"{r['prompt_tokens']:,}-token requests ({r['prompt_tokens'] // BLOCK} blocks of {BLOCK}), "
        f"each replica reporting {r['kv_blocks']:,} KV blocks.\n\n"
        "| measure | value | target | target / value |\n|---|---:|---:|---:|\n"
        f"| decision p50 (ms) | {r['decision_p50_ms']:.3f} | | |\n"
        f"| decision p99 (ms) | {r['decision_p99_ms']:.3f} | < {TARGET_DECISION_P99_MS} | "
        f"{TARGET_DECISION_P99_MS / r['decision_p99_ms']:.2f}x |\n"
        f"| tokenise + hash p50 (ms) | {r['tokenize_hash_p50_ms']:.2f} | | |\n"
        f"| event ingest (blocks/s) | {r['ingest_blocks_per_s']:,.0f} | > {TARGET_INGEST:,} | "
        f"{r['ingest_blocks_per_s'] / TARGET_INGEST:.2f}x |\n"
        f"| full garbage collection, before the map (ms) | {r['full_gc_before_map_ms']:.1f} "
        "| | |\n"
        f"| full garbage collection, with the map and {r['history_entries']:,} history "
        f"records (ms) | {r['full_gc_with_map_ms']:.1f} | | |\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS / "router_cost.json"),
                        help="the JSON; the page (.md) is written beside it")
    args = parser.parse_args()
    rng = random.Random(0)
    gc_before = full_collection_ms()
    service, docs, replicas = build_map(rng)
    entries = len(service._index)
    print(f"block map: {entries} (block, replica) pairs over {REPLICAS} replicas")
    decisions = time_decisions(service, docs, replicas, rng)
    del docs  # the benchmark's own copy of the prompts: the map and the history stay
    gc_with_map = full_collection_ms()
    model_path = load_topology(ROOT / "deploy/topologies/local.yaml").model.resolved_path
    tokenize = time_tokenize_hash(model_path)
    ingest = ingest_rate(rng)
    result = {"decision_p50_ms": percentile(decisions, 50),
              "decision_p99_ms": percentile(decisions, 99),
              "tokenize_hash_p50_ms": percentile(tokenize, 50),
              "ingest_blocks_per_s": ingest, "index_entries": entries,
              "history_entries": service.history_entries(), "replicas": REPLICAS,
              "prompt_tokens": DOC_BLOCKS * BLOCK, "kv_blocks": KV_BLOCKS,
              "full_gc_before_map_ms": gc_before, "full_gc_with_map_ms": gc_with_map}
    write(Path(args.out), result, markdown)
    print(json.dumps(result, indent=2))
    print(f"decision p99 vs 1 ms target: {TARGET_DECISION_P99_MS / result['decision_p99_ms']:.1f}x "
          f"headroom; ingest vs 500k/s target: {ingest / TARGET_INGEST:.2f}x")


if __name__ == "__main__":
    main()
