"""Real vLLM engines behind the real gateway in a real local Ray Serve cluster.

Module order matters: the scale-down test runs last and leaves one replica.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.cases import CHATS, PROMPTS
from tests.integration.conftest import Deployment, event_credentials, listeners_outside_loopback
from tests.promql import scrape

MODEL = "tiny"
ROOT = Path(__file__).resolve().parents[2]


def test_deployed_through_ray_job_submit(deployment: Deployment) -> None:
    assert "ready: OpenAI endpoint" in deployment.job_log
    assert "Job 'raysubmit_" in deployment.job_log and "succeeded" in deployment.job_log


@pytest.mark.parametrize("index", range(len(PROMPTS)), ids=[p.id for p in PROMPTS])
def test_completion_equals_bare_engine(deployment: Deployment, http: httpx.Client, index: int) -> None:
    case, expected = PROMPTS[index], deployment.reference["prompts"][index]
    response = http.post("/completions", json={
        "model": MODEL, "prompt": case.prompt, "max_tokens": case.max_tokens,
        "temperature": 0, "return_token_ids": True,
    })
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["prompt_token_ids"] == expected["prompt_token_ids"]
    assert choice["token_ids"] == expected["token_ids"]
    assert choice["text"] == expected["text"]


@pytest.mark.parametrize("index", range(len(CHATS)), ids=[c.id for c in CHATS])
def test_chat_equals_bare_engine(deployment: Deployment, http: httpx.Client, index: int) -> None:
    case, expected = CHATS[index], deployment.reference["chats"][index]
    response = http.post("/chat/completions", json={
        "model": MODEL, "messages": case.messages, "max_tokens": case.max_tokens,
        "temperature": 0, "return_token_ids": True,
    })
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["prompt_token_ids"] == expected["prompt_token_ids"]
    assert body["choices"][0]["token_ids"] == expected["token_ids"]
    assert body["choices"][0]["message"]["content"] == expected["text"]


def _sse_events(response: httpx.Response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line.removeprefix("data: ")))
    return events


def test_streamed_completion_equals_non_streamed(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "Streaming equals batch:", "max_tokens": 32, "temperature": 0}
    whole = http.post("/completions", json=body).json()
    with http.stream("POST", "/completions", json=body | {
        "stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(response)
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == whole["choices"][0]["text"]
    usage = events[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        whole["usage"]["prompt_tokens"], 32)


def test_tokens_that_make_no_character_stream_as_they_come(http: httpx.Client) -> None:
    """Byte 0xC5 over and over is no UTF-8: vLLM sends no text for it, only the token ids. The
    replica used to hold such chunks for text that never came, and the client got the whole
    reply at once at its end; they stream, one per step like vLLM's own server."""
    from pools.tiny_model import _hf_tokenizer

    c5 = _hf_tokenizer(seed=0).convert_tokens_to_ids("\u00c5")  # the tiny model's vocabulary
    # ~1 s of decode steps: this process shares the cores with the stack and, even at the
    # suite's priority (tests/conftest.py), waits up to ~0.5 s of it for a CPU; most gaps remain
    body = {"model": MODEL, "prompt": "Bytes:", "max_tokens": 192, "temperature": 0,
            "logit_bias": {str(c5): 100}, "stream": True, "return_token_ids": True}
    arrivals, ids, text = [], [], ""
    with http.stream("POST", "/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line.removeprefix("data: "))["choices"][0]
                arrivals.append(time.monotonic())
                ids += choice["token_ids"]
                text += choice["text"]
    assert ids == [c5] * 192 and text == ""
    # a decode step (milliseconds) between chunks; a reply held to its end has none
    gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:])]
    assert sum(gap > 0.001 for gap in gaps) > len(gaps) / 2, gaps


def test_openai_client_completions_chat_and_streaming(deployment: Deployment) -> None:
    client = openai.OpenAI(base_url=deployment.base_url, api_key="unused", max_retries=0,
                           http_client=httpx.Client(trust_env=False))
    assert [m.id for m in client.models.list()] == [MODEL]
    completion = client.completions.create(model=MODEL, prompt="The openai client", max_tokens=12,
                                           temperature=0)
    assert completion.usage.completion_tokens == 12
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0,
                                          messages=[{"role": "user", "content": "hi"}])
    stream = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0,
                                            messages=[{"role": "user", "content": "hi"}],
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)


BAD_REQUESTS = [
    # (id, raw body, status, substring of the error message, error param)
    ("malformed-json", b'{"model": "tiny", "prompt": ', 400, "not valid JSON", None),
    ("not-an-object", b'["tiny"]', 400, "must be a JSON object", None),
    ("missing-model", b'{"prompt": "x"}', 400, "model", "model"),
    ("unknown-model", b'{"model": "gpt-9", "prompt": "x"}', 404, "gpt-9", "model"),
    ("negative-max-tokens", b'{"model": "tiny", "prompt": "x", "max_tokens": -5}', 400,
     "max_tokens", "max_tokens"),
    ("wrong-type", b'{"model": "tiny", "prompt": "x", "max_tokens": "many"}', 400,
     "max_tokens", "max_tokens"),
    ("wrong-type-temperature", b'{"model": "tiny", "prompt": "x", "temperature": "hot"}', 400,
     "temperature", "temperature"),
    ("prompt-too-long", json.dumps({"model": "tiny", "prompt": "word " * 3000}).encode(), 400,
     "maximum context length", None),
    ("body-too-large", json.dumps({"model": "tiny", "prompt": "x" * (3 << 20)}).encode(), 413,
     "larger than", None),
]


@pytest.mark.parametrize("body,status,message,param", [c[1:] for c in BAD_REQUESTS],
                         ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_gets_openai_error(http: httpx.Client, body: bytes, status: int, message: str,
                                     param: str | None) -> None:
    response = http.post("/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param


def test_bad_chat_and_routes(http: httpx.Client) -> None:
    response = http.post("/chat/completions", json={"model": MODEL, "messages": "hello"})
    assert response.status_code == 400 and "messages" in response.json()["error"]["message"]
    response = http.get("/no-such-route")
    assert response.status_code == 404 and "error" in response.json()
    response = http.get("/completions")
    assert response.status_code == 405 and "error" in response.json()


def test_server_keeps_serving_after_bad_input(http: httpx.Client) -> None:
    for body, *_ in [c[1:] for c in BAD_REQUESTS]:
        http.post("/completions", content=body, headers={"content-type": "application/json"})
    response = http.post("/completions", json={"model": MODEL, "prompt": "still alive", "max_tokens": 4})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 4


def test_access_lines_go_to_the_replica_log_not_stderr(deployment: Deployment,
                                                       http: httpx.Client) -> None:
    """As Serve's own access lines: in the gateway replica's log file, not also on the worker's
    stderr, which Ray's log monitor tails and republishes line by line."""
    request_id = f"access-{uuid.uuid4().hex}"
    response = http.post("/completions", headers={"x-request-id": request_id},
                         json={"model": MODEL, "prompt": "logged once", "max_tokens": 1})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == request_id  # echoed as the client sent it
    logs = Path("/tmp/ray/session_latest/logs")
    replica_logs = list((logs / "serve").glob(f"replica_{deployment.topology.name}_gateway_*.log"))
    assert replica_logs

    def logged() -> bool:  # the gateway's own id: the client's and 8 hex characters
        return any(f"request_id={request_id}-" in path.read_text(errors="replace")
                   for path in replica_logs)
    deadline = time.monotonic() + 30
    while not logged():
        assert time.monotonic() < deadline, f"no access line for {request_id} in {replica_logs}"
        time.sleep(0.2)
    on_stderr = [path.name for path in logs.glob("worker-*")
                 if request_id in path.read_text(errors="replace")]
    assert on_stderr == []


async def _concurrent_replicas(base_url: str, count: int, max_tokens: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base_url, timeout=300, trust_env=False) as client:
        requests = [client.post("/completions", json={
            "model": MODEL, "prompt": f"request {i} of {count}", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}) for i in range(count)]
        return await asyncio.gather(*requests)


def test_two_replicas_both_serve_traffic(deployment: Deployment) -> None:
    responses = asyncio.run(_concurrent_replicas(deployment.base_url, 8, 48))
    assert all(r.status_code == 200 for r in responses)
    replicas = {r.headers["x-tokenfab-replica"] for r in responses}
    assert len(replicas) == 2


def test_status_shows_healthy_replicas_on_their_own_cores(deployment: Deployment) -> None:
    result = deployment.tokenfab("status", "--json")
    assert result.returncode == 0, result.stderr
    rows = _json_tail(result.stdout)
    assert len(rows) == 2
    assert {row["health"] for row in rows} == {"healthy"}
    assert {row["engine"] for row in rows} == {"ready"}
    assert {row["node"] for row in rows} == {"127.0.0.1"}
    assert sorted(row["cores"] for row in rows) == ["0", "1"]
    table = deployment.tokenfab("status").stdout
    assert table.count("healthy") == 2 and "POOL" in table


def test_the_request_path_runs_at_the_raylets_priority(deployment: Deployment) -> None:
    """Not at Ray's worker niceness (15 more): each replica, and its engine's processes, at the
    nice of the raylet that started it."""
    import psutil

    for report in _gateway(deployment, "/tokenfab/replicas"):
        replica = psutil.Process(report["pid"])
        raylet = next(p for p in replica.parents() if p.name() == "raylet")
        engine = replica.children(recursive=True)
        assert engine, "the engine core runs in a process of its own"
        assert {p.nice() for p in [replica, *engine]} == {raylet.nice()}, report["replica_id"]


def test_replicas_report_engine_load(deployment: Deployment, http: httpx.Client) -> None:
    prompt = "load stats " + "paper garden " * 150
    for _ in range(8):  # until a replica serves the prompt a second time, from its prefix cache
        response = http.post("/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
        cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        if cached:
            break
    assert cached >= 128
    replica = response.headers["x-tokenfab-replica"]

    def reported() -> dict:
        return next(r["load"] for r in _gateway(deployment, "/tokenfab/replicas")
                    if r["replica_id"] == replica)
    queried, deadline = 2 * response.json()["usage"]["prompt_tokens"], time.monotonic() + 10
    while (load := reported())["prefix_cache_queries"] < queried \
            or load["prefix_cache_hits"] < cached:  # replicas report every second
        assert time.monotonic() < deadline, (load, queried, cached)
        time.sleep(0.2)
    assert 0.0 <= load["kv_cache_usage"] <= 1.0


def test_kv_events_match_router_block_hashes(deployment: Deployment, http: httpx.Client) -> None:
    """Each replica publishes BlockStored events on its endpoint, and the router's hashing of the
    prompt (router.hashing, vLLM's algorithm written out) gives exactly the published hashes,
    with and without a cache salt. A subscriber without the application's key, on the same
    endpoints at the same time, receives nothing."""
    import zmq

    from router.hashing import PrefixBlockHasher

    context = zmq.Context()
    sockets = _subscribe_to_replicas(deployment, context)
    keyless = _subscribe_to_replicas(deployment, context, credentials=None)
    try:
        for salt in (None, "tenant-a"):
            body = {"model": MODEL, "prompt": "kv events " + "stone river " * 200, "max_tokens": 2,
                    "return_token_ids": True} | ({"cache_salt": salt} if salt else {})
            response = http.post("/completions", json=body)
            assert response.status_code == 200, response.text
            prompt_ids = response.json()["choices"][0]["prompt_token_ids"]
            socket = sockets[response.headers["x-tokenfab-replica"]]
            block_size, published = _stored_hashes(socket, minimum=len(prompt_ids) // 128)
            expected = PrefixBlockHasher(block_size).block_hashes(prompt_ids, cache_salt=salt)
            assert len(expected) >= 3
            assert published[:len(expected)] == expected
        for replica, socket in keyless.items():
            assert not socket.poll(0, zmq.POLLIN), f"a keyless subscriber read {replica}'s events"
    finally:
        context.destroy(linger=0)


_KEYS = object()  # the application's keys, read from the GCS


def _subscribe_to_replicas(deployment: Deployment, context, credentials=_KEYS) -> dict:
    """A SUB socket on each replica's KV event endpoint (from `tokenfab status`), by replica,
    presenting the application's keys unless told otherwise."""
    import zmq

    if credentials is _KEYS:
        credentials = event_credentials(deployment.topology)
    sockets = {}
    for row in _json_tail(deployment.tokenfab("status", "--json").stdout):
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.setsockopt(zmq.LINGER, 0)
        if credentials is not None:
            credentials.apply(socket, row["kv_events_endpoint"])
        socket.connect(row["kv_events_endpoint"])
        sockets[row["replica"]] = socket
    time.sleep(0.5)  # let the subscriptions reach the publishers
    return sockets


def _json_tail(output: str) -> list[dict]:
    return json.loads(output[output.index("["):])


def _stored_hashes(socket, minimum: int, timeout_s: float = 20.0) -> tuple[int, list]:
    """Block hashes of BlockStored events, in publication order, until `minimum` have come."""
    import zmq

    from router.events import BlockStored, decode_batch

    deadline, hashes, block_size = time.monotonic() + timeout_s, [], 0
    while time.monotonic() < deadline and len(hashes) < minimum:
        if socket.poll(500, zmq.POLLIN):
            _topic, _seq, payload = socket.recv_multipart()
            for event in decode_batch(payload).events:
                if isinstance(event, BlockStored):
                    hashes += event.block_hashes
                    block_size = event.block_size
    return block_size, hashes


def _gateway(deployment: Deployment, path: str, body: dict | None = None):
    url = deployment.base_url.removesuffix("/v1") + path
    response = httpx.post(url, json=body, timeout=60, trust_env=False) if body is not None \
        else httpx.get(url, timeout=60, trust_env=False)
    assert response.status_code == 200, response.text
    return response.json()


def _router_replicas(deployment: Deployment) -> dict[str, dict]:
    return _gateway(deployment, "/tokenfab/router")["pools"]["main"]["replicas"]


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _long_prompt(tag: str, words: int = 300) -> str:
    return f"{tag} " + " ".join(f"{tag}{i % 37}" for i in range(words))


def test_router_hashes_chats_and_prompts_as_the_engine_does(deployment: Deployment,
                                                            http: httpx.Client) -> None:
    """The gateway tokenises (chat template included) and hashes a request; the hashes it will
    route with are exactly those the serving engine then publishes in BlockStored events."""
    import zmq

    context = zmq.Context()
    sockets = _subscribe_to_replicas(deployment, context)
    cases = [
        ("chat", {"messages": [{"role": "system", "content": _long_prompt("sys", 200)},
                               {"role": "user", "content": "hash me " * 40}]}),
        ("chat", {"messages": [{"role": "user", "content": _long_prompt("solo", 260)}],
                  "cache_salt": "tenant-b"}),
        ("completions", {"prompt": _long_prompt("plain", 340)}),
    ]
    try:
        for endpoint, fields in cases:
            body = {"model": MODEL, "max_tokens": 2} | fields
            explained = _gateway(deployment, f"/tokenfab/route/{endpoint}", body)["main"]
            expected = explained["block_hashes"]
            assert len(expected) >= 3 and explained["prompt_tokens"] >= 3 * explained["block_size"]
            path = "/chat/completions" if endpoint == "chat" else "/completions"
            response = http.post(path, json=body)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["prompt_tokens"] == explained["prompt_tokens"]
            socket = sockets[response.headers["x-tokenfab-replica"]]
            _, published = _stored_hashes(socket, minimum=len(expected))
            assert [h.hex() if isinstance(h, bytes) else str(h) for h in published[:len(expected)]] \
                == expected
    finally:
        context.destroy(linger=0)


def test_requests_sharing_a_prefix_go_where_it_is_cached(deployment: Deployment,
                                                         http: httpx.Client) -> None:
    prefix = _long_prompt("affinity", 320)
    first = http.post("/completions", json={"model": MODEL, "prompt": prefix + " first",
                                            "max_tokens": 2})
    assert first.status_code == 200, first.text
    holder = first.headers["x-tokenfab-replica"]
    prompt_tokens = first.json()["usage"]["prompt_tokens"]
    _wait(lambda: _router_replicas(deployment)[holder]["cached_blocks"] >= prompt_tokens // 128,
          10, "the holder's BlockStored events in the router's map")
    explained = _gateway(deployment, "/tokenfab/route/completions",
                         {"model": MODEL, "prompt": prefix + " second"})["main"]
    cached = {c["replica"]: c["cached_tokens"] for c in explained["candidates"]}
    assert cached[holder] >= 128 * (prompt_tokens // 128 - 1)
    assert explained["ranked"][0] == holder
    for turn in ("second", "third", "fourth", "fifth"):
        response = http.post("/completions", json={"model": MODEL, "prompt": f"{prefix} {turn}",
                                                   "max_tokens": 2})
        assert response.headers["x-tokenfab-replica"] == holder
        engine_cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert engine_cached >= 128 * (prompt_tokens // 128 - 1)  # the engine confirms the hit
    samples = scrape(deployment.base_url.removesuffix("/v1") + "/metrics")
    decisions = [s for s in samples if s.name == "tokenfab_router_decisions_total"]
    assert [(s.labels["policy"], s.labels["pool"]) for s in decisions] == [("kv_aware", "main")]
    assert decisions[0].value >= 4 and decisions[0].labels["ingress"]  # one ingress replica here
    assert any(s.name == "tokenfab_router_predicted_cached_tokens_total" for s in samples)
    status = _json_tail(deployment.tokenfab("status", "--json").stdout)
    assert {row["replica"]: row["cached_blocks"] for row in status}[holder] >= prompt_tokens // 128


def test_simulator_reproduces_this_deployment(deployment: Deployment) -> None:
    """The simulator's short fidelity check (sim.fidelity, the full one is
    benchmarks/sim_fidelity.py): calibrated on this deployment, then one window of the
    Mooncake trace through the real replicas and through the simulator with the same router."""
    from sim import fidelity, workload
    from sim.calibrate import single_token_words

    reports = _gateway(deployment, "/tokenfab/replicas")
    block_size, kv_blocks = reports[0]["block_size"], min(r["kv_blocks"] for r in reports)
    rows = workload.read_trace(_shared_trace())
    window = _by_root(rows, seed=0)  # 262 requests; their reuse comes late in the window
    roots = {row["hash_ids"][0] for row in window}
    calibration = [r for r in _by_root(rows, seed=1) if r["hash_ids"][0] not in roots][:150]
    topology = deployment.topology
    words = single_token_words(str(topology.model.resolved_path))
    result = fidelity.check(deployment.base_url, MODEL, words, policy="kv_aware",
                            replicas=len(reports), block_size=block_size, kv_blocks=kv_blocks,
                            max_model_len=topology.model.max_model_len, window=window,
                            calibration=calibration, rate=3.0, max_ids=8,
                            ttft_target_s=topology.targets(topology.pools[0]).ttft_p90_s)
    sim, real = result["sim"], result["real"]
    errors = {m: (sim[m] - real[m]) / real[m] for m in fidelity.METRICS}
    assert real["hit_rate"] > 0.3, (sim, real)  # the window's prefixes were reused (bound 0.63)
    assert abs(errors["hit_rate"]) <= 0.15, (errors, sim, real)
    # TTFT p50 within a factor of 3, a guard against a broken model, not the issue's +-15%: the
    # full benchmark does not meet that on this machine (docs/simulator.md), and here the real
    # p90 swung from 0.3 to 1.2 s between two runs of this test
    ratio = sim["ttft_p50_s"] / real["ttft_p50_s"]
    assert 1 / 3 <= ratio <= 3, (errors, sim, real)


def _shared_trace():
    for path in (ROOT.parent / "shared/traces/synthetic_trace.jsonl",
                 Path("/work/shared/traces/synthetic_trace.jsonl")):
        if path.exists():
            return path
    raise FileNotFoundError("the shared Mooncake trace (../shared/traces) is missing")


def _by_root(rows: list[dict], seed: int, share: float = 0.06) -> list[dict]:
    """The trace's requests of a seeded share of its conversation roots, in trace order."""
    import random

    roots = sorted({row["hash_ids"][0] for row in rows})
    chosen = set(random.Random(seed).sample(roots, int(share * len(roots))))
    return [row for row in rows if row["hash_ids"][0] in chosen]


def test_evicted_blocks_leave_the_map(deployment: Deployment, http: httpx.Client) -> None:
    """New 1,800-token prompts, twice the holder's KV capacity of them placed there (128 MiB of
    float32 KV holds 32,768 tokens of the tiny model), evict an earlier prefix; the map, fed by
    BlockRemoved events, stops claiming it, and the engine agrees (no cached tokens when it comes
    back). The router places the flood, so rounds of 40 go until enough of it reached the holder:
    one round, split evenly, puts about 1.1x the capacity on each replica, so an uneven split
    could leave the prefix in place."""
    prefix = _long_prompt("evictme", 320)
    first = http.post("/completions", json={"model": MODEL, "prompt": prefix, "max_tokens": 1})
    holder = first.headers["x-tokenfab-replica"]
    report = next(r for r in _gateway(deployment, "/tokenfab/replicas")
                  if r["replica_id"] == holder)
    enough = 2 * report["kv_blocks"] * report["block_size"]  # prompt tokens placed on the holder

    def holder_cached() -> int:
        explained = _gateway(deployment, "/tokenfab/route/completions",
                             {"model": MODEL, "prompt": prefix})["main"]
        return {c["replica"]: c["cached_tokens"] for c in explained["candidates"]}.get(holder, 0)

    _wait(lambda: holder_cached() > 0, 10, "the prefix in the map")

    async def flood(round_: int) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=deployment.base_url, timeout=300,
                                     trust_env=False) as client:
            return await asyncio.gather(*[client.post("/completions", json={
                "model": MODEL, "prompt": _long_prompt(f"flood{i}{'xyzw'[round_]}", 300),
                "max_tokens": 1}) for i in range(40)])

    served: list[dict[str, int]] = []  # each round's requests per replica
    on_holder = 0
    for round_ in range(4):
        replies = asyncio.run(flood(round_))
        assert [r.status_code for r in replies] == [200] * 40
        served.append(dict(Counter(r.headers["x-tokenfab-replica"] for r in replies)))
        on_holder += sum(r.json()["usage"]["prompt_tokens"] for r in replies
                         if r.headers["x-tokenfab-replica"] == holder)
        if on_holder >= enough:
            break
    assert on_holder >= enough, f"the router placed too little of the flood on {holder}: {served}"
    flooded = time.monotonic()
    _wait(lambda: holder_cached() == 0, 10, f"BlockRemoved events to clear the prefix (the "
          f"flood's replicas {served}, the prefix's {holder})")
    print(f"prefix on {holder} cleared {time.monotonic() - flooded:.1f} s after the flood; "
          f"{served}")
    again = http.post("/completions", json={"model": MODEL, "prompt": prefix, "max_tokens": 1})
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_restarted_gateway_rebuilds_the_map_from_replay(deployment: Deployment,
                                                        http: httpx.Client) -> None:
    """A new ingress replica joins after the events were published: it detects that it missed
    them and replays them from each engine's replay endpoint, so routing keeps its affinity."""
    import os
    import signal

    prefix = _long_prompt("replayed", 320)
    first = http.post("/completions", json={"model": MODEL, "prompt": prefix, "max_tokens": 1})
    holder = first.headers["x-tokenfab-replica"]
    before = _router_replicas(deployment)
    pid = _gateway(deployment, "/tokenfab/router")["ingress"]["pid"]
    os.kill(pid, signal.SIGKILL)

    def restarted() -> bool:
        try:
            return _gateway(deployment, "/tokenfab/router")["ingress"]["pid"] != pid
        except (httpx.HTTPError, AssertionError):
            return False

    _wait(restarted, 60, "Serve to restart the gateway")
    _wait(lambda: _router_replicas(deployment).get(holder, {}).get("cached_blocks", 0)
          >= before[holder]["cached_blocks"], 15, "the new gateway to rebuild the map")
    assert _router_replicas(deployment)[holder]["caught_up"] > 0
    response = http.post("/completions", json={"model": MODEL, "prompt": prefix + " again",
                                               "max_tokens": 1})
    assert response.headers["x-tokenfab-replica"] == holder
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def _victim(deployment: Deployment, http: httpx.Client, prefix: str):
    """The replica that served `prefix` (its blocks now in the router's map), and its process."""
    import psutil

    victim = http.post("/completions", json={"model": MODEL, "prompt": prefix, "max_tokens": 1}
                       ).headers["x-tokenfab-replica"]
    _wait(lambda: _router_replicas(deployment).get(victim, {}).get("cached_blocks", 0) > 0, 10,
          "the victim's blocks in the map")
    reports = _gateway(deployment, "/tokenfab/replicas")
    return victim, psutil.Process(next(r["pid"] for r in reports if r["replica_id"] == victim))


def test_a_dead_engine_costs_no_request(deployment: Deployment, http: httpx.Client) -> None:
    """SIGKILL one replica's EngineCore: requests the router sends there (its cache holds their
    prefix) fail on it before any byte reached the client, and the gateway sends them to the
    other replica (gateway.retries): every one is answered, whole, streamed or not. Serve then
    replaces the broken replica (it ends its process at its next health check)."""
    import signal

    prefix = _long_prompt("dead", 300)
    victim, replica = _victim(deployment, http, prefix)
    core = next(p for p in replica.children() if p.name() == "VLLM::EngineCore")
    core.send_signal(signal.SIGKILL)
    core.wait(10)
    answered = []
    for i in range(6):
        body = {"model": MODEL, "prompt": f"{prefix} {i}", "max_tokens": 8, "temperature": 0,
                "stream": i % 2 == 1}
        response = http.post("/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.headers["x-tokenfab-replica"] != victim
        text = response.text
        assert ("data: [DONE]" in text) if body["stream"] else \
            response.json()["usage"]["completion_tokens"] == 8
        assert '"error"' not in text
        answered.append(response.headers["x-tokenfab-replica"])
    samples = scrape(deployment.base_url.removesuffix("/v1") + "/metrics")
    assert sum(s.value for s in samples if s.name == "tokenfab_router_replica_failures_total"
               and s.labels["replica"] == victim) >= 1  # the router did try the victim

    def replaced() -> bool:
        rows = _json_tail(deployment.tokenfab("status", "--json").stdout)
        healthy = {row["replica"] for row in rows if row["health"] == "healthy"}
        return len(healthy) == 2 and victim not in healthy
    _wait(replaced, 240, "Serve to replace the replica whose engine died")


def test_replaced_replica_leaves_the_map_and_its_successor_joins(deployment: Deployment,
                                                                  http: httpx.Client) -> None:
    """A replica that dies is replaced by Serve under a new id: its engine processes end with it
    (pools/engine_watchdog.py), the dead one's blocks leave the map (they are gone with its
    engine), the new one is followed, and requests keep succeeding."""
    import signal

    import psutil

    from orchestrator.cluster import orphaned_engine_processes

    prefix = _long_prompt("doomed", 320)
    victim, replica = _victim(deployment, http, prefix)
    engines = [p for p in replica.children(recursive=True) if p.name().startswith("VLLM::")]
    assert len(engines) >= 2  # EngineCore and its worker
    replica.send_signal(signal.SIGKILL)  # the replica, not its engine
    gone, alive = psutil.wait_procs(engines, timeout=10)  # each checks its parent every second
    for process in alive:
        process.kill()
    assert not alive, f"engine processes outlived their replica by 10 s: {alive}"
    assert not orphaned_engine_processes()
    _wait(lambda: victim not in _router_replicas(deployment), 30, "the dead replica to leave")
    assert http.post("/completions", json={"model": MODEL, "prompt": prefix, "max_tokens": 1}
                     ).status_code == 200  # the survivor serves meanwhile

    def successor_followed() -> bool:
        rows = _json_tail(deployment.tokenfab("status", "--json").stdout)
        healthy = {row["replica"] for row in rows if row["health"] == "healthy"}
        return len(healthy) == 2 and healthy == set(_router_replicas(deployment))

    _wait(successor_followed, 240, "a successor replica, followed by the router")


def test_scale_down_drains_in_flight_requests(deployment: Deployment) -> None:
    async def scenario() -> tuple[list[httpx.Response], subprocess.CompletedProcess]:
        requests = asyncio.create_task(_concurrent_replicas(deployment.base_url, 6, 500))
        await asyncio.sleep(3)  # every request is decoding now
        scaled = await asyncio.to_thread(deployment.tokenfab, "scale", "main", "1")
        return await requests, scaled

    responses, scaled = asyncio.run(scenario())
    assert scaled.returncode == 0, scaled.stderr
    assert [r.status_code for r in responses] == [200] * 6
    assert all(r.json()["usage"]["completion_tokens"] == 500 for r in responses)
    assert len({r.headers["x-tokenfab-replica"] for r in responses}) == 2  # one was removed mid-flight
    rows = _json_tail(deployment.tokenfab("status", "--json").stdout)
    assert len(rows) == 1 and rows[0]["health"] == "healthy"
    # the removed replica leaves the router's map once the registry stops reporting it
    _wait(lambda: set(_router_replicas(deployment)) == {rows[0]["replica"]}, 30,
          "the removed replica to leave the map")


def test_nothing_listens_outside_loopback(deployment: Deployment, http: httpx.Client) -> None:
    """The gateway, both pool replicas with their engines, relays and channels, Serve's replica
    gRPC servers and Ray's daemons: every listening socket on 127.0.0.0/8, none on a wildcard."""
    assert http.post("/completions", json={"model": MODEL, "prompt": "listen", "max_tokens": 1}
                     ).status_code == 200
    assert listeners_outside_loopback() == []
