"""The autoscaling policy: exact desired counts, no flapping, bursts seen before latency."""

from __future__ import annotations

import random

import pytest

from autoscaler.policy import Decision, Targets, decide
from autoscaler.signals import PoolSignals, Window, pool_signals

UNIFIED = Targets(role="unified", min_replicas=1, max_replicas=4, ttft_p90_s=2.0, itl_p90_s=0.2,
                  max_kv_usage=0.85, target_ongoing=8, max_waiting_per_replica=4,
                  scale_down_margin=0.5, downscale_delay_s=30, idle_to_zero_s=300)
DECODE = Targets(**{**{f: getattr(UNIFIED, f) for f in UNIFIED.__struct_fields__},
                    "role": "decode", "max_replicas": 8})
PREFILL = Targets(**{**{f: getattr(UNIFIED, f) for f in UNIFIED.__struct_fields__},
                     "role": "prefill"})


def sig(replicas: int, **kw: float) -> PoolSignals:
    return PoolSignals(replicas=replicas, **kw)


@pytest.mark.parametrize("signals,targets,current,expected,reason", [
    # the docstring's worked examples
    (sig(2, running=15, waiting=4), UNIFIED, 2, 3, "load"),  # 19 ongoing / 8
    (sig(1, running=2, waiting=9), UNIFIED, 1, 3, "burst"),  # 1 + ceil(9 / 8)
    (sig(2, running=4, itl_p90_s=0.3), DECODE, 2, 3, "ITL"),  # ceil(2 x 0.3 / 0.2)
    # the same ITL with one request in the pool is the engine's floor: no ask
    (sig(2, running=3, itl_p90_s=0.3), DECODE, 2, 2, "within targets"),
    (sig(1, running=1, ttft_p90_s=5.0), PREFILL, 1, 1, "within targets"),
    (sig(2, running=4, kv_cache_usage=0.9), DECODE, 2, 3, "KV"),
    (sig(1, running=2, ttft_p90_s=5.0), PREFILL, 1, 3, "TTFT"),  # ceil(1 x 5 / 2)
    # 90,000 queued prompt tokens at 20,000/s take 4.5 s > 2 s: ceil(90,000 / 40,000)
    (sig(1, running=2, queued_prompt_tokens=90_000, prefill_capacity_tokens_per_s=20_000),
     PREFILL, 1, 3, "backlog"),
    # the same backlog on 3 replicas drains in 1.5 s: within the target
    (sig(3, running=6, queued_prompt_tokens=90_000, prefill_capacity_tokens_per_s=20_000),
     PREFILL, 3, 3, "within targets"),
    # a backlog with no capacity measured yet asks for nothing; decode pools ignore it
    (sig(1, running=2, queued_prompt_tokens=90_000), PREFILL, 1, 1, "within targets"),
    (sig(1, running=2, queued_prompt_tokens=90_000, prefill_capacity_tokens_per_s=20_000),
     DECODE, 1, 1, "within targets"),
    # latency targets apply by role: prefill ignores ITL, decode ignores TTFT
    (sig(1, running=2, itl_p90_s=1.0), PREFILL, 1, 1, "within targets"),
    (sig(1, running=2, ttft_p90_s=9.0), DECODE, 1, 1, "within targets"),
    # bounds
    (sig(4, running=80), UNIFIED, 4, 4, "at max_replicas"),
    (sig(1, running=80), UNIFIED, 1, 4, "load"),
    (sig(5, running=1), UNIFIED, 5, 4, "above max_replicas"),
    # steady, inside the band: nothing moves
    (sig(2, running=10, ttft_p90_s=1.5), UNIFIED, 2, 2, "within targets"),
    # from zero: a waiting request brings one replica back
    (sig(0), UNIFIED, 0, 1, "below min_replicas"),
    (sig(0, waiting=1), Targets(role="unified", min_replicas=0, max_replicas=2), 0, 1,
     "zero replicas"),
    (sig(0), Targets(role="unified", min_replicas=0, max_replicas=2), 0, 0, "idle at zero"),
])
def test_decision_table(signals: PoolSignals, targets: Targets, current: int, expected: int,
                        reason: str) -> None:
    decision = decide(signals, targets, current, now=100.0)
    assert (decision.replicas, reason in decision.reason) == (expected, True), decision


def test_scale_down_waits_for_calm_and_steps_one_at_a_time() -> None:
    calm = sig(3, running=6)  # the docstring's example: 6 <= 0.5 x 8 x 2
    d = decide(calm, UNIFIED, 3, now=0.0)
    assert d.replicas == 3 and d.calm_since == 0.0
    d = decide(calm, UNIFIED, 3, now=29.0, calm_since=d.calm_since)
    assert d.replicas == 3
    d = decide(calm, UNIFIED, 3, now=30.0, calm_since=d.calm_since)
    assert d.replicas == 2 and "calm for 30s" in d.reason
    # 2 -> 1 would need 6 <= 0.5 x 8 x 1: it stays at 2 however long it is calm
    d = decide(sig(2, running=6), UNIFIED, 2, now=100.0, calm_since=d.calm_since)
    assert d.replicas == 2 and d.calm_since is None
    # one busy moment restarts the clock
    d = decide(sig(3, running=6), UNIFIED, 3, now=0.0)
    d = decide(sig(3, running=6, waiting=1), UNIFIED, 3, now=20.0, calm_since=d.calm_since)
    assert d.calm_since is None
    d = decide(sig(3, running=6), UNIFIED, 3, now=40.0, calm_since=d.calm_since)
    assert d.replicas == 3


def test_never_below_min_and_to_zero_only_when_allowed() -> None:
    d = decide(sig(1), UNIFIED, 1, now=1000.0, calm_since=0.0, idle_since=0.0)
    assert d.replicas == 1
    zero = Targets(role="unified", min_replicas=0, max_replicas=2, idle_to_zero_s=300)
    d = decide(sig(1), zero, 1, now=299.0, idle_since=0.0)
    assert d.replicas == 1 and d.idle_since == 0.0
    d = decide(sig(1), zero, 1, now=300.0, idle_since=d.idle_since)
    assert d.replicas == 0 and "scale to zero" in d.reason
    assert decide(sig(1, running=1), zero, 1, now=900.0, idle_since=0.0).idle_since is None


def _run(timeline, targets: Targets, current: int) -> list[Decision]:
    decisions, calm, idle = [], None, None
    for now, signals in timeline:
        d = decide(signals, targets, current, now, calm, idle)
        calm, idle, current = d.calm_since, d.idle_since, d.replicas
        decisions.append(d)
    return decisions


def test_no_flapping_under_noisy_steady_load() -> None:
    """Load wanders between 9 and 15 ongoing on 2 replicas (target 8 each), latencies between
    40% and 95% of target: 10 minutes of decisions every second never move the pool."""
    rng = random.Random(7)
    timeline = [(float(t), sig(2, running=rng.uniform(9, 15),
                               ttft_p90_s=rng.uniform(0.8, 1.9), itl_p90_s=rng.uniform(0.08, 0.19),
                               kv_cache_usage=rng.uniform(0.3, 0.8))) for t in range(600)]
    assert {d.replicas for d in _run(timeline, UNIFIED, 2)} == {2}


def test_burst_scales_up_before_latency_breaches() -> None:
    """A burst: the queue grows by 3 requests a second from t=10 on one replica that serves 8.
    TTFT follows the queue with a lag (each waiting request beyond 3 adds 0.15 s) and crosses
    the 2 s target at t=14; the queue's rules ask for more replicas at t=10, four seconds
    earlier, while TTFT is still 0.3 s, and the burst rule takes over as the queue grows."""
    timeline = []
    for t in range(0, 20):
        waiting = max(0, 3 * (t - 9))
        ttft = 0.3 + 0.15 * max(0, waiting - 3)  # the queue shows in latency later
        timeline.append((float(t), sig(1, running=min(8, 4 + waiting), waiting=waiting,
                                       ttft_p90_s=ttft)))
    decisions = _run(timeline, UNIFIED, 1)
    first_up = next(t for (t, _), d in zip(timeline, decisions) if d.replicas > 1)
    breach = next(t for t, s in timeline if s.ttft_p90_s > UNIFIED.ttft_p90_s)
    assert (first_up, breach) == (10.0, 14.0)
    assert decisions[10].reason.startswith("load") and decisions[10].replicas == 2
    assert decisions[12].reason.startswith("burst") and decisions[12].replicas == 4  # 2 + ceil(9/8)


def test_pool_signals_fold_replicas_and_windows() -> None:
    folded = pool_signals({"running": {"a": 2, "b": 3}, "waiting": {"a": 1, "b": 0},
                           "kv_cache_usage": {"a": 0.2, "b": 0.7},
                           "ttft_p90_s": {"a": 0.5, "b": 1.5, "idle": 0.0},
                           "itl_p90_s": {"a": float("nan"), "b": 0.1}}, replicas=3)
    assert (folded.running, folded.waiting, folded.ongoing) == (5, 1, 6)
    # latencies: the mean p90 of the replicas that measured one (an idle replica reports 0)
    assert (folded.kv_cache_usage, folded.ttft_p90_s, folded.itl_p90_s) == (0.7, 1.0, 0.1)
    folded = pool_signals({"queued_prompt_tokens": {"a": 3000, "b": 1000},
                           "prefill_capacity_tokens_per_s": {"a": 10_000, "b": 0, "c": 20_000}},
                          replicas=3)  # b has not prefilled yet: the others' mean stands for it
    assert (folded.queued_prompt_tokens, folded.prefill_capacity_tokens_per_s) == (4000, 15_000)
    window = Window(10.0)
    for i in range(10):
        window.add(float(i + 1), now=float(i))
    assert window.p90(now=9.0) == 10.0 and window.rate(now=9.0) == 5.5
    assert window.p90(now=30.0) == 0.0
    unread = Window(10.0)  # an engine's windows between reports: bounded by adding alone
    for i in range(1000):
        unread.add(1.0, now=float(i))
    assert len(unread) == 11


def test_a_latency_floor_above_half_the_target_does_not_hold_the_pool_up() -> None:
    """Capped engines: ITL is 0.12 s even for one request (target 0.2 s). With the load gone,
    the pool comes down; at 0.17 s (above 80% of the target) it stays."""
    quiet = sig(2, running=1.5, itl_p90_s=0.12)
    d = decide(quiet, UNIFIED, 2, now=0.0)
    d = decide(quiet, UNIFIED, 2, now=30.0, calm_since=d.calm_since)
    assert d.replicas == 1
    slow = sig(2, running=1.5, itl_p90_s=0.17)
    d = decide(slow, UNIFIED, 2, now=0.0)
    assert d.calm_since is None and decide(slow, UNIFIED, 2, 30.0).replicas == 2


def test_a_request_alone_gets_the_floor_latency_and_does_not_hold_the_pool_up() -> None:
    """A trickle, one request at a time, whose TTFT alone is 1.9 s (target 2 s) on a slow
    machine: one replica fewer still gives it an engine of its own, so the pool comes down.
    With 1.5 requests ongoing, one replica would batch them: there the latency counts."""
    trickle = sig(2, running=1, ttft_p90_s=1.9, itl_p90_s=0.19)
    for targets in (PREFILL, DECODE, UNIFIED):
        d = decide(trickle, targets, 2, now=0.0)
        assert decide(trickle, targets, 2, now=30.0, calm_since=d.calm_since).replicas == 1
    shared = sig(2, running=1.5, ttft_p90_s=1.9)
    d = decide(shared, PREFILL, 2, now=0.0)
    assert d.calm_since is None and decide(shared, PREFILL, 2, 30.0).replicas == 2


def test_backlog_drained_keeps_the_pool_from_stepping_down() -> None:
    """A pool whose queue still takes more than half the TTFT target to drain is not calm."""
    busy = sig(2, running=1, queued_prompt_tokens=50_000, prefill_capacity_tokens_per_s=20_000)
    d = decide(busy, PREFILL, 2, now=0.0)  # 1.25 s to drain > 0.5 x 2 s
    assert d.replicas == 2 and d.calm_since is None
    drained = sig(2, running=1, queued_prompt_tokens=2_000, prefill_capacity_tokens_per_s=20_000)
    d = decide(drained, PREFILL, 2, now=0.0)
    d = decide(drained, PREFILL, 2, now=30.0, calm_since=d.calm_since)
    assert d.replicas == 1


def test_prefill_capacity_is_measured_on_busy_steps() -> None:
    """The engine's recorder: prompt tokens over the time since the previous step, for steps
    that prefilled while the engine was busy; a step after the engine sat empty is no sample."""
    from types import SimpleNamespace

    from pools.engine import LoadSnapshot
    from pools.vllm_engine import _LoadRecorder

    def step(at: float, computed: int, running_after: int) -> None:
        recorder.ranks[0] = LoadSnapshot(running=running_after)  # the step's scheduler stats
        recorder.count_tokens(SimpleNamespace(
            iteration_timestamp=at, num_generation_tokens=1,
            prompt_token_stats=SimpleNamespace(computed=computed, local_cache_hit=0,
                                               external_kv_transfer=0),
            time_to_first_tokens_iter=[], finished_requests=[]))

    recorder = _LoadRecorder()
    step(100.0, 0, running_after=0)  # the engine is empty after this step
    step(105.0, 2048, running_after=3)  # 5 s later: idle time, not a measure of capacity
    assert recorder.signals().prefill_capacity_tokens_per_s == 0.0
    for i in range(1, 10):  # back to back: 2048 tokens every 0.1 s
        step(105.0 + 0.1 * i, 2048, running_after=3)
    step(106.0, 0, running_after=3)  # decode only: no sample
    signals = recorder.signals(queued_prompt_tokens=6144)
    assert signals.prefill_capacity_tokens_per_s == pytest.approx(20_480)
    assert signals.queued_prompt_tokens == 6144


def test_a_data_parallel_engine_reports_each_rank_and_their_sum() -> None:
    """vLLM calls each rank's stat logger with its own stats (engine_index): the replica's load
    is their sum (KV usage their mean), and each rank's is kept for the router."""
    from types import SimpleNamespace

    from pools.vllm_engine import _LoadRecorder

    def stats(running: int, usage: float, queries: int, hits: int) -> SimpleNamespace:
        return SimpleNamespace(
            num_running_reqs=running, num_waiting_reqs=1, num_skipped_waiting_reqs=0,
            kv_cache_usage=usage, kv_connector_stats=None,
            prefix_cache_stats=SimpleNamespace(queries=queries, hits=hits))

    recorder = _LoadRecorder()
    recorder.update(stats(3, 0.5, 100, 40), rank=0)
    recorder.update(stats(1, 0.1, 50, 50), rank=1)
    recorder.update(stats(2, 0.25, 10, 0), rank=1)  # a later step of rank 1: its load now
    assert [(r.running, r.prefix_cache_hits) for _, r in sorted(recorder.ranks.items())] == \
        [(3, 40), (2, 50)]
    total = recorder.snapshot
    assert (total.running, total.waiting, total.prefix_cache_queries, total.prefix_cache_hits) \
        == (5, 2, 160, 90)
    assert total.kv_cache_usage == pytest.approx(0.375)


def test_serve_policy_reads_serve_context_and_keeps_state() -> None:
    from types import SimpleNamespace

    from autoscaler.serve_policy import PoolPolicy

    policy = PoolPolicy(app="a", pool="main", role="unified", min_replicas=1, max_replicas=3,
                        target_ongoing=2, downscale_delay_s=10)

    def ctx(current: int, target: int, now: float, state: dict, **metrics: dict
            ) -> SimpleNamespace:
        return SimpleNamespace(policy_state=state, current_time=now, current_num_replicas=current,
                               target_num_replicas=target, aggregated_metrics=metrics,
                               total_num_requests=0, total_queued_requests=0)

    desired, state = policy(ctx(1, 1, 0.0, {}, running={"r1": 2.0}, waiting={"r1": 3.0}))
    assert desired == 3 and state["reason"].startswith("load: 5.0 ongoing")
    assert state["last_change"] == f"1 -> 3: {state['reason']}" and state["last_change_at"] == 0.0
    # while the new replicas start, a calmer moment never cancels them
    desired, state = policy(ctx(1, 3, 1.0, state, running={"r1": 1.0}))
    assert desired == 3
    desired, state = policy(ctx(3, 3, 2.0, state, running={"r1": 0, "r2": 0, "r3": 0}))
    assert desired == 3 and state["calm_since"] == 2.0
    desired, state = policy(ctx(3, 3, 12.0, state, running={"r1": 0, "r2": 0, "r3": 0}))
    assert desired == 2 and "calm" in state["reason"]
    assert state["last_change"].startswith("3 -> 2: calm for 10s")


def test_serve_policy_counts_requests_held_at_handles_as_waiting() -> None:
    """A replica at its max_ongoing_requests runs 2 and Serve's handles hold 10 more: the
    engine sees no queue, Serve's handles do; the burst rule reads it."""
    from types import SimpleNamespace

    from autoscaler.serve_policy import PoolPolicy

    policy = PoolPolicy(app="a", pool="main", role="unified", min_replicas=1, max_replicas=8,
                        target_ongoing=4, max_waiting_per_replica=2)
    ctx = SimpleNamespace(policy_state={}, current_time=0.0, current_num_replicas=1,
                          target_num_replicas=1, total_num_requests=12.4,
                          total_queued_requests=10.0,
                          aggregated_metrics={"running": {"r1": 2.0}, "waiting": {"r1": 0.0}})
    desired, state = policy(ctx)
    assert desired == 4 and state["reason"].startswith("burst: 10.0 waiting")  # 1 + ceil(10/4)


def test_serve_policy_counts_requests_the_gateways_hold_as_waiting() -> None:
    """Gateways hold 10 requests because both replicas are full; each replica heard it from the
    gateways (not summed across replicas), and Serve's handles hold none."""
    from types import SimpleNamespace

    from autoscaler.serve_policy import PoolPolicy

    policy = PoolPolicy(app="a", pool="main", role="unified", min_replicas=1, max_replicas=8,
                        target_ongoing=4, max_waiting_per_replica=2)
    ctx = SimpleNamespace(policy_state={}, current_time=0.0, current_num_replicas=2,
                          target_num_replicas=2, total_num_requests=0, total_queued_requests=0,
                          aggregated_metrics={"running": {"r1": 2.0, "r2": 2.0},
                                              "held": {"r1": 10.0, "r2": 9.5}})
    desired, state = policy(ctx)
    assert desired == 5 and state["reason"].startswith("burst: 10.0 waiting")  # 2 + ceil(10/4)


def test_ray_requests_policy_is_serves_formula_on_tokenfabs_counts() -> None:
    """The docstring's example: 7 and 5 in flight, 3 held, target 2 -> 7.5 (Serve rounds)."""
    from types import SimpleNamespace

    from autoscaler.serve_policy import ray_requests_policy

    config = SimpleNamespace(get_target_ongoing_requests=lambda: 2)
    ctx = SimpleNamespace(current_num_replicas=2, target_num_replicas=2, config=config,
                          total_num_requests=0, total_queued_requests=0,
                          aggregated_metrics={"in_flight": {"r1": 7.0, "r2": 5.0},
                                              "held": {"r1": 3.0, "r2": 3.0}})
    assert ray_requests_policy(ctx) == (7.5, {})
    assert ray_requests_policy(SimpleNamespace(current_num_replicas=0, target_num_replicas=1)) \
        == (1, {})


def test_prefill_and_decode_pools_scale_independently() -> None:
    """One P/D deployment, each pool with its own policy instance: a prompt-heavy moment (slow
    first tokens) grows prefill only; a generation-heavy one (slow tokens) grows decode only."""
    prompt_heavy = sig(1, running=3, ttft_p90_s=4.0, itl_p90_s=0.05, kv_cache_usage=0.3)
    generation_heavy = sig(1, running=3, ttft_p90_s=0.3, itl_p90_s=0.5, kv_cache_usage=0.5)
    assert decide(prompt_heavy, PREFILL, 1, now=0.0).replicas == 2
    assert decide(prompt_heavy, DECODE, 1, now=0.0).replicas == 1
    assert decide(generation_heavy, PREFILL, 1, now=0.0).replicas == 1
    assert decide(generation_heavy, DECODE, 1, now=0.0).replicas == 3  # ceil(0.5 / 0.2)
    long_prompts = sig(1, running=2, queued_prompt_tokens=200_000,
                       prefill_capacity_tokens_per_s=25_000)  # 8 s of queued prefill
    assert decide(long_prompts, PREFILL, 1, now=0.0).replicas == 4  # ceil(200k / 50k)
    assert decide(long_prompts, DECODE, 1, now=0.0).replicas == 1


def test_pools_override_the_topologys_targets() -> None:
    from orchestrator.app import autoscaling_config
    from orchestrator.config import Topology

    topology = Topology.model_validate({
        "name": "pd", "model": {"name": "m", "path": "/m"},
        "pools": [{"name": "prefill", "role": "prefill", "min_replicas": 1, "max_replicas": 4,
                   "resources": {"gpus": 1},
                   "autoscaling": {"target_ongoing_requests": 2, "ttft_p90_s": 0.5}},
                  {"name": "decode", "role": "decode", "min_replicas": 1, "max_replicas": 4,
                   "resources": {"gpus": 1}}],
        "autoscaler": {"target_ongoing_requests": 32, "ttft_p90_s": 1.0}})
    kwargs = {p.name: autoscaling_config(topology, p)["policy"]["policy_kwargs"]
              for p in topology.pools}
    assert (kwargs["prefill"]["target_ongoing"], kwargs["prefill"]["ttft_p90_s"]) == (2, 0.5)
    assert (kwargs["decode"]["target_ongoing"], kwargs["decode"]["ttft_p90_s"]) == (32, 1.0)
    with pytest.raises(ValueError, match="autoscaling.target_ongoing_requests"):
        Topology.model_validate({**topology.model_dump(), "pools": [
            {**topology.pools[0].model_dump(), "autoscaling": {"target_ongoing_requests": 0}},
            topology.pools[1].model_dump()]})



def test_a_replica_reports_its_windows_latencies_for_operators() -> None:
    """`tokenfab top` shows each replica's TTFT and ITL p50/p90 and tokens/s: its engine's
    windows, the same samples the autoscaler reads."""
    from types import SimpleNamespace

    from pools.engine import Latency
    from pools.vllm_engine import _LoadRecorder

    recorder = _LoadRecorder(window_s=10.0)
    assert recorder.latency() == Latency()  # nothing yet: zeros, shown as "-"
    recorder.count_tokens(SimpleNamespace(
        iteration_timestamp=1.0, num_generation_tokens=50,
        prompt_token_stats=SimpleNamespace(computed=0, local_cache_hit=0, external_kv_transfer=0),
        time_to_first_tokens_iter=[0.01 * i for i in range(1, 11)],
        finished_requests=[SimpleNamespace(num_generation_tokens=8,
                                           mean_time_per_output_token=0.02)]))
    latency = recorder.latency()
    assert (latency.ttft_p50_s, latency.ttft_p90_s) == (0.06, 0.1)
    assert (latency.itl_p50_s, latency.itl_p90_s) == (0.02, 0.02)
    assert latency.generation_tokens_per_s == 5.0  # 50 tokens over the 10 s window
