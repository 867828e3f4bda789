"""The router's own load view: queued prefill work, in-flight counts, online throughput, and the
dispatch history behind prefix_approx."""

from __future__ import annotations

import pytest

from router.index import ReplicaId
from router.load import DispatchHistory, LoadTracker

A, B = ReplicaId("a"), ReplicaId("b")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_queued_work_in_flight_and_measured_throughput() -> None:
    clock = Clock()
    tracker = LoadTracker(prior_tokens_per_s=1000.0, smoothing=0.5, min_sample_tokens=64, clock=clock)
    assert tracker.prefill_tokens_per_s(A) == 1000.0
    tracker.dispatched("r1", A, 1500)
    tracker.dispatched("r2", A, 500)
    assert (tracker.queued_prefill_tokens(A), tracker.in_flight(A)) == (2000, 2)
    clock.now = 0.5
    tracker.first_token("r2")  # 1,500 ahead + 500 own in 0.5 s = 4,000 tokens/s
    assert tracker.prefill_tokens_per_s(A) == 4000.0
    assert (tracker.queued_prefill_tokens(A), tracker.in_flight(A)) == (1500, 2)
    assert tracker.prefill_tokens_per_s(B) == 4000.0  # unmeasured: its measured peers' mean
    clock.now = 1.5
    tracker.first_token("r1")  # 1,500 in 1.5 s = 1,000 tokens/s
    assert tracker.prefill_tokens_per_s(A) == pytest.approx(2500.0)  # 0.5 * 4000 + 0.5 * 1000
    tracker.finished("r1")
    tracker.dispatched("r3", A, 800)
    clock.now = 9.0
    tracker.finished("r3")  # ended without a first token (not streamed): not a sample
    assert tracker.prefill_tokens_per_s(A) == pytest.approx(2500.0)
    tracker.finished("r2")
    tracker.finished("r2")  # idempotent
    assert (tracker.queued_prefill_tokens(A), tracker.in_flight(A)) == (0, 0)
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


def test_small_samples_do_not_move_the_estimate_and_forget_clears_a_replica() -> None:
    clock = Clock()
    tracker = LoadTracker(prior_tokens_per_s=1000.0, min_sample_tokens=64, clock=clock)
    tracker.dispatched("r1", A, 10)
    clock.now = 1.0
    tracker.first_token("r1")
    assert tracker.prefill_tokens_per_s(A) == 1000.0
    tracker.dispatched("r2", A, 100)
    tracker.forget(A)
    assert (tracker.queued_prefill_tokens(A), tracker.in_flight(A)) == (0, 0)
    tracker.finished("r2")  # the request of a forgotten replica ends quietly
    assert tracker.in_flight(A) == 0


def test_dispatch_history_prefix_ttl_and_capacity() -> None:
    clock = Clock()
    history = DispatchHistory(ttl_s=10.0, capacity=4, clock=clock)
    history.record(A, [1, 2, 3])
    assert history.cached_blocks(A, [1, 2, 9]) == 2
    assert history.cached_blocks(B, [1, 2]) == 0
    clock.now = 11.0
    assert history.cached_blocks(A, [1]) == 0  # expired
    history.record(B, [1, 2])  # 5 entries > capacity 4: the oldest (a, 1) goes
    assert history.cached_blocks(B, [1, 2]) == 2
    clock.now = 12.0
    history.record(A, [2, 3])
    assert history.cached_blocks(A, [1, 2]) == 0  # (a, 1) is gone, so the prefix breaks there
    history.forget(B)
    assert history.cached_blocks(B, [1]) == 0
