"""The multi-tenant gateway in front of a real engine: keys, permissions, limits, fairness,
prefix-cache isolation and per-tenant metrics (topology-tenants.yaml)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.config import Topology
from orchestrator.status import ADMIN_KEY_ENV, collect, gateway_url
from tokenfab.errors import ClusterError
from tests.integration.conftest import ROOT, up
from tests.promql import scrape

TOPOLOGY = ROOT / "tests/integration/topology-tenants.yaml"
MODEL = "tiny"
# Long enough for several full KV blocks (128 tokens on CPU), unique to this module
SHARED_PROMPT = "tenant isolation probe: " + " ".join(f"word{i % 97} green" for i in range(300))


@pytest.fixture(scope="module")
def tenants(ray_cluster) -> Topology:
    with up(TOPOLOGY) as topology:
        yield topology


@pytest.fixture(scope="module")
def root(tenants: Topology) -> str:
    return gateway_url(tenants)


def _client(root: str, key: str | None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{root}/v1", api_key=key or "", max_retries=0,
                         http_client=httpx.Client(trust_env=False, timeout=120))


def _get(root: str, key: str | None, path: str) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{root}{path}", headers=headers, trust_env=False, timeout=30)


def _post(root: str, key: str | None, body: dict[str, Any], path: str = "/v1/completions",
          **kw: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{root}{path}", json=body, headers=headers, trust_env=False, timeout=120,
                      **kw)


ADMIN_KEY = "admin-key"


def _metric(root: str, name: str, **labels: str) -> float:
    return sum(s.value for s in scrape(f"{root}/metrics", ADMIN_KEY)
               if s.name == name and labels.items() <= s.labels.items())


def test_openai_client_with_a_key(root: str) -> None:
    client = _client(root, "alpha-key")
    assert [m.id for m in client.models.list()] == [MODEL]
    completion = client.completions.create(model=MODEL, prompt="Tenants say", max_tokens=8,
                                           temperature=0)
    assert completion.usage.completion_tokens == 8
    stream = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                            messages=[{"role": "user", "content": "hi"}],
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 8
    # without include_usage the gateway still learns the usage, and the client sees no usage chunk
    chunks = list(client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, stream=True,
        messages=[{"role": "user", "content": "hi"}]))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
    with pytest.raises(openai.AuthenticationError):
        _client(root, "wrong-key").completions.create(model=MODEL, prompt="x", max_tokens=1)
    with pytest.raises(openai.PermissionDeniedError):
        _client(root, "nomodel-key").completions.create(model=MODEL, prompt="x", max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)


@pytest.mark.parametrize("key,status,code", [
    (None, 401, "invalid_api_key"),
    ("not-a-key", 401, "invalid_api_key"),
    ("alpha-key", 200, None),
    ("alpha-key-2", 200, None),  # the rotated key works beside the old one
    ("nomodel-key", 403, "model_not_allowed"),
])
def test_auth(root: str, key: str | None, status: int, code: str | None) -> None:
    response = _post(root, key, {"model": MODEL, "prompt": "auth", "max_tokens": 2})
    assert response.status_code == status, response.text
    if code is not None:
        assert response.json()["error"]["code"] == code


def test_requests_per_minute_limit_gives_retry_after(root: str) -> None:
    body = {"model": MODEL, "prompt": "rpm", "max_tokens": 1}
    statuses = [_post(root, "rpm-key", body).status_code for _ in range(3)]
    assert statuses == [200, 200, 200]
    refused = _post(root, "rpm-key", body)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "requests_per_minute"
    assert 1 <= int(refused.headers["retry-after"]) <= 20  # 3/min: one more every 20 s
    assert _post(root, "beta-key", body).status_code == 200  # other tenants are not affected


def test_tokens_per_minute_limit(root: str) -> None:
    body = {"model": MODEL, "prompt": "tpm", "max_tokens": 200, "ignore_eos": True}
    assert _post(root, "tpm-key", body).status_code == 200
    refused = _post(root, "tpm-key", body)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "tokens_per_minute"
    assert int(refused.headers["retry-after"]) >= 1
    too_big = _post(root, "tpm-key", body | {"max_tokens": 1000})
    assert too_big.status_code == 429 and "more than" in too_big.json()["error"]["message"]
    assert _post(root, "beta-key", body).status_code == 200


def test_concurrency_limit_and_disconnect_frees_the_slot(root: str) -> None:
    # 8 sequences x 2000 tokens: 16,000 tokens hold the tenant's one slot for several seconds
    long = {"model": MODEL, "prompt": "concurrency", "max_tokens": 2000, "n": 8,
            "ignore_eos": True}
    small = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    with ThreadPoolExecutor(1) as pool:
        holder = pool.submit(_post, root, "single-key", long)
        time.sleep(1.0)  # admitted by then: the gateway is idle apart from it
        refused = _post(root, "single-key", small)
        assert not holder.done(), "the long request ended before the check: make it longer"
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "concurrency_limit"
        assert refused.headers["retry-after"] == "1"
        assert _post(root, "beta-key", small).status_code == 200  # other tenants unaffected
        assert holder.result().status_code == 200
    assert _post(root, "single-key", small).status_code == 200
    # A client that leaves mid-stream frees its slot at once: the gateway aborts the request
    # (run to the end, it would hold the slot for many seconds).
    with httpx.stream("POST", f"{root}/v1/completions", json=long | {"stream": True},
                      trust_env=False, timeout=120,
                      headers={"authorization": "Bearer single-key"}) as running:
        next(running.iter_lines())
    left = time.monotonic()
    while (status := _post(root, "single-key", small).status_code) == 429 and \
            time.monotonic() - left < 2:
        time.sleep(0.1)
    assert status == 200, f"slot still held {time.monotonic() - left:.1f} s after the client left"


def test_size_limits_and_default_output_length(root: str) -> None:
    too_long = _post(root, "sizes-key", {"model": MODEL, "prompt": "word " * 300, "max_tokens": 1})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt"
    too_many = _post(root, "sizes-key", {"model": MODEL, "prompt": "x", "max_tokens": 65})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "max_tokens"
    # every prompt shape is counted: none gets past the limit uncounted
    long_text, short_text = "word " * 300, "word " * 10
    for shape in ([short_text, long_text], [[7] * 10, [7] * 300], [7] * 300):
        refused = _post(root, "sizes-key", {"model": MODEL, "prompt": shape, "max_tokens": 1})
        assert refused.status_code == 400, (shape[:2], refused.text)
        assert refused.json()["error"]["code"] == "prompt_too_long"
    parts = [{"type": "text", "text": short_text}, {"type": "text", "text": long_text}]
    refused = _post(root, "sizes-key", {"model": MODEL, "max_tokens": 1,
                                        "messages": [{"role": "user", "content": parts}]},
                    path="/v1/chat/completions")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"
    for shape in ([short_text, short_text], [[7] * 10, [7] * 10]):
        batch = _post(root, "sizes-key", {"model": MODEL, "prompt": shape, "max_tokens": 1})
        assert batch.status_code == 200 and len(batch.json()["choices"]) == 2, batch.text
    default = _post(root, "sizes-key", {"model": MODEL, "prompt": "x", "ignore_eos": True})
    assert default.json()["usage"]["completion_tokens"] == 64  # the tenant's max_output_tokens


def _cached(root: str, key: str, prompt: str) -> int:
    response = _post(root, key, {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_prefix_cache_is_isolated_between_tenants(root: str) -> None:
    assert _cached(root, "alpha-key", SHARED_PROMPT) == 0
    assert _cached(root, "alpha-key", SHARED_PROMPT) > 0  # the tenant's own repeat hits
    assert _cached(root, "beta-key", SHARED_PROMPT) == 0  # another tenant's never does
    # a client cannot reach another tenant's cache by sending a salt of its own
    response = _post(root, "beta-key", {"model": MODEL, "prompt": SHARED_PROMPT, "max_tokens": 1,
                                        "cache_salt": "alpha"})
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_no_caller_can_probe_another_tenants_cache(root: str) -> None:
    """The attack of issue 15: alpha sends a prompt; then a caller with no key, or with beta's,
    sends it with the salt alpha's requests used to carry (a hash of the app's and the
    tenant's names, both public) and asks the explain route or the engine whether it is
    cached."""
    prompt = SHARED_PROMPT.replace("probe", "cache probe")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    explain = "/tokenfab/route/completions"
    assert _cached(root, "alpha-key", prompt) == 0

    def alpha_sees_its_blocks() -> bool:  # the control: the map holds alpha's blocks
        candidates = _post(root, "alpha-key", body, path=explain).json()["main"]["candidates"]
        return max(c["cached_tokens"] for c in candidates) >= 128
    deadline = time.monotonic() + 30
    while not alpha_sees_its_blocks():
        assert time.monotonic() < deadline, "alpha's blocks never reached the router's map"
        time.sleep(0.2)
    public = hashlib.sha256(b"tokenfab/itest-tenants/tenant:alpha").hexdigest()[:32]
    probe = body | {"cache_salt": public}
    keyless = _post(root, None, probe, path=explain)
    assert keyless.status_code == 401, keyless.text
    foreign = _post(root, "beta-key", probe, path=explain)
    assert foreign.status_code == 200, foreign.text
    assert [c["cached_tokens"] for c in foreign.json()["main"]["candidates"]] == [0]
    # nor the replicas' load, which is other tenants' traffic (their prompts' sizes)
    assert [set(c) for c in foreign.json()["main"]["candidates"]] == [
        {"replica", "cached_tokens", "approx_cached_tokens"}]
    assert set(foreign.json()["main"]) == {"pool", "policy", "prompt_tokens", "block_size",
                                           "block_hashes", "candidates"}  # no ranking
    answered = _post(root, "beta-key", probe)
    assert answered.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_tenants_in_a_cache_group_share_hits(root: str) -> None:
    prompt = SHARED_PROMPT.replace("probe", "group probe")
    assert _cached(root, "gamma-key", prompt) == 0
    assert _cached(root, "delta-key", prompt) > 0


async def _timed(client: httpx.AsyncClient, key: str, max_tokens: int, tag: str) -> tuple[float, float]:
    started = time.monotonic()
    response = await client.post("/v1/completions", headers={"authorization": f"Bearer {key}"},
                                 json={"model": MODEL, "prompt": f"fairness {tag}",
                                       "max_tokens": max_tokens, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return started, time.monotonic()


async def _heavy_and_light(root: str) -> tuple[float, list[float], list[float]]:
    async with httpx.AsyncClient(base_url=root, timeout=300, trust_env=False) as client:
        alone = [(await _timed(client, "light-key", 96, f"alone {i}")) for i in range(2)]
        service = min(end - start for start, end in alone)
        heavy = [asyncio.create_task(_timed(client, "heavy-key", 96, f"heavy {i}"))
                 for i in range(30)]
        deadline = time.monotonic() + 30  # until the burst fills the 2 slots and the queue
        while await asyncio.to_thread(_metric, root, "tokenfab_gateway_queued",
                                      tenant="heavy") < 20 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        light = [await _timed(client, "light-key", 96, f"light {i}") for i in range(3)]
        heavy_done = await asyncio.gather(*heavy)
    return service, [end - start for start, end in light], [end - s for s, end in heavy_done]


def test_heavy_tenant_does_not_starve_a_light_one(root: str) -> None:
    """Bound: with 2 slots and 20+ heavy requests queued, a light request waits for at most one
    slot to free, then runs. In arrival order it would wait behind the queued heavy requests,
    as long as the heavy tenant's later requests. Stated bound: every light request finishes
    faster than the heavy tenant's median request, and within 3x its unloaded latency + 2 s (the
    2 s covers this 2-core machine's stalls; measured light latencies were 0.2-1.5 s against
    heavy medians of 2.9-3.9 s)."""
    service, light, heavy = asyncio.run(_heavy_and_light(root))
    assert max(light) < statistics.median(heavy), (light, heavy)
    assert max(light) <= 3 * service + 2.0, (service, light)
    assert _metric(root, "tokenfab_gateway_queue_seconds_count", tenant="heavy") >= 30


async def _weighted(root: str) -> list[str]:
    finished: list[str] = []

    async def one(client: httpx.AsyncClient, key: str, tenant: str, i: int) -> None:
        await _timed(client, key, 32, f"{tenant} {i}")
        finished.append(tenant)

    async with httpx.AsyncClient(base_url=root, timeout=300, trust_env=False) as client:
        tasks = []
        for i in range(12):
            for key, tenant in (("double-key", "double"), ("single-weight-key", "single")):
                tasks.append(asyncio.create_task(one(client, key, tenant, i)))
        await asyncio.gather(*tasks)
    return finished


def test_backlogged_tenants_are_served_by_weight(root: str) -> None:
    """Both tenants keep 12 equal requests waiting; weights 2:1. While both are backlogged (the
    first 12 completions), the weight-2 tenant gets 8 of 12, give or take 2."""
    finished = asyncio.run(_weighted(root))
    assert 6 <= finished[:12].count("double") <= 10, finished


def test_per_tenant_metrics_without_prompt_text(root: str) -> None:
    text = _get(root, ADMIN_KEY, "/metrics").text
    assert "tenant isolation probe" not in text and "fairness" not in text
    assert _metric(root, "tokenfab_gateway_requests_total", tenant="alpha", code="200") >= 3
    assert _metric(root, "tokenfab_gateway_requests_total", tenant="-", code="401") >= 2
    assert _metric(root, "tokenfab_gateway_rejections_total", tenant="rpm",
                   reason="requests_per_minute") >= 1
    assert _metric(root, "tokenfab_gateway_tokens_total", tenant="alpha", kind="cached") > 0
    assert _metric(root, "tokenfab_gateway_tokens_total", tenant="beta", kind="cached") == 0
    assert _metric(root, "tokenfab_gateway_tokens_total", tenant="alpha", kind="completion") >= 8
    assert _metric(root, "tokenfab_gateway_ttft_seconds_count", tenant="alpha") >= 2
    assert _metric(root, "tokenfab_gateway_itl_seconds_count", tenant="alpha") >= 7


@pytest.mark.parametrize("path", ["/metrics", "/tokenfab/replicas", "/tokenfab/router",
                                  "/tokenfab/autoscaler", "/tokenfab/pd"])
def test_admin_routes_answer_only_an_admin_key(root: str, path: str) -> None:
    """Tenant names are labels of /metrics, and the /tokenfab routes show the cluster's inside:
    nobody without an admin key reads them."""
    for key, status in [(None, 401), ("not-a-key", 401), ("alpha-key", 403)]:
        response = _get(root, key, path)
        assert response.status_code == status, (key, response.text)
        assert "alpha" not in response.text and "tokenfab_" not in response.text
    assert _get(root, ADMIN_KEY, path).status_code == 200
    # an admin key is not a tenant's: it sends no completions
    assert _post(root, ADMIN_KEY, {"model": MODEL, "prompt": "x", "max_tokens": 1}
                 ).status_code == 401


def test_status_presents_the_admin_key(tenants: Topology, monkeypatch) -> None:
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    with pytest.raises(ClusterError, match=ADMIN_KEY_ENV):
        collect(tenants.cluster.dashboard_url, tenants.name)
    monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN_KEY)
    rows, _ = collect(tenants.cluster.dashboard_url, tenants.name)
    assert [(row["pool"], row["state"]) for row in rows] == [("main", "RUNNING")]
    assert "kv_usage" in rows[0]  # the replica's report, which /tokenfab/replicas gave


def test_health_and_ready(root: str) -> None:
    assert httpx.get(f"{root}/health", trust_env=False).json() == {"status": "ok"}
    ready = httpx.get(f"{root}/ready", trust_env=False)
    assert ready.status_code == 200 and ready.json()["ready_replicas"] == {"main": 1}


BAD = [
    # (id, raw body, status, substring of the message, param)
    ("invalid-utf8", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, "not valid JSON", None),
    ("unknown-field", b'{"model": "tiny", "prompt": "x", "colour": "red"}', 400,
     "Unrecognized request argument supplied: colour", "colour"),
    ("absurd-max-tokens", b'{"model": "tiny", "prompt": "x", "max_tokens": 1000000000000}', 400,
     "max_tokens", None),
    ("negative-n", b'{"model": "tiny", "prompt": "x", "n": -1}', 400, "n must be", None),
    ("negative-temperature", b'{"model": "tiny", "prompt": "x", "temperature": -1}', 400,
     "temperature", "temperature"),
    ("top-p-above-one", b'{"model": "tiny", "prompt": "x", "top_p": 5}', 400, "top_p", "top_p"),
    ("nested-5000-deep", b'{"model": "tiny", "prompt": "x", "stop": ' + b"[" * 5000
     + b"]" * 5000 + b"}", 400, "nested more than 64 levels", None),
    ("prompt-of-mixed-items", b'{"model": "tiny", "prompt": ["x", [1, 2]]}', 400,
     "the prompt must be", "prompt[1]"),
    ("salt-not-a-string", b'{"model": "tiny", "prompt": "x", "cache_salt": 7}', 400,
     "cache_salt", "cache_salt"),
    ("empty-prompt", b'{"model": "tiny", "prompt": ""}', 400,  # vLLM raises past pydantic
     "prompt or prompt_embeds must be provided", "prompt"),
]


@pytest.mark.parametrize("body,status,message,param", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_with_a_key(root: str, body: bytes, status: int, message: str,
                              param: str | None) -> None:
    response = httpx.post(f"{root}/v1/completions", content=body, trust_env=False, timeout=60,
                          headers={"content-type": "application/json",
                                   "authorization": "Bearer beta-key"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    assert _post(root, "beta-key", {"model": MODEL, "prompt": "still fine", "max_tokens": 1}
                 ).status_code == 200


def test_a_prompt_the_gateway_cannot_count_is_refused_naming_the_field(root: str) -> None:
    image = [{"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}}]
    for messages, param in [([{"role": "user", "content": image}], "messages[0].content[0]"),
                            ([], "messages"), (["hello"], "messages[0]")]:
        response = _post(root, "beta-key", {"model": MODEL, "messages": messages},
                         path="/v1/chat/completions")
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


# -- fuzz: whatever a client sends, the answer is never a 5xx --------------------------------------

_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                  st.floats(allow_nan=False), st.text(max_size=12))
_JSON = st.recursive(_LEAF, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
_SMALL = st.integers(-2, 4)
_COMMON = {  # plausible values, or anything at all
    "max_tokens": _SMALL, "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-2, 50), "n": st.integers(-1, 3), "seed": st.integers(-5, 2**64),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans()}),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=5)),
    "logprobs": st.integers(-1, 30), "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3), "logit_bias": st.dictionaries(
        st.integers(-5, 70000).map(str), st.floats(-200, 200), max_size=3),
    "ignore_eos": st.booleans(), "min_tokens": _SMALL, "user": st.text(max_size=10),
    "cache_salt": st.text(max_size=10), "response_format": st.sampled_from(
        [{"type": "text"}, {"type": "json_object"}, {"type": "nonsense"}]),
}
_PROMPT = st.one_of(st.text(max_size=60), st.lists(st.text(max_size=12), max_size=3),
                    st.lists(st.integers(-5, 70000), max_size=12),
                    st.lists(st.lists(st.integers(-5, 70000), max_size=6), max_size=3))
_CONTENT = st.one_of(st.text(max_size=40), st.none(), st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "bogus"])}), _JSON), max_size=3))
_MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "wizard"])},
    optional={"content": _CONTENT, "name": st.text(max_size=5)}), max_size=4)


def _body(specific: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    fields = {name: st.one_of(value, _JSON) for name, value in (_COMMON | specific).items()}
    return st.fixed_dictionaries({"model": st.sampled_from([MODEL, MODEL, MODEL, "nope", 7])},
                                 optional=fields | {"extra_field": _JSON})


def _never_5xx(root: str, path: str, body: bytes) -> None:
    with httpx.Client(trust_env=False, timeout=60) as http:
        response = http.post(f"{root}{path}", content=body, headers={
            "authorization": "Bearer fuzz-key", "content-type": "application/json"})
    assert response.status_code < 500, (body[:300], response.status_code, response.text[:300])
    for line in response.text.splitlines():  # a stream's errors come inside its 200
        if line.startswith("data: {") and '"error"' in line:
            assert '"code": 5' not in line and '"code":5' not in line, (body[:300], line)


FUZZ = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@FUZZ
@given(body=_body({"prompt": _PROMPT, "echo": st.booleans(), "best_of": st.integers(-1, 3),
                   "suffix": st.text(max_size=5)}))
def test_fuzzed_completions_never_get_a_5xx(root: str, body: dict[str, Any]) -> None:
    _never_5xx(root, "/v1/completions", json.dumps(body).encode())


@FUZZ
@given(body=_body({"messages": _MESSAGES, "max_completion_tokens": _SMALL,
                   "tools": st.lists(_JSON, max_size=2), "tool_choice": _JSON}))
def test_fuzzed_chats_never_get_a_5xx(root: str, body: dict[str, Any]) -> None:
    _never_5xx(root, "/v1/chat/completions", json.dumps(body).encode())


@FUZZ
@given(raw=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode),
                     _JSON.map(lambda v: json.dumps(v).encode()),
                     st.integers(1, 6000).map(lambda depth: b'{"a": ' + b"[" * depth)))
def test_fuzzed_raw_bodies_never_get_a_5xx(root: str, raw: bytes) -> None:
    _never_5xx(root, "/v1/completions", raw)
