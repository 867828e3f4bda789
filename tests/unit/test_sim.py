"""The simulator: vLLM's block pool order, the scheduler's steps, fast-forwarded decode equal to
step-by-step decode, preemption, the calibration fit, the real router inside it, and prefill and
decode pools joined by KV pulls."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import msgspec
import pytest

from sim import workload
from sim.calibrate import FEATURES, Observation, fit, fit_to_replay
from sim.cluster import SimCluster
from sim.engine import SimEngine, SimRequest
from sim.kvcache import BlockPool
from sim.loop import EventLoop
from sim.params import EngineParams, load
from sim.pd import SimPDCluster
from sim.pd import summary as pd_summary
from sim.run import replay

PARAMS = EngineParams(name="test", block_size=4, kv_blocks=64, max_num_batched_tokens=16,
                      max_num_seqs=8, max_model_len=256, step_base_s=0.010, per_token_s=0.001,
                      per_seq_s=0.0005, per_kv_token_s=0.0001, request_overhead_s=0.002)


def engine(params: EngineParams = PARAMS, fast_forward: bool = True, pull_s=None):
    loop, events, firsts, ends = EventLoop(), [], [], []
    e = SimEngine(loop, params, "e", events.append, firsts.append, ends.append,
                  fast_forward=fast_forward, pull_s=pull_s)
    return loop, e, events, firsts, ends


def request(rid: str, at: float, prompt: int, hashes: list[int], out: int) -> SimRequest:
    return SimRequest(rid, at, prompt, hashes, out)


def test_loop_runs_in_time_then_schedule_order() -> None:
    loop, seen = EventLoop(), []
    loop.at(2.0, lambda: seen.append("late"))
    loop.at(1.0, lambda: seen.append("a"))
    loop.at(1.0, lambda: seen.append("b"))
    loop.run()
    assert seen == ["a", "b", "late"] and loop.now == 2.0
    with pytest.raises(ValueError, match="before now"):
        loop.at(1.5, lambda: None)


def test_block_pool_evicts_in_vllms_order() -> None:
    # vLLM's free queue: never-used blocks first, then freed ones, a request's tail first
    pool = BlockPool(5)
    blocks = pool.allocate(3)
    assert blocks == [0, 1, 2]
    for block, h in zip(blocks, (11, 12, 13)):
        pool.cache(block, h)
    pool.free(blocks)
    assert pool.take_events() == [(True, 11), (True, 12), (True, 13)]
    assert pool.cached_prefix([11, 12, 13, 99]) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]  # the empty ones before any cached block
    assert pool.allocate(1) == [2] and pool.take_events() == [(False, 13)]  # tail first
    assert pool.cached_prefix([11, 12, 13]) == [0, 1]
    pool.touch([0])  # a hit takes it out of the queue: 1 is next
    assert pool.allocate(1) == [1] and pool.take_events() == [(False, 12)]
    assert pool.allocate(1) is None and pool.free_blocks == 0
    assert pool.allocated == 7  # each block taken for new data, once per take


def test_prefix_hit_computes_only_the_rest_and_events_carry_the_blocks() -> None:
    loop, e, events, firsts, ends = engine()
    first = request("a", 0.0, 13, [1, 2, 3], 2)  # 3 full blocks + 1 token
    loop.at(0.0, lambda: e.add(first))
    loop.run()
    # one prefill step of 13 tokens, then one decode step
    prefill = PARAMS.step_s(13, 1, 13, 13 * 13 / 2)
    assert first.first_token == pytest.approx(prefill)
    assert events[0] == [(True, 1), (True, 2), (True, 3)]
    again = request("b", loop.now, 13, [1, 2, 3], 1)
    loop.at(loop.now, lambda: e.add(again))
    loop.run()
    assert again.cached_tokens == 12  # its 3 blocks; at least one token is computed
    assert again.first_token - again.engine_arrival == pytest.approx(
        PARAMS.step_s(1, 1, 13, 1 * (12 + 0.5)))
    assert [r.request_id for r in ends] == ["a", "b"]


def test_chunked_prefill_takes_budget_sized_steps() -> None:
    loop, e, _, firsts, _ = engine()
    long = request("a", 0.0, 40, [], 1)  # budget 16: 16 + 16 + 8
    loop.at(0.0, lambda: e.add(long))
    loop.run()
    steps = [PARAMS.step_s(16, 1, 16, 16 * 8), PARAMS.step_s(16, 1, 32, 16 * 24),
             PARAMS.step_s(8, 1, 40, 8 * 36)]
    assert long.first_token == pytest.approx(sum(steps)) and e.steps == 3


def scenario(fast_forward: bool) -> list[tuple[float | None, float | None, int]]:
    loop, e, *_ = engine(fast_forward=fast_forward)
    rng = random.Random(3)
    reqs = [request(f"r{i}", rng.uniform(0, 1.0), rng.randint(1, 30),
                    [rng.randint(0, 3)], rng.randint(1, 40)) for i in range(12)]
    for r in reqs:
        loop.at(r.arrival, lambda r=r: e.add(r))
    loop.run()
    return [(r.first_token, r.finished, r.cached_tokens) for r in reqs]


def test_fast_forwarded_decode_equals_step_by_step() -> None:
    fast, slow = scenario(True), scenario(False)
    assert all(f[0] is not None and f[1] is not None for f in fast)
    for (f_first, f_end, f_hit), (s_first, s_end, s_hit) in zip(fast, slow):
        assert f_first == pytest.approx(s_first, abs=1e-9)
        assert f_end == pytest.approx(s_end, abs=1e-9)
        assert f_hit == s_hit


def test_preemption_recomputes_and_everything_ends() -> None:
    loop, e, *_ = engine(PARAMS.with_kv_blocks(6))
    a, b = request("a", 0.0, 8, [1, 2], 12), request("b", 0.0, 8, [3, 4], 12)
    for r in (a, b):
        loop.at(0.0, lambda r=r: e.add(r))
    loop.run()
    # two requests of 5 blocks each at the end do not fit in 6: one was preempted
    assert a.finished is not None and b.finished is not None
    assert a.preemptions + b.preemptions >= 1
    assert e.pool.free_blocks == 6 and not e.running and not e.waiting


def test_calibration_fit_recovers_the_law() -> None:
    truth = dict(zip(FEATURES, (0.004, 0.008, 5e-5, 3e-4, 1e-7, 2e-8, 0.001)))
    rng = random.Random(0)
    observations = []
    for _ in range(60):
        o = Observation(rng.random() < 0.5, rng.randint(1, 2000), rng.randint(1, 32),
                        rng.randint(1, 30000), rng.randint(1, 2_000_000), 0.0,
                        streams=rng.randint(0, 8))
        o.seconds = sum(c * x for c, x in zip(truth.values(), o.row()))
        observations.append(o)
    fitted = fit(observations)
    for name, value in truth.items():
        assert fitted[name] == pytest.approx(value, rel=1e-6)


def test_workload_chains_hashes_like_prompts_share_prefixes() -> None:
    a = workload.block_hashes([7, 9], 4, tokens_per_id=32, block_size=16)
    b = workload.block_hashes([7, 8], 4, tokens_per_id=32, block_size=16)
    assert a[:2] == b[:2] and a[2] != b[2] and len(set(a)) == 4
    assert workload.block_hashes([7], 2, 32, 16, namespace=1)[0] != a[0]
    rows = [{"timestamp": 0, "hash_ids": [1]}, {"timestamp": 1000, "hash_ids": [2]}]
    tiled = workload.tile(rows, 3, seed=0)
    assert len(tiled) == 6 and len({tuple(r["hash_ids"]) for r in tiled}) == 6


def shared_prefix_requests(n: int, start: float = 0.0) -> list[SimRequest]:
    """n requests, one every 50 ms, on 5 prefixes of 8 blocks each."""
    return [request(f"q{i}", start + 0.05 * i, 33,
                    workload.block_hashes([i % 5], 8, 32, 4), 4) for i in range(n)]


def test_real_router_places_by_prefix_through_simulated_events() -> None:
    results = {policy: replay(PARAMS, policy, 4, lambda i, start: shared_prefix_requests(40,
                                                                                        start))
               for policy in ("round_robin", "kv_aware")}
    rr, kv = results["round_robin"], results["kv_aware"]
    assert rr["unfinished"] == kv["unfinished"] == 0
    # round robin over 4 replicas spreads each of the 5 prefixes over all of them (20 misses of
    # 40); kv_aware follows the blocks the engines reported (5 misses)
    assert rr["hit_rate"] == pytest.approx(20 / 40 * 32 / 33)
    assert kv["hit_rate"] == pytest.approx(35 / 40 * 32 / 33)
    assert kv["index_entries_peak"] > 0 and rr["index_entries_peak"] == 0
    assert kv["decision_p99_ms"] > 0


def test_held_requests_wait_for_room_and_scaled_replicas_start_late() -> None:
    loop = EventLoop()
    sim = SimCluster(loop, PARAMS, "round_robin", 1, max_ongoing_requests=1)
    reqs = shared_prefix_requests(3)
    sim.submit(reqs)
    added = sim.add_replica()
    assert sim.count("starting") == 1
    loop.run()
    assert len(sim.finished) == 3
    assert all(r.replica == "r0" for r in reqs)  # r1 starts after PARAMS.start_latency_s
    assert sim.replicas[added].state == "ready"


@pytest.mark.parametrize("drain_at", [0.001, 0.01])  # before and after they reach the engine
def test_a_draining_replica_leaves_once_when_its_last_requests_end_together(
        drain_at: float) -> None:
    loop, left = EventLoop(), []
    sim = SimCluster(loop, PARAMS, "round_robin", 1)
    sim.submit([request("a", 0.0, 8, [], 3), request("b", 0.0, 8, [], 2)])  # b joins a step late
    loop.at(drain_at, sim.drain_replica)
    loop.at(0.05, lambda: left.append(sim.replicas == {}))  # PARAMS.request_overhead_s is 2 ms
    loop.run()
    assert [r.finished for r in sim.finished] == [sim.finished[0].finished] * 2
    assert left == [False] and sim.replicas == {}


def test_profiles_load_and_name_what_is_wrong(tmp_path) -> None:
    assert load("h100-llama-3.1-8b").block_size == 16
    with pytest.raises(ValueError, match="no such file"):
        load("no-such-profile")
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x", "block_size": "16"}')
    with pytest.raises(ValueError, match="block_size"):
        load(bad)


def test_tokenfab_policy_scales_the_simulated_pool_up_and_back_down() -> None:
    from autoscaler.serve_policy import PoolPolicy
    from sim.autoscale import SimAutoscaler

    loop = EventLoop()
    params = PARAMS.with_kv_blocks(512)
    sim = SimCluster(loop, params, "round_robin", 1)
    policy = PoolPolicy("app", "main", role="unified", min_replicas=1, max_replicas=4,
                        target_ongoing=4, downscale_delay_s=5.0)
    scaler = SimAutoscaler(loop, sim, policy, until=200.0)
    burst = [request(f"b{i}", 1.0 + 0.01 * i, 9, [], 60) for i in range(40)]
    sim.submit(burst)
    scaler.start()
    loop.run()
    ups = [d for d in scaler.decisions if d[2] > d[1]]
    downs = [d for d in scaler.decisions if d[2] < d[1]]
    assert ups and ups[0][0] < 5.0  # the burst's queue is seen within seconds
    assert max(n for _, n in scaler.timeline) == 4
    assert downs and sim.count("ready", "starting", "draining") == 1  # back to min after calm
    assert len(sim.finished) == 40
    assert 0 < scaler.replica_seconds < 4 * 200


def test_serve_delays_hold_a_raw_policy_back() -> None:
    from types import SimpleNamespace

    from sim.autoscale import ServeDelays

    delayed = ServeDelays(lambda ctx: (3.2, {}), min_replicas=1, max_replicas=3,
                          upscale_delay_s=30.0)
    ctx = SimpleNamespace(target_num_replicas=1, current_time=0.0)
    assert delayed(ctx)[0] == 1
    ctx.current_time = 29.0
    assert delayed(ctx)[0] == 1
    ctx.current_time = 30.0
    assert delayed(ctx)[0] == 3  # ceil(3.2) = 4, bounded to 3


def test_capacity_is_the_last_rate_within_both_targets() -> None:
    from sim.profile import Point, capacity

    def point(rate: float, ttft: float, itl: float) -> Point:
        return Point(rate, ttft, itl, ttft, itl, ongoing_per_replica=2 * rate, requests=100)

    points = [point(0.5, 0.4, 0.02), point(1.0, 1.1, 0.05), point(1.5, 6.0, 0.05),
              point(2.0, 2.0, 0.05)]  # 2.0 within again: noise past a breach does not count
    assert capacity(points, 3.0, 0.1).rate_per_replica == 1.0
    assert capacity(points, 3.0, 0.1).ongoing_per_replica == 2.0
    assert capacity(points, 3.0, 0.01).rate_per_replica == 0.0  # even the lowest misses ITL


def test_profiled_latency_and_load_grow_with_the_rate() -> None:
    """sim.profile on the test engine: the signals the autoscaler would see, and Little's law."""
    from sim.profile import sweep

    params = PARAMS.with_kv_blocks(512)

    def make(rate: float, seconds: float) -> list[SimRequest]:
        rng = random.Random(1)
        at, out = 0.0, []
        while (at := at + rng.expovariate(rate)) < seconds:
            out.append(request(f"q{len(out)}", at, 24, [], 20))
        return out

    found = sweep(params, make, [1.0, 2.0, 4.0, 8.0, 16.0], ttft_p90_s=0.5, itl_p90_s=0.05,
                  replicas=2, seconds=60.0)
    # 8 req/s per replica overloads the engine (TTFT p90 ~9 s): the sweep stops there
    assert [p.rate_per_replica for p in found.points] == [1.0, 2.0, 4.0, 8.0]
    assert found.rate_per_replica == 4.0 and found.points[-1].ttft_p90_s > 0.5
    ongoing = [p.ongoing_per_replica for p in found.points]
    assert ongoing == sorted(ongoing) and ongoing[0] > 0
    ttft = [p.ttft_p90_s for p in found.points]
    assert ttft == sorted(ttft)


# -- prefill and decode pools ---------------------------------------------------------------

PD_PARAMS = msgspec.structs.replace(PARAMS, kv_bytes_per_token=1000)  # 1 ms a token at 1 MB/s


def test_a_disaggregated_pool_is_profiled_on_its_own_arrivals() -> None:
    """sim.profile.sweep_pd: half the prompts are too short for a prefill leg, so the prefill
    pool gets half the requests offered per replica, decode all of them; each pool's capacity
    is in its own arrivals, its load in its own requests."""
    from sim.profile import sweep_pd

    params = PD_PARAMS.with_kv_blocks(512)

    def make(rate: float, seconds: float) -> list[SimRequest]:
        rng = random.Random(1)
        at, out = 0.0, []
        while (at := at + rng.expovariate(rate)) < seconds:
            out.append(request(f"q{len(out)}", at, 40 if len(out) % 2 else 8, [], 4))
        return out

    pd = {"transfer_bytes_per_s": 1e6, "min_prompt_tokens": 16}
    prefill = sweep_pd(params, make, [1.0, 2.0], 1.0, 0.1, "prefill", replicas=2, other=2,
                       seconds=120.0, **pd)
    decode = sweep_pd(params, make, [1.0, 2.0], 1.0, 0.1, "decode", replicas=2, other=2,
                      seconds=120.0, **pd)
    assert [p.rate_per_replica for p in prefill.points] == pytest.approx([0.5, 1.0], rel=0.15)
    assert [p.rate_per_replica for p in decode.points] == pytest.approx([1.0, 2.0], rel=0.15)
    assert prefill.rate_per_replica == prefill.points[-1].rate_per_replica  # within targets
    # a prefill leg's stay (its one token) is shorter than a decode leg's pull and 4 tokens
    assert 0 < prefill.points[0].ongoing_per_replica < decode.points[0].ongoing_per_replica


def test_decode_leg_pulls_its_prompt_then_recomputes_the_last_token() -> None:
    loop, events, firsts, ends, pulled = EventLoop(), [], [], [], []
    e = SimEngine(loop, PD_PARAMS, "d", events.append, firsts.append, ends.append,
                  pull_s=lambda tokens: 0.001 * tokens, on_pulled=pulled.append)
    a = SimRequest("a", 0.0, 9, [1, 2], 3, remote_kv=True)  # 2 full blocks of 4, and a token
    loop.at(0.0, lambda: e.add(a))
    loop.run()
    assert a.pulled_tokens == 9 and a.pull_s == pytest.approx(0.009) and pulled == [a]
    assert a.cached_tokens == 0
    # the pull is outside the steps; then one step recomputes the 9th token: 10 ms base, 1 ms a
    # token, 0.5 ms a request, 0.1 ms a KV token read (9)
    assert a.first_token == pytest.approx(0.009 + 0.010 + 0.001 + 0.0005 + 0.0009)
    assert events[0][:2] == [(True, 1), (True, 2)]  # the pulled blocks are cached, then told
    b = SimRequest("b", 1.0, 9, [1, 2], 3, remote_kv=True)  # cached on decode but its tail
    loop.at(1.0, lambda: e.add(b))
    loop.run()
    assert b.pulled_tokens == 1 and b.cached_tokens == 8 and pulled == [a, b]
    assert e.pool.used_blocks == 0 and not e.pulling and not e.pulled


def test_pulls_under_block_pressure_all_end() -> None:
    """Decode legs hold blocks while they pull and until they run; they are scheduled before
    other waiting requests (preempted ones included), so the engine never waits for itself."""
    loop, e, *_ = engine(PD_PARAMS.with_kv_blocks(4), pull_s=lambda tokens: 0.001 * tokens)
    two = [SimRequest(r, 0.0, 9, [i], 3, remote_kv=True) for i, r in enumerate("ab")]
    for r in two:
        loop.at(0.0, lambda r=r: e.add(r))
    loop.run()
    assert all(r.finished is not None for r in two)
    rng = random.Random(0)
    for run in range(40):
        loop, e, *_ = engine(PD_PARAMS.with_kv_blocks(12), pull_s=lambda tokens: 0.001 * tokens)
        reqs = [SimRequest(f"{run}-{k}", 0.01 * k, rng.randint(2, 20),
                           [rng.randint(0, 3) * 100 + j for j in range(4)][:rng.randint(0, 4)],
                           rng.randint(1, 12), remote_kv=rng.random() < 0.6) for k in range(12)]
        for r in reqs:
            loop.at(r.arrival, lambda r=r: e.add(r))
        loop.run()
        assert all(r.finished is not None for r in reqs), run
        assert e.pool.used_blocks == 0 and not (e.pulling or e.pulled or e.waiting or e.running)


def test_prefill_leg_holds_its_blocks_until_released() -> None:
    loop, e, *_ = engine(PD_PARAMS)
    leg = SimRequest("a/prefill", 0.0, 9, [1, 2], 1, hold_kv=True)
    loop.at(0.0, lambda: e.add(leg))
    loop.run()
    assert leg.finished is not None and e.pool.used_blocks == 3
    e.release("a/prefill")
    assert e.pool.used_blocks == 0 and e.pool.cached_prefix([1, 2]) != []


def test_a_request_waiting_for_held_blocks_starts_when_they_are_released() -> None:
    loop, e, *_ = engine(PD_PARAMS.with_kv_blocks(4))
    held = SimRequest("a/prefill", 0.0, 9, [1, 2], 1, hold_kv=True)  # 3 of the 4 blocks
    other = SimRequest("b/prefill", 0.0, 9, [3, 4], 1, hold_kv=True)
    loop.at(0.0, lambda: e.add(held))
    loop.at(0.0, lambda: e.add(other))
    loop.run()
    assert held.finished is not None and other.first_token is None  # 1 block free, 3 needed
    loop.at(5.0, lambda: e.release("a/prefill"))
    loop.run()
    assert other.first_token is not None and other.first_token > 5.0


def pd_cluster(**kw):
    loop = EventLoop()
    sim = SimPDCluster(loop, PD_PARAMS, "kv_aware", 1, 1, transfer_bytes_per_s=1e6,
                       transfer_latency_s=0.002, min_prompt_tokens=8, **kw)
    return loop, sim


def test_pd_prefills_long_prompts_once_and_decode_keeps_what_it_pulled() -> None:
    loop, sim = pd_cluster()
    hashes = workload.block_hashes([7], 8, 32, 4)
    long = request("long", 0.0, 33, hashes, 4)
    short = request("short", 0.5, 5, workload.block_hashes([8], 1, 32, 4), 4)
    again = request("again", 1.0, 33, hashes, 4)  # decode was sent this prefix: no prefill leg
    sim.submit([long, short, again])
    loop.run()
    assert all(r.finished is not None for r in (long, short, again))
    assert sim.disaggregated == 1
    assert sim.skipped == {"short_prompt": 1, "cached_on_decode": 1}
    assert (long.remote_kv, long.prefill_leg.replica, long.replica) == (True, "p0", "d0")
    assert long.pulled_tokens == 33 and long.pull_s == pytest.approx(0.002 + 0.033)
    assert again.cached_tokens == 32 and not again.remote_kv  # the pulled blocks, reused
    # the client's first token is decode's: after both legs' overhead and the pull
    assert long.first_token - long.arrival > 2 * PD_PARAMS.request_overhead_s + long.pull_s
    prefill = sim.prefill.replicas["p0"].engine
    assert prefill.pool.used_blocks == 0 and prefill.arrivals == 1  # released after the pull
    # the decode pool's router learned the pulled blocks from its engine's events: long's 8
    # full blocks, and short's one
    assert sim.decode.service.replicas()["d0"]["cached_blocks"] == 9
    summary = pd_summary("kv_aware", [long, short, again], sim, loop.now, 1.0)
    assert summary["prefill_leg_hit_rate"] == 0.0  # long was cold on prefill
    assert summary["decode_only_hit_rate"] == pytest.approx(32 / (5 + 33))
    assert summary["hit_rate"] == pytest.approx(32 / (33 + 5 + 33))


def test_pd_keeps_long_prefills_out_of_decode_streams() -> None:
    def stream_gap(pd: bool) -> float:
        loop = EventLoop()
        stream = request("stream", 0.0, 5, workload.block_hashes([1], 1, 32, 4), 40)
        long = request("long", 0.05, 120, workload.block_hashes([2], 30, 32, 4), 2)
        if pd:
            sim = SimPDCluster(loop, PD_PARAMS, "round_robin", 1, 1, transfer_bytes_per_s=1e6,
                               min_prompt_tokens=8)
        else:
            sim = SimCluster(loop, PD_PARAMS, "round_robin", 1)
        sim.submit([stream, long])
        loop.run()
        assert stream.finished is not None and long.finished is not None
        return stream.itl_sum_s / stream.itl_count

    # unified, each of the long prompt's 8 chunks rides a step of the stream's (16 tokens:
    # 15 ms more each); in P/D decode steps carry the pulled request's one token at most
    assert stream_gap(pd=True) < 0.8 * stream_gap(pd=False)


def two_conversations(tmp_path) -> Path:
    """Six requests of two conversations, 600- and 1,000-token prompts sharing their first
    hash id within each."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(
        f'{{"timestamp": {i * 500}, "input_length": {600 + 400 * (i % 2)}, '
        f'"output_length": 8, "hash_ids": [{i % 2}, {10 + i}]}}\n' for i in range(6)))
    return trace


def test_replay_command_runs_pd_pools_and_refuses_a_profile_without_kv_bytes(
        tmp_path, capsys) -> None:
    from sim.__main__ import main

    trace = two_conversations(tmp_path)
    main(["replay", "--profile", "h100-llama-3.1-8b", "--trace", str(trace), "--rate", "2",
          "--pd", "1:2"])
    result = json.loads(capsys.readouterr().out)
    assert (result["prefill_replicas"], result["decode_replicas"]) == (1, 2)
    # each conversation's first turn takes a prefill leg; later ones share its first 512
    # tokens on decode: of 600 that leaves 88 (decode alone), of 1,000 it leaves 488 (prefill)
    assert result["unfinished"] == 0 and result["disaggregated"] == 4
    assert result["skipped"] == {"short_prompt": 0, "cached_on_decode": 2}
    assert result["pulled_gb"] > 0
    with pytest.raises(SystemExit):
        main(["replay", "--profile", "cpu-tiny", "--trace", str(trace), "--rate", "2",
              "--pd", "1:1"])
    assert "kv_bytes_per_token is not set" in capsys.readouterr().err


def test_capacity_command_profiles_one_pool_of_a_pair(tmp_path, capsys) -> None:
    from sim.__main__ import main

    trace = two_conversations(tmp_path)
    main(["capacity", "--profile", "h100-llama-3.1-8b", "--trace", str(trace), "--ttft-p90-s",
          "3", "--itl-p90-s", "0.1", "--role", "prefill", "--replicas", "1", "--other", "1",
          "--seconds", "30", "--step", "0.5", "--max-rate", "1"])
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines()[1:3]]
    rates = [float(row[0]) for row in rows]
    # offered 0.5 and 1 req/s; a third of the prompts find their prefix on decode and skip
    # prefill, so the prefill pool's own arrivals are fewer
    assert 0 < rates[0] < 0.5 and rates[0] < rates[1] < 1.0
    assert f"capacity_rps: {rates[1]:g}" in out


def test_tokenfab_policies_size_prefill_and_decode_pools_each_by_its_own_load() -> None:
    from autoscaler.serve_policy import PoolPolicy
    from sim.autoscale import SimAutoscaler

    loop = EventLoop()
    sim = SimPDCluster(loop, PD_PARAMS.with_kv_blocks(512), "round_robin", 1, 1,
                       transfer_bytes_per_s=1e6, min_prompt_tokens=8)
    scalers = {
        role: SimAutoscaler(loop, pool, PoolPolicy("app", role, role=role, min_replicas=1,
                                                   max_replicas=4, target_ongoing=4,
                                                   ttft_p90_s=1.0, itl_p90_s=0.1,
                                                   downscale_delay_s=5.0), until=200.0)
        for role, pool in (("prefill", sim.prefill), ("decode", sim.decode))}
    # long prompts with two output tokens each: work for prefill, little for decode
    burst = [request(f"b{i}", 1.0 + 0.05 * i, 200, workload.block_hashes([i], 50, 32, 4), 2)
             for i in range(40)]
    sim.submit(burst)
    for scaler in scalers.values():
        scaler.start()
    loop.run()
    assert all(r.finished is not None for r in burst)
    prefill, decode = scalers["prefill"], scalers["decode"]
    assert prefill.decisions[0][1:3] == (1, 4) and "backlog" in prefill.decisions[0][3]
    assert sim.prefill.count("ready", "starting", "draining") == 1  # back down after calm
    assert not decode.decisions and max(n for _, n in decode.timeline) == 1


def test_fit_to_replay_weighs_every_load_it_is_given() -> None:
    # TTFTs as replays' would be: an overhead plus the step law's part, which grows with the load.
    # The real overhead grows with the load too, which the profile's constant cannot follow: a
    # fit to one load is off at the other; a fit to both is off at neither by as much.
    probed = load("cpu-tiny")
    base = probed.step_base_s

    def replay_at(load: float):
        def simulate(p: EngineParams) -> dict[str, float]:
            step = p.step_base_s / base
            return {"ttft_p50_s": p.request_overhead_s + 0.01 * step * load,
                    "ttft_p90_s": p.request_overhead_s + 0.03 * step * load}
        return simulate

    def real(load: float, overhead: float) -> dict[str, float]:
        return {"ttft_p50_s": overhead + 0.015 * load, "ttft_p90_s": overhead + 0.045 * load}

    low, high = (replay_at(1.0), real(1.0, 0.010)), (replay_at(4.0), real(4.0, 0.020))
    params, scale, error = fit_to_replay(probed, [low])
    assert (scale, params.request_overhead_s) == (pytest.approx(1.5), pytest.approx(0.010))
    assert error == pytest.approx(0.0, abs=1e-12)

    def worst(p: EngineParams) -> float:
        return max(abs(math.log(sim(p)[m] / r[m])) for sim, r in (low, high)
                   for m in ("ttft_p50_s", "ttft_p90_s"))

    both, _, _ = fit_to_replay(probed, [low, high])
    assert worst(both) < min(worst(fit_to_replay(probed, [one])[0]) for one in (low, high))


def test_fit_to_replays_at_two_loads_finds_the_overhead_that_grows_with_the_load() -> None:
    # as the simulator adds it: the overhead, plus `overhead_per_stream_s` for each request
    # already on the replica (here: as many as the load)
    probed = msgspec.structs.replace(load("cpu-tiny"), overhead_per_stream_s=0.0)
    base = probed.step_base_s

    def replay_at(load: float):
        def simulate(p: EngineParams) -> dict[str, float]:
            step, overhead = p.step_base_s / base, p.overhead_s(int(load))
            return {"ttft_p50_s": overhead + 0.01 * step * load,
                    "ttft_p90_s": overhead + 0.03 * step * load}
        return simulate

    truth = msgspec.structs.replace(probed, step_base_s=base * 1.5, request_overhead_s=0.0125,
                                    overhead_per_stream_s=0.002)
    pairs = [(replay_at(load), replay_at(load)(truth)) for load in (1.0, 4.0)]
    params, scale, error = fit_to_replay(probed, pairs)
    assert (scale, params.request_overhead_s, params.overhead_per_stream_s) == (
        pytest.approx(1.5), pytest.approx(0.0125), pytest.approx(0.002))
    assert error == pytest.approx(0.0, abs=1e-12)
    alone, _, _ = fit_to_replay(probed, pairs[:1])  # one load: the overhead per stream as probed
    assert alone.overhead_per_stream_s == 0.0


def test_fit_to_replay_weighs_the_p99_where_it_is_recorded() -> None:
    # p50 and p90 read the overhead plus the step law; the p99, the longest prompts computed
    # whole, reads the law alone. Here p50 and p90 say x1.5 and the p99 says x1.0.
    probed = msgspec.structs.replace(load("cpu-tiny"), overhead_per_stream_s=0.0)
    base = probed.step_base_s

    def simulate(p: EngineParams) -> dict[str, float]:
        step = p.step_base_s / base
        return {"ttft_p50_s": p.request_overhead_s + 0.01 * step,
                "ttft_p90_s": p.request_overhead_s + 0.03 * step, "ttft_p99_s": 0.05 * step}

    real = simulate(msgspec.structs.replace(probed, step_base_s=base * 1.5,
                                            request_overhead_s=0.0125))
    without = {m: v for m, v in real.items() if m != "ttft_p99_s"}
    params, scale, error = fit_to_replay(probed, [(simulate, without)])
    assert (scale, params.request_overhead_s) == (pytest.approx(1.5), pytest.approx(0.0125))
    assert error == pytest.approx(0.0, abs=1e-12)
    real["ttft_p99_s"] = 0.05
    params, scale, error = fit_to_replay(probed, [(simulate, real)])
    assert scale < 1.5 and error > 0  # the p99 moved the fit toward its x1.0


def test_users_send_each_turn_after_the_answer_it_follows() -> None:
    """A closed loop: a conversation's next turn leaves after the turn before it ended (and a
    think time), extends that turn's blocks by the answer and the next message, and nothing is
    sent after the window."""
    from sim.users import Shape, Users

    loop, heard = EventLoop(), []
    sim = SimCluster(loop, PARAMS, "round_robin", 2, on_finished=lambda r: heard[0].finished(r))
    shape = Shape(tokens_per_id=8, block_size=4, max_prompt_tokens=120, max_output_tokens=8,
                  think_s=0.5, window_s=20.0)
    users = Users(loop, 6, shape, system_prompts=2, submit=lambda r: sim.submit([r]), seed=3)
    heard.append(users)
    loop.run()
    sent = users.sent
    assert len(sent) > 40 and all(r.finished is not None for r in sent)
    assert max(r.arrival for r in sent) <= shape.window_s
    by_user: dict[str, list[SimRequest]] = {}
    for r in sent:
        by_user.setdefault(r.request_id.split("-")[0], []).append(r)
    follows = 0
    for turns in by_user.values():
        for before, after in zip(turns, turns[1:]):
            assert after.arrival > before.finished  # never before the answer it follows
            shared = list(after.block_hashes[:len(before.block_hashes)])
            if shared == list(before.block_hashes):  # the same conversation, one turn on
                follows += 1
                assert len(after.block_hashes) == len(before.block_hashes) + 4
    assert follows > len(sent) // 3  # most conversations have more than one turn (mean 4)
