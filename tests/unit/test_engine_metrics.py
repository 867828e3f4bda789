"""vLLM's Ray stat logger, buffered (pools.engine_metrics): the series written are the ones
vLLM's own logger writes, at most FLUSH_S later."""

from __future__ import annotations

import asyncio

from pools import engine_metrics
from pools.engine_metrics import BufferedCounter, BufferedGauge


class Recorded:
    """Stands in for a ray.util.metrics metric: what reached Ray's agent."""

    def __init__(self, real) -> None:
        self._tag_keys = real._tag_keys
        self.calls: list[tuple[str, float, dict[str, str]]] = []

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.calls.append(("set", value, tags))

    def inc(self, value: float, tags: dict[str, str]) -> None:
        self.calls.append(("inc", value, tags))


def test_gauges_keep_their_last_value_and_counters_their_sum_until_the_flush() -> None:
    gauge = BufferedGauge("vllm:num_requests_running", "d", ["model_name", "engine"])
    counter = BufferedCounter("vllm:prompt_tokens_cached", "d", ["model_name", "source"])
    gauge.metric, counter.metric = Recorded(gauge.metric), Recorded(counter.metric)

    async def steps() -> None:
        running = gauge.labels("tiny", "0")
        assert gauge.labels("tiny", "0") is running  # labelled once, not per step
        for value in (3, 1, 0):
            running.set(value)
        counter.labels("tiny", "device").inc(2)
        counter.labels("tiny", "device").inc(0)
        counter.labels("tiny", "device").inc(3)
        counter.labels("tiny", "remote").inc(4)
        assert gauge.metric.calls == counter.metric.calls == []  # nothing written per step
        await asyncio.sleep(engine_metrics.FLUSH_S + 0.2)  # then within FLUSH_S, unprompted

    asyncio.run(steps())
    assert [(op, value, tags["model_name"], tags["engine"]) for op, value, tags
            in gauge.metric.calls] == [("set", 0, "tiny", "0")]
    assert sorted((op, value, tags["source"]) for op, value, tags in counter.metric.calls) == \
        [("inc", 4, "remote"), ("inc", 5, "device")]
    assert all("ReplicaId" in tags for _, _, tags in counter.metric.calls)


def test_outside_an_event_loop_values_are_written_at_once() -> None:
    gauge = BufferedGauge("vllm:cache_config_info", "d", ["model_name"])
    gauge.metric = Recorded(gauge.metric)
    gauge.labels("tiny").set(1)
    assert [op for op, _, _ in gauge.metric.calls] == ["set"]


def test_a_loop_that_ended_before_its_flush_does_not_hold_back_the_next() -> None:
    gauge = BufferedGauge("vllm:kv_cache_usage_perc", "d", ["model_name"])
    gauge.metric = Recorded(gauge.metric)

    async def step(value: float) -> None:
        gauge.labels("tiny").set(value)

    asyncio.run(step(0.5))  # ends before its flush was due

    async def next_loop() -> None:
        gauge.labels("tiny").set(0.75)
        await asyncio.sleep(engine_metrics.FLUSH_S + 0.2)

    asyncio.run(next_loop())
    assert [value for _, value, _ in gauge.metric.calls] == [0.75]
