"""Real vLLM engines behind the real gateway in a real local Ray Serve cluster.

Module order matters: the scale-down test runs last and leaves one replica.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import httpx
import openai
import pytest

from tests.integration.cases import CHATS, PROMPTS
from tests.integration.conftest import Deployment

MODEL = "tiny"


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


def test_replicas_report_engine_load(deployment: Deployment, http: httpx.Client) -> None:
    prompt = "load stats " + "paper garden " * 150
    for _ in range(8):  # until a replica serves the prompt a second time, from its prefix cache
        response = http.post("/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
        cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        if cached:
            break
    assert cached >= 128
    replica = response.headers["x-tokenfab-replica"]
    time.sleep(2.5)  # replicas report every second
    reports = httpx.get(deployment.base_url.removesuffix("/v1") + "/tokenfab/replicas",
                        trust_env=False).json()
    load = next(r["load"] for r in reports if r["replica_id"] == replica)
    assert load["prefix_cache_queries"] >= 2 * response.json()["usage"]["prompt_tokens"]
    assert load["prefix_cache_hits"] >= cached
    assert 0.0 <= load["kv_cache_usage"] <= 1.0


def test_kv_events_match_router_block_hashes(deployment: Deployment, http: httpx.Client) -> None:
    """Each replica publishes BlockStored events on its endpoint, and the router's hashing of the
    prompt (vLLM's own functions, through pools.block_hasher) gives exactly the published hashes,
    with and without a cache salt."""
    import zmq

    from pools.block_hasher import VllmBlockHasher

    rows = _json_tail(deployment.tokenfab("status", "--json").stdout)
    context = zmq.Context()
    sockets = {}
    for row in rows:
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(row["kv_events_endpoint"])
        sockets[row["replica"]] = socket
    time.sleep(0.5)  # let the subscriptions reach the publishers
    try:
        for salt in (None, "tenant-a"):
            body = {"model": MODEL, "prompt": "kv events " + "stone river " * 200, "max_tokens": 2,
                    "return_token_ids": True} | ({"cache_salt": salt} if salt else {})
            response = http.post("/completions", json=body)
            assert response.status_code == 200, response.text
            prompt_ids = response.json()["choices"][0]["prompt_token_ids"]
            socket = sockets[response.headers["x-tokenfab-replica"]]
            block_size, published = _stored_hashes(socket, minimum=len(prompt_ids) // 128)
            expected = VllmBlockHasher(block_size).block_hashes(prompt_ids, cache_salt=salt)
            assert len(expected) >= 3
            assert published[:len(expected)] == expected
    finally:
        context.destroy(linger=0)


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
