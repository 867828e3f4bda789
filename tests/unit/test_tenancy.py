"""Tenants, keys, cache salts, per-tenant limits, usage accounting: the pure parts."""

from __future__ import annotations

import asyncio
import hashlib
import hmac

import pytest
from prometheus_client import CollectorRegistry

from orchestrator.gateway.errors import GatewayError
from orchestrator.config import parse_topology
from orchestrator.tenant_config import TenantLimits, TenantSpec
from orchestrator.gateway.admission import Admission, choices, cost_tokens
from orchestrator.gateway.metrics import GatewayMetrics
from tokenfab.errors import TopologyError
from orchestrator.gateway.limits import TenantLimiter, TokenBucket
from orchestrator.gateway.tenancy import Tenants, hash_key, read_key_file, salt_key
from channel.frames import Usage
from pools.usage import StreamMeter, usage_of, with_stream_usage

KEY = bytes(range(32))  # an application's salt key (channel.secret.cluster_secret in a gateway)
BASE = {"name": "t", "model": {"name": "tiny", "path": "/m"},
        "pools": [{"name": "main", "role": "unified", "resources": {"kv_cache_bytes": "64MiB"}}]}


def topology(**extra):
    return parse_topology(BASE | extra)


def tenants_doc():
    return [
        {"name": "acme", "api_keys": [hash_key("acme-old"), hash_key("acme-new")]},
        {"name": "beta", "api_keys": [hash_key("beta-1")], "models": ["tiny"],
         "cache_group": "shared"},
        {"name": "gamma", "api_keys": [hash_key("gamma-1")], "cache_group": "shared"},
    ]


def test_keys_map_to_tenants_and_rotate() -> None:
    tenants = Tenants(topology(auth={"enabled": True}, tenants=tenants_doc()))
    assert tenants.authenticate("Bearer acme-old").name == "acme"
    assert tenants.authenticate("Bearer acme-new").name == "acme"
    assert tenants.authenticate("bearer beta-1").name == "beta"
    for header, message in [(None, "missing API key"), ("Bearer nope", "invalid API key"),
                            ("Basic acme-old", "malformed"), ("Bearer ", "malformed")]:
        with pytest.raises(GatewayError) as info:
            tenants.authenticate(header)
        assert info.value.status == 401 and message in info.value.message


def test_auth_off_is_one_default_tenant_without_salt() -> None:
    tenants = Tenants(topology())
    assert tenants.authenticate(None).name == "default"
    assert tenants.cache_salt(tenants.default, None) is None
    assert tenants.cache_salt(tenants.default, "mine") == "mine"


def test_cache_salts_isolate_tenants_unless_they_share_a_group() -> None:
    tenants = Tenants(topology(auth={"enabled": True}, tenants=tenants_doc()), salt_key=KEY)
    acme, beta, gamma = (tenants.spec(n) for n in ("acme", "beta", "gamma"))
    assert tenants.cache_salt(acme, None) != tenants.cache_salt(beta, None)
    assert tenants.cache_salt(beta, None) == tenants.cache_salt(gamma, None)
    # a client cannot pick another tenant's salt: its own is appended to its tenant's
    assert tenants.cache_salt(acme, tenants.cache_salt(beta, None)) != \
        tenants.cache_salt(beta, None)


def test_cache_salts_cannot_be_computed_from_public_names() -> None:
    doc = topology(auth={"enabled": True}, tenants=tenants_doc())
    acme = doc.tenants[0]
    salt = Tenants(doc, salt_key=KEY).cache_salt(acme, None)
    # what the salt was before it was keyed: the app's and the tenant's names, both public
    assert salt != hashlib.sha256(b"tokenfab/t/tenant:acme").hexdigest()[:32]
    assert salt == hmac.new(KEY, b"tokenfab/t/tenant:acme", hashlib.sha256).hexdigest()[:32]
    assert Tenants(doc, salt_key=bytes(32)).cache_salt(acme, None) != salt
    with pytest.raises(RuntimeError, match="salt key"):  # never a salt anyone could compute
        Tenants(doc).cache_salt(acme, None)


def test_admin_routes_take_an_admin_key_and_only_that() -> None:
    admin_key = hash_key("root-key")
    tenants = Tenants(topology(auth={"enabled": True, "admin_keys": [admin_key]},
                               tenants=tenants_doc()))
    tenants.authenticate_admin("Bearer root-key")
    for header, status, message in [(None, 401, "missing admin key"),
                                    ("Basic root-key", 401, "missing admin key"),
                                    ("Bearer nope", 401, "invalid admin key"),
                                    ("Bearer acme-old", 403, "needs an admin key")]:
        with pytest.raises(GatewayError) as info:
            tenants.authenticate_admin(header)
        assert (info.value.status, message in info.value.message) == (status, True), header
    with pytest.raises(GatewayError):  # and an admin key is no tenant's
        tenants.authenticate("Bearer root-key")
    Tenants(topology()).authenticate_admin(None)  # auth off: one tenant, nothing to hide
    unset = Tenants(topology(auth={"enabled": True}, tenants=tenants_doc()))
    with pytest.raises(GatewayError, match="none is configured: auth.admin_keys"):
        unset.authenticate_admin("Bearer acme-old")


def test_admin_key_file_and_keys_apart_from_tenants(tmp_path) -> None:
    path = tmp_path / "admin.yaml"
    path.write_text(f"- {hash_key('file-admin')}\n")
    tenants = Tenants.from_topology(topology(auth={"enabled": True, "admin_key_file": str(path)},
                                             tenants=tenants_doc()), KEY)
    tenants.authenticate_admin("Bearer file-admin")
    with pytest.raises(TopologyError, match="auth.admin_keys"):
        topology(auth={"enabled": True, "admin_keys": [hash_key("acme-old")]},
                 tenants=tenants_doc())


def test_salt_key_comes_from_the_file_when_one_is_set(tmp_path) -> None:
    path = tmp_path / "salt-key"
    path.write_text("k" * 40 + "\n")
    assert salt_key(topology(auth={"enabled": True, "salt_key_file": str(path)},
                             tenants=tenants_doc())) == b"k" * 40
    path.write_text("short")
    with pytest.raises(ValueError, match="auth.salt_key_file .* 5 bytes, at least 32"):
        salt_key(topology(auth={"enabled": True, "salt_key_file": str(path)},
                          tenants=tenants_doc()))


def test_model_permission_is_403() -> None:
    doc = tenants_doc()
    doc[0]["models"] = []
    tenants = Tenants(topology(auth={"enabled": True}, tenants=doc))
    with pytest.raises(GatewayError) as info:
        tenants.authorize(tenants.spec("acme"), "tiny")
    assert info.value.status == 403 and info.value.param == "model"
    tenants.authorize(tenants.spec("beta"), "tiny")


def test_key_file_adds_keys_and_rejects_unknown_tenants(tmp_path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(f"acme: ['{hash_key('from-file')}']\n")
    tenants = Tenants(topology(auth={"enabled": True, "key_file": str(path)},
                               tenants=tenants_doc()), read_key_file(path))
    assert tenants.authenticate("Bearer from-file").name == "acme"
    with pytest.raises(ValueError, match="zeta"):
        Tenants(topology(tenants=tenants_doc()), {"zeta": [hash_key("x")]})


@pytest.mark.parametrize("extra,message", [
    ({"auth": {"enabled": True}}, "auth.enabled needs tenants"),
    ({"tenants": [{"name": "a"}, {"name": "a"}]}, "tenant names must be unique"),
    ({"tenants": [{"name": "a", "api_keys": ["plain-text-key"]}]}, "tenants.0.api_keys.0"),
    ({"tenants": [{"name": "a", "models": ["gpt-9"]}]}, "not served"),
    ({"tenants": [{"name": "a", "weight": 0}]}, "tenants.0.weight"),
    ({"tenants": [{"name": "a", "limits": {"requests_per_minute": -1}}]},
     "tenants.0.limits.requests_per_minute"),
    ({"tenants": [{"name": "a", "priority": "urgent"}]}, "tenants.0.priority"),
    ({"tenants": [{"name": "a", "colour": "red"}]}, "tenants.0.colour"),
    ({"admission": {"max_in_flight": 0}}, "admission.max_in_flight"),
])
def test_bad_tenant_config_names_the_field(extra, message) -> None:
    with pytest.raises(TopologyError) as info:
        topology(**extra)
    assert message in str(info.value)


def test_token_bucket_refills_by_the_minute() -> None:
    bucket = TokenBucket(600, now=0.0)  # 10 per second
    bucket.take(600, now=0.0)
    assert bucket.wait_s(100, now=0.0) == pytest.approx(10.0)
    assert bucket.wait_s(100, now=4.0) == pytest.approx(6.0)
    bucket.give_back(50, now=4.0)
    assert bucket.wait_s(100, now=4.0) == pytest.approx(1.0)
    assert bucket.wait_s(600, now=1000.0) == 0.0  # never above one minute's allowance
    bucket.take(600, now=1000.0)
    assert bucket.wait_s(1, now=1000.0) > 0


def test_limiter_worked_example_from_the_docstring() -> None:
    limiter = TenantLimiter(TenantLimits(tokens_per_minute=6000), share=1.0, now=0.0)
    charge = limiter.admit(6000, now=0.0)
    with pytest.raises(GatewayError) as info:
        limiter.admit(600, now=0.0)
    assert info.value.status == 429 and info.value.retry_after_s == pytest.approx(6.0)
    assert info.value.headers()["retry-after"] == "6"
    limiter.release(charge, used_tokens=6000 - 80, now=0.0)
    with pytest.raises(GatewayError) as info:
        limiter.admit(600, now=0.0)
    assert info.value.retry_after_s == pytest.approx(5.2)
    assert info.value.headers()["retry-after"] == "6"


def test_limiter_requests_concurrency_and_sizes() -> None:
    limiter = TenantLimiter(TenantLimits(requests_per_minute=2, max_concurrent=1,
                                         max_prompt_tokens=10, max_output_tokens=5),
                            share=1.0, now=0.0)
    first = limiter.admit(1, now=0.0)
    with pytest.raises(GatewayError, match="concurrent") as info:
        limiter.admit(1, now=0.0)
    assert info.value.retry_after_s == 1.0
    limiter.release(first, None, now=0.0)
    limiter.release(limiter.admit(1, now=0.0), None, now=0.0)
    with pytest.raises(GatewayError, match="requests_per_minute") as info:
        limiter.admit(1, now=0.0)
    assert info.value.retry_after_s == pytest.approx(30.0)
    for prompt, output, param in [(11, 1, "prompt"), (1, 6, "max_tokens")]:
        with pytest.raises(GatewayError) as info:
            limiter.check_sizes(prompt, output)
        assert (info.value.status, info.value.param) == (400, param)
    limiter.check_sizes(10, 5)


def test_limits_are_shared_between_ingress_replicas() -> None:
    limiter = TenantLimiter(TenantLimits(requests_per_minute=10), share=0.5, now=0.0)
    for _ in range(5):
        limiter.admit(0, now=0.0)
    with pytest.raises(GatewayError):
        limiter.admit(0, now=0.0)


def test_a_share_that_changes_keeps_each_bucket_as_full_as_it_was() -> None:
    """The worked example of TenantLimiter.rescale: 600 requests per minute, half of them here
    with 150 left; a third ingress replica comes: a third here, 100 left of 200."""
    limiter = TenantLimiter(TenantLimits(requests_per_minute=600, max_concurrent=6),
                            share=0.5, now=0.0)
    for _ in range(150):
        limiter.admit(0, now=0.0)
        limiter.in_flight = 0  # the concurrency bound is checked below
    limiter.rescale(1 / 3, now=0.0)
    assert limiter.share == 1 / 3 and limiter._max_concurrent == 2  # floor(6 / 3)
    for _ in range(100):
        limiter.admit(0, now=0.0)
        limiter.in_flight = 0
    with pytest.raises(GatewayError) as info:
        limiter.admit(0, now=0.0)
    assert info.value.code == "requests_per_minute"


def test_colocated_ingresses_share_the_limits_by_their_live_count() -> None:
    doc = {"name": "acme", "api_keys": [hash_key("k")], "limits": {"requests_per_minute": 12}}
    pool = BASE["pools"][0] | {"replicas": 1, "min_replicas": 1, "max_replicas": 4}
    spec = topology(auth={"enabled": True}, tenants=[doc], gateway={"colocate": True},
                    autoscaler={"enabled": True}, pools=[pool])
    admission = Admission(spec, GatewayMetrics(CollectorRegistry(), ["acme"]), Tenants(spec))
    limiter = admission._limiters["acme"]
    assert limiter.share == 1 / 4  # before the first count: as many as there can be
    admission.set_ingresses(3)
    assert limiter.share == 1 / 3 and limiter._requests.capacity == 4


@pytest.mark.parametrize(("listed", "expected"), [
    ([("self", "ready"), ("r2", "ready"), ("r3", "draining")], 2),
    ([("self", "starting"), ("r2", "ready")], 2),  # itself, whatever it last reported
    ([("r2", "ready")], None),  # a registry that does not list it knows nothing yet
    ([], None),
])
def test_colocated_ingresses_are_counted_from_the_registry(listed, expected) -> None:
    from orchestrator.gateway.ingress import colocated_ingresses
    from pools.engine import LoadSnapshot
    from pools.registry import ReplicaReport

    reports = [ReplicaReport(app="t", pool="main", role="unified", replica_id=name,
                             node_ip="127.0.0.1", pid=0, cores=[], state=state,
                             load=LoadSnapshot()) for name, state in listed]
    assert colocated_ingresses(reports, "self") == expected


def test_a_request_larger_than_the_minute_is_refused_outright() -> None:
    limiter = TenantLimiter(TenantLimits(tokens_per_minute=100), share=1.0, now=0.0)
    with pytest.raises(GatewayError, match="more than") as info:
        limiter.admit(101, now=0.0)
    assert info.value.status == 429


def test_usage_of_replies_and_streams() -> None:
    usage = usage_of(b'{"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, '
                     b'"prompt_tokens_details": {"cached_tokens": 4}}}')
    assert usage == Usage(7, 3, 4)
    assert usage_of(b'{"error": {}}') == Usage() and usage_of(b"not json") == Usage()
    body, wanted = with_stream_usage({"stream": True, "prompt": "x"})
    assert body["stream_options"] == {"include_usage": True} and not wanted
    assert with_stream_usage({"stream": True, "stream_options": {"include_usage": True}})[1]
    assert with_stream_usage({"prompt": "x"}) == ({"prompt": "x"}, False)

    meter = StreamMeter(keep_usage=False)
    chat_role = b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n'
    token = b'data: {"choices": [{"delta": {"content": "hi"}}], "usage": null}\n\n'
    completion = b'data: {"choices": [{"index": 0, "text": " x"}], "usage": null}\n\n'
    final = b'data: {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2}}\n\n'
    assert meter.event(chat_role) == (chat_role, False)  # the role-only chunk is no token
    assert meter.event(token) == (token, True)
    assert meter.event(completion) == (completion, True)
    assert meter.event(final) == (b"", False)  # the client did not ask for usage
    assert meter.event(b"data: [DONE]\n\n") == (b"data: [DONE]\n\n", False)
    partial = b'data: {"choices": [{"delta": {"content": ""}, "finish_reason": null}]}\n\n'
    assert meter.event(partial) == (partial, True)  # a token, no text yet
    assert meter.usage == Usage(2, 2, 0)
    assert meter.feed(token + completion) == (token + completion, True)  # two events at once
    assert StreamMeter(keep_usage=True).event(final) == (final, False)


def test_cost_counts_every_prompt_and_every_choice() -> None:
    assert cost_tokens([100, 300], 50, 2, 2048) == 600  # the docstring's example
    assert cost_tokens([], 50, 2, 2048) == 100  # prompts not counted: the outputs alone
    assert cost_tokens([2000], None, 1, 2048) == 2048  # no max_tokens: what fits beside it
    assert choices({"n": 3, "best_of": 5}) == 5 and choices({"n": True}) == 1
    assert choices({}) == 1


def _admission(doc: dict) -> tuple[Admission, TenantSpec]:
    spec = topology(auth={"enabled": True}, tenants=[doc],
                    admission={"max_in_flight": 1, "max_queued_per_tenant": 0})
    admission = Admission(spec, GatewayMetrics(CollectorRegistry(), [doc["name"]]),
                          Tenants(spec))
    return admission, spec.tenants[0]


def test_a_request_that_never_reached_an_engine_costs_nothing() -> None:
    admission, tenant = _admission({"name": "acme", "api_keys": [hash_key("k")],
                                    "limits": {"requests_per_minute": 2,
                                               "tokens_per_minute": 1000}})
    body = {"model": "tiny", "prompt": "x", "max_tokens": 100}

    async def scenario() -> None:
        held = await admission.admit(tenant, "completions", body, [[1] * 300])
        for _ in range(3):  # the fair queue is full: 429, and the tenant is charged nothing
            with pytest.raises(GatewayError) as info:
                await admission.admit(tenant, "completions", body, [[1] * 300])
            assert info.value.code == "queue_full"
        admission.finish(held, None, refund=True)  # e.g. no replica took it: 503 before any byte
        for _ in range(2):  # both requests of the minute and all 1,000 tokens are still there
            admission.finish(await admission.admit(tenant, "completions", body, [[1] * 400]),
                             Usage(400, 100))

    asyncio.run(scenario())


def test_requests_per_minute_below_the_ingress_replicas_is_refused() -> None:
    doc = {"name": "acme", "api_keys": [hash_key("k")], "limits": {"requests_per_minute": 1}}
    with pytest.raises(TopologyError, match=r"tenants.0.limits.requests_per_minute \(acme\)"):
        topology(auth={"enabled": True}, tenants=[doc], gateway={"replicas": 2})
    topology(auth={"enabled": True}, tenants=[doc | {"limits": {"requests_per_minute": 2}}],
             gateway={"replicas": 2})


def test_the_default_bound_is_what_the_pools_take_at_their_largest() -> None:
    from orchestrator.gateway.admission import pool_capacity

    unified = topology()  # one unified pool
    pool = unified.pools[0]
    assert unified.admission.max_in_flight == "auto"
    assert pool_capacity(unified) == pool.replicas * pool.max_ongoing_requests
    assert pool_capacity(topology(admission={"max_in_flight": None})) == \
        pool.replicas * pool.max_ongoing_requests  # the same pools, whatever the setting
    resources = {"kv_cache_bytes": "64MiB"}
    pd = topology(pools=[
        {"name": "p", "role": "prefill", "replicas": 1, "max_ongoing_requests": 64,
         "resources": resources},
        {"name": "d", "role": "decode", "replicas": 2, "min_replicas": 1, "max_replicas": 4,
         "max_ongoing_requests": 8, "resources": resources}], autoscaler={"enabled": True})
    assert pool_capacity(pd) == min(64, 4 * 8)  # decode at its largest bounds a P/D request
    admission = Admission(unified, GatewayMetrics(CollectorRegistry(), ["default"]),
                          Tenants(unified))
    assert admission.queue.capacity == pool_capacity(unified) and not admission.needs_tokens
    admission.set_ingresses(2)  # two ingress replicas: each takes half (rounded up)
    assert admission.queue.capacity == -(-pool_capacity(unified) // 2)
    bare = Admission(topology(admission={"max_in_flight": None}),
                     GatewayMetrics(CollectorRegistry(), ["default"]), Tenants(unified))
    assert bare.queue.capacity is None


def test_a_waiting_request_starts_when_the_bound_grows() -> None:
    from orchestrator.gateway.fair_queue import FairQueue

    async def scenario() -> None:
        queue = FairQueue(1, 8, 5.0)
        await queue.acquire("a", 10)
        waiting = asyncio.ensure_future(queue.acquire("b", 10))
        await asyncio.sleep(0)
        assert not waiting.done()
        queue.set_capacity(2)
        assert await asyncio.wait_for(waiting, 1) >= 0 and queue.in_flight == 2

    asyncio.run(scenario())


def test_a_running_gateway_takes_a_fixed_pools_size_from_the_registry() -> None:
    """The deployed document carries a fixed pool at one replica (its count travels beside it,
    orchestrator.deploy), so the default bound follows the replicas the registry lists ready:
    two of 64 take 128, shared by two colocated ingresses as 64 each."""
    from orchestrator.deploy import _without_counts
    from orchestrator.config import parse_topology
    from orchestrator.gateway.admission import pool_capacity
    from orchestrator.gateway.ingress import ready_replicas
    from pools.engine import LoadSnapshot
    from pools.registry import ReplicaReport

    written = topology(pools=[{"name": "main", "role": "unified", "replicas": 2,
                               "resources": {"kv_cache_bytes": "64MiB"}}],
                       gateway={"colocate": True})
    deployed = parse_topology(_without_counts(written), "deployed")
    assert deployed.pools[0].replicas == 1 and pool_capacity(written) == 128
    admission = Admission(deployed, GatewayMetrics(CollectorRegistry(), ["default"]),
                          Tenants(deployed))
    admission.set_ingresses(2)

    def report(replica: str, state: str) -> ReplicaReport:
        return ReplicaReport(app="t", pool="main", role="unified", replica_id=replica,
                             node_ip="127.0.0.1", pid=1, cores=[], state=state,
                             load=LoadSnapshot())

    ready = ready_replicas([report("a", "ready"), report("b", "ready"), report("c", "draining")])
    assert ready == 2
    admission.set_replicas("main", ready)
    assert admission.queue.capacity == 64
    assert ready_replicas([]) is None  # a read that lists nothing: nothing to tell admission
    assert ready_replicas([report("a", "starting")]) == 1
    admission.set_replicas("main", 1)
    assert admission.queue.capacity == 32
