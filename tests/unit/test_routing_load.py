"""The router's own load view: queued prefill work, in-flight counts, online throughput, and the
dispatch history behind prefix_approx."""

from __future__ import annotations

import math
import random

import pytest

from router.index import ReplicaId
from router.load import CacheChurn, DispatchHistory, LoadTracker
from router.ttft_model import TTFTModel

A, B, C, D = ReplicaId("a"), ReplicaId("b"), ReplicaId("c"), ReplicaId("d")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Recorder(TTFTModel):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple] = []

    def observe(self, replica, work_tokens, busy, elapsed_s) -> None:
        self.seen.append((replica, work_tokens, busy, elapsed_s))


def test_queued_work_in_flight_and_first_token_samples() -> None:
    clock, model = Clock(), Recorder()
    tracker = LoadTracker(model, clock=clock)
    tracker.dispatched("r1", A, 1500)
    tracker.dispatched("r2", A, 500)
    assert (tracker.queued_prefill_tokens(A), tracker.in_flight(A)) == (2000, 2)
    clock.now = 0.5
    tracker.first_token("r2")  # 1,500 ahead + 500 own, beside 1 request, in 0.5 s
    assert model.seen == [(A, 2000, 1, 0.5)]
    assert (tracker.queued_prefill_tokens(A), tracker.in_flight(A)) == (1500, 2)
    assert tracker.streaming(A) == 1
    clock.now = 1.5
    tracker.first_token("r1")
    tracker.first_token("r1")  # once only
    assert model.seen[1:] == [(A, 1500, 0, 1.5)]
    assert tracker.streaming(A) == 2
    tracker.finished("r1")
    assert (tracker.in_flight(A), tracker.streaming(A)) == (1, 1)
    tracker.dispatched("r3", A, 800)
    clock.now = 9.0
    tracker.finished("r3")  # ended without a first token (not streamed): not a sample
    assert len(model.seen) == 2
    tracker.finished("r2")
    tracker.finished("r2")  # idempotent
    assert (tracker.queued_prefill_tokens(A), tracker.in_flight(A), tracker.streaming(A)) \
        == (0, 0, 0)
    assert tracker.in_flight(B) == 0


def test_a_request_counted_on_its_first_choice_moves_when_placed_elsewhere() -> None:
    tracker = LoadTracker()
    tracker.dispatched("r1", A, 300)  # ranked: counted on the first choice at once
    tracker.dispatched("r1", A, 300)  # confirmed there: no double count
    assert (tracker.queued_prefill_tokens(A), tracker.in_flight(A)) == (300, 1)
    tracker.dispatched("r1", B, 200)  # A was full, Serve placed it on B
    assert (tracker.queued_prefill_tokens(A), tracker.in_flight(A)) == (0, 0)
    assert (tracker.queued_prefill_tokens(B), tracker.in_flight(B)) == (200, 1)
    tracker.finished("r1")
    assert (tracker.queued_prefill_tokens(B), tracker.in_flight(B)) == (0, 0)
    tracker.dispatched("r2", B, 100)
    tracker.first_token("r2")
    assert tracker.streaming(B) == 1
    tracker.forget(B)
    assert (tracker.queued_prefill_tokens(B), tracker.in_flight(B), tracker.streaming(B)) \
        == (0, 0, 0)
    tracker.finished("r2")  # the request of a forgotten replica ends quietly
    assert tracker.in_flight(B) == 0


def test_ttft_model_starts_at_the_prior_and_fits_the_observed_law() -> None:
    model = TTFTModel(prior_tokens_per_s=4000.0, prior_in_flight_cost_tokens=128.0,
                      prior_overhead_s=0.02)
    prior = model.params(A)
    assert (prior.tokens_per_s, prior.in_flight_cost_tokens, prior.overhead_s) == \
        pytest.approx((4000.0, 128.0, 0.02))
    rng = random.Random(0)
    for _ in range(300):  # truth: 30 ms + work / 10,000 tok/s + 50 ms per busy request
        work, busy = rng.randrange(0, 4000), rng.randrange(0, 6)
        model.observe(A if rng.random() < 0.5 else B, work, busy, 0.03 + work / 10000 + 0.05 * busy)
    fitted = model.params(A)
    assert fitted.tokens_per_s == pytest.approx(10000, rel=0.05)
    assert fitted.in_flight_cost_tokens == pytest.approx(500, rel=0.05)  # 50 ms at 10k tok/s
    assert fitted.overhead_s == pytest.approx(0.03, abs=0.005)
    assert model.speed(A) == pytest.approx(1.0, abs=0.05)


def test_a_slower_replica_shows_in_its_speed_while_noise_does_not() -> None:
    model = TTFTModel(prior_tokens_per_s=10000.0, prior_in_flight_cost_tokens=0.0,
                      prior_overhead_s=0.0)
    rng = random.Random(1)
    for _ in range(200):  # b takes twice as long for the same work; a is noisy (+-30%)
        work = rng.randrange(500, 3000)
        model.observe(A, work, 0, work / 10000 * rng.uniform(0.7, 1.3))
        model.observe(B, work, 0, 2 * work / 10000)
    speed_a, speed_b = model.speed(A), model.speed(B)
    assert speed_b / speed_a == pytest.approx(2.0, rel=0.15)
    assert model.params(B).tokens_per_s == pytest.approx(model.params(A).tokens_per_s / (speed_b / speed_a))
    model.forget(B)
    assert model.speed(B) == 1.0


def test_dispatch_history_ttl_in_generations() -> None:
    """Records are kept in generations of TTL / 2: one counts for at least the TTL, and until
    its generation ended a TTL ago."""
    clock = Clock()
    history = DispatchHistory(ttl_s=10.0, stride=1, clock=clock)
    history.record(A, [1, 2, 3])  # a generation from 0 s to 5 s
    assert history.longest_prefix([1, 2, 9]) == {A: 2}
    assert history.longest_prefix([9, 1]) == {}
    clock.now = 14.9
    assert history.longest_prefix([1]) == {A: 1}
    clock.now = 15.0
    assert history.longest_prefix([1]) == {}
    assert len(history) == 0


def test_dispatch_history_capacity() -> None:
    clock = Clock()
    history = DispatchHistory(ttl_s=10.0, capacity=4, stride=1, clock=clock)
    history.record(A, [1, 2, 3])
    clock.now = 6.0
    history.record(B, [1, 2])  # a new generation; 5 records > 4: the old one's last block goes
    assert len(history) == 4
    assert history.longest_prefix([1, 2, 3]) == {A: 2, B: 2}
    clock.now = 7.0
    history.record(A, [2, 3])  # 6: the old generation's 2, then 1, go
    assert len(history) == 4
    assert history.longest_prefix([1, 2, 3]) == {B: 2}
    assert history.longest_prefix([2, 3]) == {A: 2, B: 1}
    history.forget(B)
    assert history.longest_prefix([2]) == {A: 1}
    assert len(history) == 2


def test_a_full_history_forgets_the_oldest_records_not_the_newest() -> None:
    """Within one TTL, a generation ends once it holds capacity / 8 pairs, so the pairs that
    leave a full history are old ones."""
    history = DispatchHistory(ttl_s=300.0, capacity=16, stride=1, clock=Clock())
    for block in range(40):
        history.record(A, [block])
    assert len(history) <= 16
    assert all(history.longest_prefix([b]) == {A: 1} for b in range(28, 40))
    assert all(history.longest_prefix([b]) == {} for b in range(0, 20))


def test_dispatch_history_answers_every_replica_in_one_walk() -> None:
    """Replicas drop out where their prefix ends, or where their record is past the TTL, and
    keep the depth they reached (the docstring's example, and more)."""
    clock = Clock()
    history = DispatchHistory(ttl_s=300.0, stride=1, clock=clock)
    history.record(B, [1, 2, 3])  # a generation from 0 s to 150 s
    clock.now = 200.0
    history.record(A, [1, 2])
    history.record(C, [1, 2, 3, 4])
    history.record(D, [1, 2, 3, 5])
    assert history.longest_prefix([1, 2, 3]) == {A: 2, B: 3, C: 3, D: 3}
    assert history.longest_prefix([1, 2, 3, 4, 6]) == {A: 2, B: 3, C: 4, D: 3}
    clock.now = 450.0  # B's generation ended 300 s ago; the others' started 250 s ago
    assert history.longest_prefix([1, 2, 3, 5]) == {A: 2, C: 3, D: 4}
    assert len(history) == 10


def test_dispatch_history_tables_are_not_walked_by_the_garbage_collector() -> None:
    import gc

    history = DispatchHistory(stride=1)
    for i in range(300):
        history.record(ReplicaId(f"r{i}"), list(range(i, i + 50)))
    gc.collect()
    (generation,) = history._generations
    assert len(generation.sent) == len(history._sent) == 349
    assert not gc.is_tracked(generation.sent) and not gc.is_tracked(history._sent)


def test_dispatch_history_keeps_every_stride_th_block_and_the_last() -> None:
    """The docstring's example (stride 4): a 10-block prompt keeps blocks 4, 8 and 10."""
    history = DispatchHistory(stride=4)
    sent = list(range(100, 110))
    history.record(A, sent)
    assert len(history) == 3
    assert history.longest_prefix(sent[:9] + [0]) == {A: 8}
    assert history.longest_prefix(sent) == {A: 10}
    assert history.longest_prefix(sent + [7, 8]) == {A: 8}  # its blocks 4, 8, 12 are looked up
    assert history.longest_prefix(sent[:3]) == {}  # the last block, 3, was not kept
    history.forget_blocks(A, [sent[1]])  # not kept: nothing changes
    assert history.longest_prefix(sent) == {A: 10}
    history.forget_blocks(A, [sent[7]])  # kept: the prefix breaks there
    assert history.longest_prefix(sent) == {A: 4}


def test_a_replica_measured_slow_once_fades_back_to_the_pool() -> None:
    """The docstring's example: one sample took 1.0 s where 0.15 s was predicted."""
    clock = Clock()
    model = TTFTModel(prior_tokens_per_s=4000.0, prior_in_flight_cost_tokens=0.0,
                      prior_overhead_s=0.02, clock=clock)
    model.observe(A, 520, 0, 1.0)  # predicted 0.02 + 0.13 = 0.15 s
    assert model.speed(A) == pytest.approx(math.exp(math.log(3) / 6), abs=0.001)  # 1.20
    clock.now = 30.0
    assert model.speed(A) == pytest.approx(math.exp(0.5 * math.log(3) / 5.5), abs=0.001)
    clock.now = 300.0
    assert model.speed(A) == pytest.approx(1.0, abs=0.01)
    assert model.speed(B) == 1.0


def test_dispatch_history_forgets_what_the_engine_evicted() -> None:
    history = DispatchHistory(stride=1)
    history.record(A, [1, 2, 3])
    history.record(B, [1, 2, 3])
    history.forget_blocks(A, [2])
    assert history.longest_prefix([1, 2, 3]) == {A: 1, B: 3}


def test_cache_churn_counts_recent_stores_and_forgets_old_ones() -> None:
    """The docstring's example: 300 blocks stored, read 60 s later."""
    clock = Clock()
    churn = CacheChurn(window_s=60.0, clock=clock)
    assert churn.recent(A, 1000) == 0.0  # first read: the counter's history is not churn
    clock.now = 1.0
    assert churn.recent(A, 1300) == pytest.approx(300.0)
    clock.now = 61.0
    assert churn.recent(A, 1300) == pytest.approx(300.0 / math.e)
    churn.forget(A)
    assert churn.recent(A, 1400) == 0.0
