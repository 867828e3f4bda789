"""The ported routers (`sim.baselines`): exact decisions on small cases for each (threshold,
imbalance, ties as the source breaks them, eviction), and each routing a small simulated pool."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import pytest

from router.index import ReplicaId
from sim import workload
from sim.baselines import BASELINES, build_baseline
from sim.baselines_cache_aware import (CacheAwareConfig, SglangCacheAware,
                                       VllmRouterCacheAware)
from sim.baselines_dynamo import DynamoKvRouter, softmax_sample
from sim.baselines_tree import ApproxTree
from sim.cluster import SimCluster
from sim.decisions import Decision, agreement
from sim.loop import EventLoop
from sim.params import EngineParams

BS = 32
A = list(range(1, 11))  # one prompt's block hashes; A[:k] is its first k blocks
B = list(range(101, 111))
C = list(range(201, 211))
REPLICAS = [ReplicaId("a"), ReplicaId("b")]
Step = tuple[list[int], int, Mapping[str, int], str]  # blocks, prompt tokens, loads -> choice


def _run(port: SglangCacheAware | VllmRouterCacheAware | DynamoKvRouter,
         steps: Sequence[Step]) -> list[str]:
    return [port.choose(f"q{k}", blocks, prompt, REPLICAS, dict(loads))
            for k, (blocks, prompt, loads, _) in enumerate(steps)]


IDLE = {"a": 0, "b": 0}
B_IDLE = {"a": 1, "b": 0}
CACHE_AWARE_CASES: dict[str, list[Step]] = {
    "no match: least loaded, first of equals": [
        (A, 320, IDLE, "a"), (B, 320, B_IDLE, "b")],
    "0.4 matched (4 of 10 blocks) > 0.3: the tree's worker though busier": [
        (A[:4], 128, IDLE, "a"), (A, 320, {"a": 5, "b": 0}, "a")],
    "0.3 matched (3 of 10) is not above 0.3: least loaded": [
        (A[:3], 96, IDLE, "a"), (A, 320, {"a": 5, "b": 0}, "b")],
    "96 of 319 tokens (0.301) is above": [
        (A[:3], 96, IDLE, "a"), (A, 319, {"a": 5, "b": 0}, "a")],
    "imbalanced (70 - 5 > 64, 70 > 1.5 x 5): least loaded despite the match": [
        (A[:4], 128, IDLE, "a"), (A[:4], 128, {"a": 70, "b": 5}, "b")],
    "64 apart is not imbalanced": [
        (A[:4], 128, IDLE, "a"), (A[:4], 128, {"a": 69, "b": 5}, "a")],
    "66 apart but 200 < 1.5 x 134 is not imbalanced": [
        (A[:4], 128, IDLE, "a"), (A[:4], 128, {"a": 200, "b": 134}, "a")],
}
# both sent A[:4]: sglang takes the node's creator (a), vllm-router the least loaded of the best
BOTH_HOLD = [(A[:4], 128, IDLE, "a"), (A[:4], 128, {"a": 70, "b": 0}, "b")]
SGLANG_ONLY: dict[str, list[Step]] = {
    "equal matches: the deepest node's creator": BOTH_HOLD + [(A[:4], 128, {"a": 3, "b": 0}, "a")],
    "a split node keeps its creator, a, though b was sent it last": [
        (A[:4], 128, IDLE, "a"), (A[:2], 64, {"a": 70, "b": 0}, "b"),
        (A[:2], 64, {"a": 3, "b": 0}, "a")],
}
VLLM_ONLY: dict[str, list[Step]] = {
    "equal matches: the least loaded of them": BOTH_HOLD + [(A[:4], 128, {"a": 3, "b": 0}, "b")],
    "each worker's own match: b's 2 blocks (0.2) lose to a's 4 (0.4)": [
        (A[:4], 128, IDLE, "a"), (A[:2], 64, {"a": 70, "b": 0}, "b"),
        (A, 320, {"a": 3, "b": 0}, "a")],
}


def _clock(now: list[float]):
    return lambda: now[0]


@pytest.mark.parametrize("steps", [*CACHE_AWARE_CASES.values(), *SGLANG_ONLY.values()],
                         ids=[*CACHE_AWARE_CASES, *SGLANG_ONLY])
def test_sglang_cache_aware_decisions(steps: list[Step]) -> None:
    port = SglangCacheAware(CacheAwareConfig(), BS, _clock([0.0]))
    assert _run(port, steps) == [expected for *_, expected in steps]


@pytest.mark.parametrize("steps", [*CACHE_AWARE_CASES.values(), *VLLM_ONLY.values()],
                         ids=[*CACHE_AWARE_CASES, *VLLM_ONLY])
def test_vllm_router_cache_aware_decisions(steps: list[Step]) -> None:
    port = VllmRouterCacheAware(CacheAwareConfig(), BS, _clock([0.0]))
    assert _run(port, steps) == [expected for *_, expected in steps]


def test_tree_evicts_least_recently_used_leaves_until_within_budget() -> None:
    tree = ApproxTree()
    tree.insert(A[:4], "a")
    tree.insert(B[:4], "a")
    tree.insert(A[:2], "b")  # splits A[:4]; b holds the head only
    assert tree.size == {"a": 8, "b": 2}
    tree.evict(4)
    assert tree.size == {"a": 4, "b": 2}
    assert tree.match_depths(A[:4]) == {"b": 2}  # a's older A[:4] went, b's head stayed
    assert tree.match_depths(B[:4]) == {"a": 4}
    tree.evict(0)
    assert tree.size == {"a": 0, "b": 0} and tree.root.children == {}


@pytest.mark.parametrize("cls, max_tree_size", [
    (SglangCacheAware, 4 * BS),  # its characters taken as tokens: 4 blocks
    (VllmRouterCacheAware, 6 + 8 * 4 * BS),  # key characters: a 6-character tag, 8 a token
])
def test_eviction_runs_at_the_first_decision_after_each_interval(cls: type,
                                                                 max_tree_size: int) -> None:
    now = [0.0]
    port = cls(CacheAwareConfig(eviction_interval_s=60, max_tree_size=max_tree_size), BS,
               _clock(now))
    busy = {"a": 5, "b": 0}
    steps = [(A[:4], 128, IDLE, "a"), (B[:4], 128, IDLE, "a"),  # a holds 8 blocks
             (A[:4], 128, busy, "a")]  # A[:4] used again: B[:4] is now a's oldest
    assert _run(port, steps) == ["a", "a", "a"]
    now[0] = 59.9
    assert port.choose("x", C[:4], 128, REPLICAS, busy) == "b"
    assert port.tree.size == {"a": 8, "b": 4}
    now[0] = 61.0
    assert port.choose("y", A[:4], 128, REPLICAS, busy) == "a"
    assert port.tree.size == {"a": 4, "b": 4}
    assert port.choose("z", B[:4], 128, REPLICAS, busy) == "b"  # a's B[:4] was evicted


def _dynamo(rng: random.Random | None = None) -> DynamoKvRouter:
    return DynamoKvRouter(BS, rng or random.Random(0))


def test_dynamo_logit_is_weighted_prefill_blocks_plus_decode_blocks() -> None:
    port = _dynamo()
    port.kv_events("a", [(True, h) for h in A[:3]])
    assert port.logits(A[:4], 128, REPLICAS)[0] == [5.0, 8.0]  # 32/32 + 4, 128/32 + 4
    assert port.choose("x", A[:4], 128, REPLICAS, IDLE) == "a"
    # x waits for its first token on a: 32 prefill tokens and its 4 blocks
    assert port.logits(A[:4], 128, REPLICAS)[0] == [6.0, 8.0]
    assert port.logits(B[:2], 64, REPLICAS)[0] == [9.0, 4.0]  # (64 + 32)/32 + 2 + 4
    port.first_token("x")
    assert port.logits(B[:2], 64, REPLICAS)[0] == [8.0, 4.0]  # 64/32 + 2 + 4
    port.finished("x")
    assert port.logits(B[:2], 64, REPLICAS)[0] == [4.0, 4.0]
    port.kv_events("a", [(False, A[2])])  # a keeps A[:2]
    assert port.logits(A[:4], 128, REPLICAS)[0] == [6.0, 8.0]


def test_dynamo_ties_go_to_the_smaller_tree_then_at_random() -> None:
    port = _dynamo()
    port.kv_events("a", [(True, 999)])  # a block of no use here: a's tree is larger
    assert port.choose("x", B[:2], 64, REPLICAS, IDLE) == "b"
    expected = REPLICAS[random.Random(7).randrange(2)]
    assert _dynamo(random.Random(7)).choose("y", B[:2], 64, REPLICAS, IDLE) == expected


@pytest.mark.parametrize("logits, temperature, sample, index", [
    ([1.0, 2.0], 1.0, 0.5, 0),  # probabilities 0.73, 0.27
    ([1.0, 2.0], 1.0, 0.8, 1),
    ([3.0, 3.0], 1.0, 0.6, 1),  # equal: uniform
    ([1.0, 2.0, 3.0], 0.5, 0.9, 1),  # -v / 2 / 0.5: 0.665, 0.245, 0.090
    ([1.0, 2.0, 3.0], 0.5, 0.95, 2),
])
def test_dynamo_softmax_sample(logits: list[float], temperature: float, sample: float,
                               index: int) -> None:
    assert softmax_sample(logits, temperature, sample) == index


PARAMS = EngineParams(name="test", block_size=4, kv_blocks=64, max_num_batched_tokens=16,
                      max_num_seqs=8, max_model_len=256, step_base_s=0.010, per_token_s=0.001,
                      per_seq_s=0.0005, per_kv_token_s=0.0001, request_overhead_s=0.002)


@pytest.mark.parametrize("policy", sorted(BASELINES))
def test_each_port_routes_a_simulated_pool(policy: str) -> None:
    rng = random.Random(1)
    rows = [{"timestamp": 25 * k, "input_length": 40, "output_length": 1 + k % 6,
             "hash_ids": [rng.randrange(6), 1000 + k]} for k in range(300)]
    requests = workload.requests(rows, 40.0, tokens_per_id=16, block_size=PARAMS.block_size,
                                 max_prompt_tokens=200, output_tokens=lambda r: r["output_length"])
    loop = EventLoop()
    sim = SimCluster(loop, PARAMS, policy, 4)
    assert sim.baseline is not None and sim.baseline.name == policy
    choose, chosen = sim.baseline.choose, {}

    def spy(request_id: str, *args) -> ReplicaId:
        chosen[request_id] = choose(request_id, *args)
        return chosen[request_id]

    sim.baseline.choose = spy  # type: ignore[method-assign]
    sim.submit(requests)
    loop.run()
    assert len(sim.finished) == len(requests) == len(chosen)
    assert all(r.replica == chosen[r.request_id] for r in requests)
    assert len({r.replica for r in requests}) > 1
    assert all(sim.service.in_flight(r) == 0 for r in sim.replicas)


def test_unknown_baseline_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="dynamo:kv"):
        build_baseline("sglang:round_robin", BS, lambda: 0.0, random.Random())


def _decision(blocks: list[int], sent: float, done: float, engine: int | None) -> Decision:
    return Decision(tuple(blocks), len(blocks) * BS + 1, sent, done, engine)


DECISION_CASES = {
    # the real router sent A to engine 1, then A again: the port keeps A where it went
    "the port's first replica is the real second engine": (
        [_decision(A, 0.0, 10.0, 1), _decision(A, 1.0, 10.0, 1)], 1.0, [1, 1], True),
    # B arrives while A runs on engine 0: the least loaded, engine 1, for B too
    "in-flight requests are the load": (
        [_decision(A, 0.0, 5.0, 0), _decision(B, 1.0, 5.0, 1)], 1.0, [0, 1], False),
    # A ended before B: both idle, the first of equals (engine 0) where the real one took 1
    "an ended request is not load": (
        [_decision(A, 0.0, 0.5, 0), _decision(B, 1.0, 2.0, 1)], 0.5, [0, 0], False),
    # the port would take engine 0 for B, the real router took 1: B's next turn follows the
    # real router's record (the port's own would have kept it on 0)
    "the real choice is recorded, not the port's": (
        [_decision(A, 0.0, 0.5, 0), _decision(B, 1.0, 1.5, 1), _decision(B, 2.0, 3.0, 1)],
        2 / 3, [0, 0, 1], False),
    "an unlogged request is skipped": (
        [_decision(A, 0.0, 9.0, 0), _decision(C, 0.5, 9.0, None), _decision(B, 1.0, 9.0, 1)],
        1.0, [0, None, 1], False),
}


@pytest.mark.parametrize("policy", ["sglang:cache_aware", "vllm-router:cache_aware"])
@pytest.mark.parametrize("case", DECISION_CASES)
def test_a_real_routers_decisions_replay_through_its_port(policy: str, case: str) -> None:
    decisions, share, choices, crosswise = DECISION_CASES[case]
    assert agreement(policy, BS, decisions) == (share, choices, crosswise)


def test_a_port_fed_by_engine_events_is_not_replayed() -> None:
    with pytest.raises(ValueError, match="cannot be replayed"):
        agreement("dynamo:kv", BS, [_decision(A, 0.0, 1.0, 0)])
    with pytest.raises(ValueError, match="two engines"):
        agreement("sglang:cache_aware", BS, [_decision(A, 0.0, 1.0, 2)])


@pytest.mark.parametrize("policy", ["sglang:cache_aware", "vllm-router:cache_aware"])
def test_recording_a_choice_leaves_the_tree_choosing_it_leaves(policy: str) -> None:
    """Three choices made on one port and recorded on another leave the same tree: a cold A
    (the first of equal loads), A's head with B's while a is past the imbalance rule (the least
    loaded, b), and a cold C."""
    chose, recorded = (build_baseline(policy, BS, lambda: 0.0, random.Random(0))
                       for _ in range(2))
    busy = {"a": 200, "b": 0}  # imbalanced: both ports take the least loaded, b
    for blocks, load, target in ((A, IDLE, "a"), (A[:6] + B[:4], busy, "b"), (C, IDLE, "a")):
        assert chose.choose("q", blocks, len(blocks) * BS, REPLICAS, load) == target
        recorded.record(blocks, REPLICAS, ReplicaId(target))
    assert recorded.tree.size == chose.tree.size
    for probe in (A, A[:6] + B[:4], B, C):
        assert recorded.tree.match_depths(probe) == chose.tree.match_depths(probe)
