"""Scorer, filter, picker and policy tables with exact expected picks."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.index import ReplicaId
from router.pickers import MaxScorePicker, RoundRobinPicker
from router.plugins import Candidate, RouteRequest
from router.policies import build_policy
from router.scorers import (ApproxPrefixScorer, CacheRoomScorer, DelayScorer, KVUsageScorer,
                            OverloadFilter, PrefixScorer, QueueScorer, TTFTScorer,
                            TTFTTargetFilter)

A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")
REQ = RouteRequest(prompt_tokens=2048, block_size=128)


def cand(replica: str, **fields) -> Candidate:
    return Candidate(replica=ReplicaId(replica), **fields)


@pytest.mark.parametrize(("scorer", "candidates", "expected"), [
    (PrefixScorer(), [cand("a", cached_tokens=1536), cand("b")], [0.75, 0.0]),
    (ApproxPrefixScorer(), [cand("a"), cand("b", approx_cached_tokens=1024)], [0.0, 0.5]),
    (QueueScorer(), [cand("a", in_flight=2), cand("b", in_flight=6), cand("c", in_flight=4)],
     [1.0, 0.0, 0.5]),
    (QueueScorer(), [cand("a", in_flight=3), cand("b", in_flight=3)], [1.0, 1.0]),
    (KVUsageScorer(), [cand("a", kv_usage=0.9), cand("b", kv_usage=0.2)], [0.1, 0.8]),
    # The docstring's example: the hot replica is too busy, recomputing on b is faster ...
    (TTFTScorer(), [cand("a", cached_tokens=1536, queued_prefill_tokens=3000),
                    cand("b")], [0.512 / 0.878, 1.0]),
    # ... but with less queued on a, affinity wins.
    (TTFTScorer(), [cand("a", cached_tokens=1536, queued_prefill_tokens=1000),
                    cand("b")], [1.0, 0.378 / 0.512]),
    # Requests in flight count as work ahead: 2 x 128 tokens (the docstring's example).
    (TTFTScorer(), [cand("a", cached_tokens=1536, queued_prefill_tokens=3000, in_flight=2),
                    cand("b")], [0.512 / 0.942, 1.0]),
    # Short prompts, nothing cached: the idle replica beats the one with requests in flight.
    (TTFTScorer(), [cand("a", in_flight=1), cand("b")], [2048 / (2048 + 128), 1.0]),
    # A fixed overhead shrinks the relative differences: 0.1 s + work.
    (TTFTScorer(), [cand("a", in_flight=1, overhead_s=0.1), cand("b", overhead_s=0.1)],
     [(0.1 + 0.512) / (0.1 + 0.544), 1.0]),
    # A replica measured twice as fast halves its estimate.
    (TTFTScorer(), [cand("a", prefill_tokens_per_s=8000.0), cand("b")], [1.0, 0.5]),
    # The docstring's example: b holds nothing and runs 4 requests, each of which would wait
    # through the 2,048-token prefill: 0.640 + 2.048 s against a's 0.442 + 0.256 s ...
    (DelayScorer(), [cand("a", cached_tokens=1536, queued_prefill_tokens=1000, in_flight=2),
                     cand("b", in_flight=4)], [1.0, 0.698 / 2.688]),
    # ... where the request's own wait alone favours a by less
    (TTFTScorer(), [cand("a", cached_tokens=1536, queued_prefill_tokens=1000, in_flight=2),
                    cand("b", in_flight=4)], [1.0, 0.442 / 0.640]),
    # nothing in flight anywhere: the delay is the request's own TTFT
    (DelayScorer(), [cand("a", cached_tokens=1536, queued_prefill_tokens=3000), cand("b")],
     [0.512 / 0.878, 1.0]),
    # a prompt held whole adds no prefill: the busy holder (0.256 s) beats the idle b (0.512 s)
    (DelayScorer(), [cand("a", cached_tokens=2048, in_flight=8), cand("b")], [1.0, 0.5]),
    # The docstring's example: a new prompt goes where the cache has the most room ...
    (CacheRoomScorer(), [cand("a", cache_fill=1.5), cand("b", cache_fill=0.5)], [0.6, 1.0]),
    # ... and the room counts as much as the prompt is new (75% held on a).
    (CacheRoomScorer(), [cand("a", cache_fill=1.5, cached_tokens=1536), cand("b", cache_fill=0.5)],
     [0.15, 0.25]),
    # what this router sent there counts as held too; a prompt held whole scores 0 everywhere
    (CacheRoomScorer(), [cand("a", cache_fill=3.0, approx_cached_tokens=2048), cand("b")],
     [0.0, 0.0]),
    # equal rooms: no preference
    (CacheRoomScorer(), [cand("a", cache_fill=0.2), cand("b", cache_fill=0.2)], [1.0, 1.0]),
])
def test_scorers(scorer, candidates, expected) -> None:
    assert scorer.score(REQ, candidates) == pytest.approx(expected, abs=1e-3)


def test_scorers_without_a_readable_prompt_do_not_divide_by_zero() -> None:
    empty = RouteRequest()
    assert PrefixScorer().score(empty, [cand("a", cached_tokens=5)]) == [0.0]
    assert TTFTScorer().score(empty, [cand("a"), cand("b")]) == [1.0, 1.0]
    assert DelayScorer().score(empty, [cand("a"), cand("b")]) == [1.0, 1.0]


@pytest.mark.parametrize(("in_flight", "kept"), [
    ([8, 3], ["b"]), ([8, 9], ["a", "b"]), ([1, 2], ["a", "b"]), ([7, 8, 0], ["a", "c"]),
])
def test_overload_filter(in_flight, kept) -> None:
    candidates = [cand(name, in_flight=n) for name, n in zip("abc", in_flight)]
    assert [c.replica for c in OverloadFilter(8).filter(REQ, candidates)] == kept


@pytest.mark.parametrize(("in_flight", "slots", "kept"), [
    ([100, 8], [256, 8], ["a"]),  # the docstring's example: each replica's own batch
    ([100, 8], [256, 0], ["a", "b"]),  # b has not reported it: 64
    ([64, 8], [0, 16], ["b"]),
    ([256, 8], [256, 8], ["a", "b"]),  # all full: both remain
])
def test_overload_filter_without_a_bound_reads_each_engines_batch(in_flight, slots,
                                                                  kept) -> None:
    candidates = [cand(name, in_flight=n, batch_slots=s)
                  for name, n, s in zip("ab", in_flight, slots)]
    assert [c.replica for c in OverloadFilter().filter(REQ, candidates)] == kept
    fixed = OverloadFilter(300).filter(REQ, candidates)  # a set bound overrides the engines'
    assert [c.replica for c in fixed] == ["a", "b"]


@pytest.mark.parametrize(("queued", "kept"), [
    # estimates at 4,000 tokens/s with the prompt uncached: (queued + 2,048) / 4,000
    ([100, 0], ["a", "b"]),  # 0.537 and 0.512 s, both within 0.6 s
    ([1000, 0], ["b"]),  # 0.762 s is past it
    ([1000, 1400, 0], ["c"]),
    ([1000, 1400], ["a", "b"]),  # none within: both remain
])
def test_ttft_target_filter(queued, kept) -> None:
    candidates = [cand(name, queued_prefill_tokens=n) for name, n in zip("abc", queued)]
    assert [c.replica for c in TTFTTargetFilter(0.6).filter(REQ, candidates)] == kept


def test_kv_aware_keeps_a_popular_prefix_within_the_ttft_target() -> None:
    """The prefix's holder is estimated at 0.942 s (3,000 queued, 2 in flight, 1,536 of 2,048
    tokens held), an idle replica at 0.512 s. Affinity keeps the holder without a target (its
    score 0.544 + 0.75 + 0.25 against 1.0 + 0 + 0.25); a 0.8 s target sends the request away, and a
    1 s target allows the holder again."""
    holder = cand("a", cached_tokens=1536, approx_cached_tokens=1536,
                  queued_prefill_tokens=3000, in_flight=2)
    candidates = [holder, cand("b")]
    assert holder.estimated_ttft_s(REQ) == pytest.approx(0.942)

    def first(target: float) -> ReplicaId:
        policy = build_policy("kv_aware", ttft_target_s=target, rng=random.Random(1))
        return policy.rank(REQ, candidates).ranked[0].replica

    assert (first(0.0), first(0.8), first(1.0)) == (A, B, A)
    # the target needs the estimate even where no scorer reads it
    policy = build_policy("kv_aware", {"queue": 1.0}, ttft_target_s=0.8)
    assert policy.reads_ttft_model and policy.reads_block_map and policy.uses_prefixes
    assert not build_policy("kv_aware", {"queue": 1.0}).reads_ttft_model


def test_max_score_picker_breaks_near_ties_at_random_and_keeps_the_rest_in_order() -> None:
    candidates = [cand("a"), cand("b"), cand("c")]
    firsts = {MaxScorePicker(0.05, random.Random(seed)).rank(candidates, [1.0, 0.97, 0.5])[0].replica
              for seed in range(20)}
    assert firsts == {A, B}
    ranked = MaxScorePicker(0.05, random.Random(0)).rank(candidates, [1.0, 0.97, 0.5])
    assert ranked[2].replica == C
    assert [c.replica for c in MaxScorePicker(0.0).rank(candidates, [0.2, 0.9, 0.5])] == [B, C, A]


def test_round_robin_picker_turns_by_replica_id() -> None:
    picker = RoundRobinPicker()
    candidates = [cand("c"), cand("a"), cand("b")]
    firsts = [picker.rank(candidates, [0, 0, 0])[0].replica for _ in range(4)]
    assert firsts == [A, B, C, A]


def test_round_robin_ranks_ids_in_the_same_turn_without_snapshots() -> None:
    """The ids alone, in the order `rank` gives, the turn shared; a pool that changes is
    ordered again."""
    picker = RoundRobinPicker()
    assert picker.rank_ids(["c", "a", "b"]) == [A, B, C]
    assert [c.replica for c in picker.rank([cand("b"), cand("a"), cand("c")], [0, 0, 0])] \
        == [B, C, A]
    assert picker.rank_ids(["c", "a", "b"]) == [C, A, B]
    assert picker.rank_ids(["d", "a"]) == ["d", A]  # turn 3 of 2 replicas: the second first
    assert picker.rank_ids([]) == []
    assert build_policy("round_robin").ranks_ids
    assert not any(build_policy(name).ranks_ids for name in ("kv_aware", "least_loaded"))


@pytest.mark.parametrize(("name", "weights", "blocks", "events", "model"), [
    ("kv_aware", None, True, True, True),
    ("kv_aware", {"delay": 1.0}, True, True, True),
    ("kv_aware", {"approx_prefix": 1.0, "queue": 1.0}, True, False, False),
    ("prefix_approx", None, True, False, False),
    ("least_loaded", None, False, False, False),
    ("round_robin", None, False, False, False),
])
def test_what_a_policy_reads(name, weights, blocks, events, model) -> None:
    """The request's blocks, the engine-fed map and the replicas' TTFT models are read only
    where a scorer needs them."""
    policy = build_policy(name, weights)
    assert (policy.uses_prefixes, policy.reads_block_map, policy.reads_ttft_model) \
        == (blocks, events, model)


@pytest.mark.parametrize(("policy", "candidates", "first"), [
    # kv_aware: affinity when the holder is not busy ...
    ("kv_aware", [cand("a", cached_tokens=1536, queued_prefill_tokens=1000), cand("b")], A),
    # ... load when it is.
    ("kv_aware", [cand("a", cached_tokens=1536, queued_prefill_tokens=3000), cand("b")], B),
    # a hot prefix on a replica at max_in_flight goes elsewhere, however much is cached there
    ("kv_aware", [cand("a", cached_tokens=2048, in_flight=64), cand("b", queued_prefill_tokens=9000)], B),
    # kv_aware keeps a conversation where it went unless that replica is about 2x slower (the
    # example in router/README.md): a's estimate 0.9 s vs 0.5 s -> a; 3 s vs 0.5 s -> b
    ("kv_aware", [cand("a", cached_tokens=1536, approx_cached_tokens=1536,
                       queued_prefill_tokens=3088), cand("b")], A),
    ("kv_aware", [cand("a", cached_tokens=1536, approx_cached_tokens=1536,
                       queued_prefill_tokens=11488), cand("b")], B),
    # a new prompt on idle replicas goes where the cache has room, not to the one measured
    # faster: a is 20% faster but its cache is full and turning over, b's is half empty
    ("kv_aware", [cand("a", prefill_tokens_per_s=4800.0, cache_fill=2.0),
                  cand("b", cache_fill=0.5)], B),
    # ... unless the faster one is much faster (twice: 0.256 s against 0.512 s, score 1 + 0.75
    # against 0.5 + 1)
    ("kv_aware", [cand("a", prefill_tokens_per_s=8000.0, cache_fill=1.0),
                  cand("b", cache_fill=0.5)], A),
    # prefix_approx: 0.75 affinity vs 0.5 * queue
    ("prefix_approx", [cand("a", approx_cached_tokens=1536, in_flight=6), cand("b", in_flight=2)], A),
    ("prefix_approx", [cand("a", approx_cached_tokens=256, in_flight=6), cand("b", in_flight=2)], B),
])
def test_policies_pick(policy, candidates, first) -> None:
    picked = build_policy(policy, rng=random.Random(1)).rank(REQ, candidates)
    assert picked.ranked[0].replica == first
    assert {c.replica for c in picked.ranked} == {c.replica for c in candidates}


def test_weights_replace_the_policy_defaults_and_unknown_names_are_refused() -> None:
    policy = build_policy("kv_aware", {"kv_usage": 1.0}, rng=random.Random(1))
    ranked = policy.rank(REQ, [cand("a", cached_tokens=2048, kv_usage=0.9), cand("b")]).ranked
    assert ranked[0].replica == B
    with pytest.raises(ValueError, match="unknown scorer"):
        build_policy("kv_aware", {"bogus": 1.0})
    with pytest.raises(ValueError, match="unknown routing policy"):
        build_policy("fastest")


POOL = [ReplicaId(name) for name in "abcdefgh"]


def test_shortlist_scores_the_prefix_holders_and_a_sample_of_the_others() -> None:
    """The docstring's example (max 4): holders c (10 blocks) and f (3); z is not offered."""
    policy = build_policy("kv_aware", max_candidates=4, rng=random.Random(0))
    scored, rest = policy.shortlist(POOL, {ReplicaId("c"): 10, ReplicaId("f"): 3,
                                           ReplicaId("z"): 5})
    assert scored[:2] == ["c", "f"] and len(scored) == 4 and len(rest) == 4
    assert sorted(scored + rest) == POOL
    many = {r: depth for depth, r in enumerate(POOL[:5], start=1)}  # holders take half at most
    scored, rest = policy.shortlist(POOL, many)
    assert scored[:2] == ["e", "d"] and set(scored[2:]) <= set(POOL) - {"e", "d"}


@pytest.mark.parametrize(("name", "max_candidates", "offered"), [
    ("kv_aware", 0, 8),  # no bound
    ("kv_aware", 8, 8),  # within the bound
    ("round_robin", 4, 8),  # no scorers: turns over every replica
])
def test_shortlist_scores_everyone_when_it_should(name, max_candidates, offered) -> None:
    policy = build_policy(name, max_candidates=max_candidates, rng=random.Random(0))
    assert policy.shortlist(POOL[:offered], {}) == (POOL[:offered], [])


def test_shortlist_samples_uniformly() -> None:
    """With no prefix held, each of 8 replicas is scored in 4 of 8 shortlists, within 5% of
    2,000 draws (about 4 standard deviations)."""
    policy = build_policy("least_loaded", max_candidates=4, rng=random.Random(1))
    counts = Counter(r for _ in range(2000) for r in policy.shortlist(POOL, {})[0])
    assert all(abs(counts[r] - 1000) < 100 for r in POOL), counts


def test_shortlist_draws_among_holders_of_equal_depth() -> None:
    """Eight replicas hold the prompt equally, the shortlist has room for two of them: each is
    among those two about a quarter of the time (not the same two every time)."""
    policy = build_policy("kv_aware", max_candidates=4, rng=random.Random(2))
    equal = dict.fromkeys(POOL, 5)
    counts = Counter(r for _ in range(800) for r in policy.shortlist(POOL, equal)[0][:2])
    assert all(counts[r] > 100 for r in POOL), counts
