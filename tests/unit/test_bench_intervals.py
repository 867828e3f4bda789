"""The benchmarks' repeated-run statistics (benchmarks/common/intervals.py), their streaming
client (benchmarks/common/client.py), the no-reuse window (benchmarks/common/traces.py) and the
head-to-head's stall clusters (benchmarks/h2h_figures.py)."""

import json

import pytest

from benchmarks.common.intervals import aggregate, goodput, verdict
from benchmarks.common.traces import upper_bound_hit_rate, without_reuse
from benchmarks.h2h_figures import stall_clusters, with_goodput


def test_aggregate_takes_the_median_and_range_of_each_group_in_first_seen_order():
    records = [{"s": "b", "x": 3.0}, {"s": "a", "x": 0.1}, {"s": "a", "x": 0.3},
               {"s": "a", "x": 0.2}, {"s": "b", "x": None}]
    rows = aggregate(records, ("s",), ("x",))
    assert [(r["s"], r["repeats"], r["x"], r["x_range"]) for r in rows] == [
        ("b", 2, 3.0, [3.0, 3.0]), ("a", 3, 0.2, [0.1, 0.3])]
    assert rows[1]["runs"] == records[1:4]


@pytest.mark.parametrize("ours, theirs, lower_is_better, expected", [
    ([0.1, 0.2], [0.3, 0.4], True, "win"),
    ([0.1, 0.2], [0.3, 0.4], False, "loss"),
    ([0.3, 0.5], [0.1, 0.2], True, "loss"),
    ([0.1, 0.3], [0.3, 0.4], True, "tie"),  # touching ranges overlap
    ([0.1, 0.5], [0.2, 0.3], True, "tie"),
])
def test_verdict_is_a_win_or_loss_only_where_the_ranges_are_apart(ours, theirs, lower_is_better,
                                                                   expected):
    assert verdict({"f_range": ours}, {"f_range": theirs}, "f", lower_is_better) == expected


@pytest.mark.parametrize("points, expected", [
    ([(4, 0.10, 0), (2, 0.05, 0), (8, 0.50, 0)], (5.0, False)),  # a quarter of the way to 8
    ([(2, 0.05, 0), (4, 0.10, 0)], (4, True)),                   # every rate met: a lower bound
    ([(2, 0.05, 0), (4, 0.10, 1), (8, 0.10, 0)], (2, False)),    # a failure ends it
    ([(2, 0.30, 0), (4, 0.10, 0)], (0.0, False)),                # missed at the lowest rate
    ([(2, 0.05, 0), (4, None, 0)], (2, False)),                  # no token at all
    ([(2, 0.05, 0), (4, 0.40, 0), (8, 0.10, 0)], (2.857143, False)),  # the first miss decides
])
def test_goodput_interpolates_between_the_last_rate_met_and_the_first_missed(points, expected):
    rate, bound = goodput(points, 0.2)
    assert (round(rate, 6), bound) == expected


def test_goodput_per_setup_is_found_in_each_repeat_then_summarised():
    def run(repeat, rate, p90):
        return {"system": "s", "policy": "p", "load": f"{rate} req/s", "rate_rps": rate,
                "repeat": repeat, "ttft_p90_s": p90, "failed": 0}
    records = [run(0, 2, 0.1), run(0, 4, 0.3), run(1, 2, 0.1), run(1, 4, 0.1),
               run(2, 2, 0.1), run(2, 4, 0.25)]
    rows = with_goodput(records, 0.2)
    # repeat 0: 2 + 2 x 0.5 = 3; repeat 1: >= 4; repeat 2: 2 + 2 x (0.1 / 0.15)
    assert [r["rate_rps"] for r in rows] == [2, 4]
    assert rows[0]["goodput_runs"] == pytest.approx([3.0, 4.0, 2 + 2 * 0.1 / 0.15])
    assert rows[0]["goodput_rps"] == pytest.approx(2 + 2 * 0.1 / 0.15)
    assert rows[0]["goodput_rps_range"] == pytest.approx([3.0, 4.0])
    assert rows[0]["goodput_lower_bound"] is True
    assert rows[1]["ttft_p90_s"] == 0.25 and rows[1]["ttft_p90_s_range"] == [0.1, 0.3]


@pytest.mark.parametrize("firsts, expected", [
    ([], 0),
    ([1.0, 1.002, 1.004, 2.0], 3),
    ([1.0, 1.004, 1.008, 1.012], 2),  # a chain of 4 ms steps: no 3 within 5 ms
    ([3.0, 1.0, 2.0], 1),
])
def test_stall_clusters_count_the_most_bursts_within_5_ms(firsts, expected):
    assert stall_clusters(firsts) == expected


def test_without_reuse_keeps_arrivals_and_lengths_and_shares_no_block():
    requests = [{"timestamp": 0, "hash_ids": [7, 8]}, {"timestamp": 5, "hash_ids": [7, 9, 10]}]
    assert upper_bound_hit_rate(requests) > 0
    out = without_reuse(requests)
    assert out == [{"timestamp": 0, "hash_ids": [0, 1]}, {"timestamp": 5, "hash_ids": [2, 3, 4]}]
    assert upper_bound_hit_rate(out) == 0.0
    assert requests[0]["hash_ids"] == [7, 8]  # the sample itself is left as it was


def test_sessions_extend_the_conversation_over_a_shared_system_prompt():
    from benchmarks.simulated.routing_at_scale import sessions

    rows = sessions(400, 4, seed=0)
    assert len(rows) == 400 and rows == sessions(400, 4, seed=0)
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    systems = {tuple(r["hash_ids"][:2]) for r in rows}
    assert len(systems) <= 4  # every prompt opens with one of the 4 system prompts
    by_last = {r["hash_ids"][-1]: r for r in rows}
    followed = 0
    for row in rows:  # a later turn holds the earlier one whole, then its answer and a message
        earlier = by_last.get(row["hash_ids"][-3]) if len(row["hash_ids"]) > 3 else None
        if earlier is not None and row["hash_ids"][:-2] == earlier["hash_ids"]:
            assert row["timestamp"] >= earlier["timestamp"]
            assert row["input_length"] == earlier["input_length"] + 2 * 512
            followed += 1
    assert followed > 100


@pytest.mark.parametrize("real, sim, expected", [
    ([0, 0, 1, 1], [0, 0, 1, 0], (0.75, False)),
    ([0, 0, 1, None], [1, 1, 0, 0], (0.75, True)),  # the engines paired the other way round
    ([0, 1], [0, 0], (0.5, False)),
])
def test_port_agreement_takes_the_better_pairing_of_the_engines(real, sim, expected):
    from benchmarks.port_fidelity import agreement

    assert agreement(real, sim) == expected


# vllm-router 0.1.17's Prometheus lines for its cache_aware decisions, as it writes them
_ROUTED_BY_TOKENS = """# TYPE vllm_router_prefix_routing_decisions_total counter
vllm_router_prefix_routing_decisions_total{policy="cache_aware",stage="regular",outcome="prefix_hit"} 49
vllm_router_prefix_routing_decisions_total{policy="cache_aware",stage="regular",outcome="prefix_miss"} 72
vllm_router_prefix_routing_decisions_total{policy="cache_aware",stage="prefill",outcome="prefix_miss"} 3
vllm_router_kv_routing_inputs_total{transport="http",result="render"} 242
"""
_FELL_BACK = """vllm_router_kv_routing_inputs_total{transport="http",result="preparation_rejected"} 240
vllm_router_prefix_routing_decisions_total{policy="cache_aware",stage="regular",outcome="missing_tokens"} 120
"""


@pytest.mark.parametrize(("metrics", "expected"), [
    (_ROUTED_BY_TOKENS, {"prefix_hit": 49.0, "prefix_miss": 75.0}),
    (_FELL_BACK, {"missing_tokens": 120.0}),
    ("", {}),
])
def test_vllm_router_decisions_are_read_by_outcome(metrics, expected):
    from benchmarks.common.baseline import prefix_outcomes

    assert prefix_outcomes(metrics) == expected


def test_capacity_counts_each_request_at_the_reuse_bound_and_the_work_spread_perfectly():
    """Two 64-token prompts of the same 4 blocks of 16, at 1 ms a token: the first computes 64
    tokens, the second its last block (a prompt held whole still computes one token, so the
    engine computes that block), then 2 decode steps each at 1 ms + 0.5 ms a request in it."""
    from benchmarks.simulated.routing_at_scale import capacity, engine_seconds
    from sim.engine import SimRequest
    from sim.params import EngineParams
    from sim.workload import reusable_tokens

    params = EngineParams(name="t", block_size=16, kv_blocks=64, max_num_batched_tokens=64,
                          max_num_seqs=8, max_model_len=256, step_base_s=0.010,
                          per_token_s=0.001, per_seq_s=0.0005)
    assert engine_seconds(params, 64, 0, 3) == pytest.approx((0.0645, 0.0675))
    assert engine_seconds(params, 64, 48, 3) == pytest.approx((0.0165, 0.0195))
    requests = [SimRequest(request_id=str(i), arrival=float(i), prompt_tokens=64,
                           block_hashes=[1, 2, 3, 4], output_tokens=3) for i in range(2)]
    bound = capacity(params, requests, replicas=4)
    assert bound["reuse_bound"] == 48 / 128
    assert bound["capacity_rps"] == pytest.approx(4 * 2 / (0.0675 + 0.0195))
    assert bound["prefill_capacity_rps"] == pytest.approx(4 * 2 / (0.0645 + 0.0165))
    # reusable_tokens' docstring example, in order of arrival whatever the list's order
    third = SimRequest(request_id="2", arrival=2.0, prompt_tokens=48, block_hashes=[1, 2, 9],
                       output_tokens=1)
    assert [cached for _, cached in reusable_tokens([third, *requests], 16)] == [0, 48, 32]


def test_the_streaming_client_times_each_chunk_with_a_choice():
    """The one client every token-timing benchmark uses: chunks with a choice are timed (the
    first is the first token, even with empty text), usage is kept, the path is the caller's,
    and a refusal keeps its status and body."""
    import asyncio

    import httpx

    from benchmarks.common.client import one_request

    events = [{"choices": [{"text": "", "token_ids": [7]}]},
              {"choices": [{"text": "ab", "token_ids": [8, 9]}]},
              {"choices": [{"text": "c"}]}, {"choices": [], "usage": {"completion_tokens": 4}}]
    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    paths = []

    def answer(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        if json.loads(request.content)["prompt"] == "refused":
            return httpx.Response(400, json={"error": {"message": "prompt: too long"}})
        return httpx.Response(200, text=sse, headers={"x-tokenfab-replica": "r1"})

    async def run() -> tuple[dict, dict]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer),
                                     base_url="http://127.0.0.1:9") as client:
            return (await one_request(client, {"prompt": "hi"}, "/completions"),
                    await one_request(client, {"prompt": "refused"}))

    ok, refused = asyncio.run(run())
    assert paths == ["/completions", "/v1/completions"]
    assert [n for _, n in ok["chunks"]] == [1, 2, None]
    times = [at for at, _ in ok["chunks"]]
    assert times == sorted(times) and ok["sent"] + times[-1] <= ok["done"]
    assert (ok["status"], ok["usage"], ok["replica"], ok["error"]) == (
        200, {"completion_tokens": 4}, "r1", "")
    assert refused["status"] == 400 and refused["chunks"] == []
    assert "prompt: too long" in refused["error"]


def test_soak_memory_is_sloped_per_process_after_its_warm_up():
    from benchmarks.soak import per_process

    # a gateway sampled every 60 s for 10 min, 100 MB during its warm-up then 1 MB a minute more;
    # a replica that a kill replaced after 4 min
    rss = [(t, {1: ("gateway", "g", (100.0 if t < 120 else 200.0 + (t - 120) / 60)),
                **({2: ("replicas", "r", 50.0 + t)} if t <= 240 else {})})
           for t in range(0, 660, 60)]
    got = {p["pid"]: p for p in per_process(rss)}
    assert got[1]["slope_mb_per_10min"] == 10.0  # the warm-up's jump left out
    assert got[2]["slope_mb_per_10min"] is None and got[2]["to_s"] == 240
    assert [p["role"] for p in per_process(rss)] == ["gateway", "replicas"]
