"""What the gateway sends the engine: a counted completions prompt as its token ids, only where
the engine would tokenise the text the same way and never read it; each request's own id."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.config import load_topology
from orchestrator.gateway.errors import GatewayError
from orchestrator.gateway.relay import Call
from orchestrator.gateway.routes import (check_roles, engine_body, gateway_tokenizer_is_engines,
                                         request_id_for, tenant_view)

TOPOLOGY = Path(__file__).resolve().parents[1] / "integration/topology.yaml"
IDS = [[42, 297, 84]]


def test_a_counted_completions_prompt_goes_as_its_token_ids() -> None:
    body = {"model": "tiny", "prompt": "Echo this", "max_tokens": 4, "echo": False,
            "add_special_tokens": True}
    assert engine_body("completions", body, IDS) == body | {"prompt": IDS[0]}
    assert body["prompt"] == "Echo this"  # the client's body is not changed


@pytest.mark.parametrize("endpoint,fields,prompts", [
    ("chat", {"messages": [{"role": "user", "content": "hi"}]}, IDS),  # the template's ids
    ("completions", {"prompt": "Echo this"}, None),  # not counted
    ("completions", {"prompt": ""}, [[]]),  # vLLM's own error for an empty prompt
    ("completions", {"prompt": ["one", "two"]}, [[1], [2]]),  # a batch
    ("completions", {"prompt": [42, 297, 84]}, IDS),  # ids already
    ("completions", {"prompt": "Echo this", "echo": True}, IDS),  # the text is answered
    ("completions", {"prompt": "Echo this", "add_special_tokens": False}, IDS),
    ("completions", {"prompt": "Echo this", "truncate_prompt_tokens": 2}, IDS),
], ids=["chat", "not-counted", "empty", "batch", "ids", "echo", "no-special-tokens", "truncated"])
def test_other_bodies_go_as_the_client_sent_them(endpoint: str, fields: dict,
                                                 prompts: list[list[int]] | None) -> None:
    body = {"model": "tiny", "max_tokens": 4} | fields
    assert engine_body(endpoint, body, prompts) is body


@pytest.mark.parametrize("where", ["topology", "pool"])
@pytest.mark.parametrize("arg", ["tokenizer", "tokenizer_mode", "revision"])
def test_engine_arguments_that_change_the_tokenizer_keep_prompts_as_text(where: str,
                                                                         arg: str) -> None:
    topology = load_topology(TOPOLOGY)
    assert gateway_tokenizer_is_engines(topology)
    if where == "topology":
        changed = topology.model_copy(update={"engine_args": topology.engine_args | {arg: "x"}})
    else:
        pool = topology.pools[0]
        changed = topology.model_copy(update={"pools": [
            pool.model_copy(update={"engine_args": pool.engine_args | {arg: "x"}})]})
    assert not gateway_tokenizer_is_engines(changed)


def test_requests_sharing_a_client_id_get_ids_of_their_own() -> None:
    # the router counts load per request id: a client's x-request-id, reused by one tenant or
    # sent by two, must not make concurrent requests count as one
    first, second = request_id_for("abc"), request_id_for("abc")
    assert first != second and first.startswith("abc-") and second.startswith("abc-")
    assert request_id_for(None) != request_id_for(None)
    call = Call(first, "completions", {}, None, None, 0.0, 1.0, echo_id="abc")  # type: ignore[arg-type]
    assert call.headers("r1") == {"x-request-id": "abc", "x-tokenfab-replica": "r1"}
    anonymous = Call(request_id_for(None), "completions", {}, None, None, 0.0, 1.0)  # type: ignore[arg-type]
    assert anonymous.headers("r1")["x-request-id"] == anonymous.request_id


def test_a_tenant_sees_its_own_cache_not_the_replicas_load() -> None:
    full = {"pool": "main", "policy": "kv_aware", "prompt_tokens": 40, "block_size": 16,
            "block_hashes": ["a1", "b2"], "ranked": ["r2", "r1"],
            "candidates": [{"replica": "r1", "cached_tokens": 32, "approx_cached_tokens": 0,
                            "queued_prefill_tokens": 900, "in_flight": 3, "kv_usage": 0.4,
                            "cache_fill": 0.9, "estimated_ttft_s": 0.2, "score": -0.2}]}
    assert tenant_view(full) == {
        "pool": "main", "policy": "kv_aware", "prompt_tokens": 40, "block_size": 16,
        "block_hashes": ["a1", "b2"],
        "candidates": [{"replica": "r1", "cached_tokens": 32, "approx_cached_tokens": 0}]}


@pytest.mark.parametrize("messages, field, problem", [
    ([{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}],
     "messages[1].role", "'wizard' is not one of"),
    ([{"content": "no role"}], "messages[0].role", "field required"),
    ([{"role": ["user"]}], "messages[0].role", "['user'] is not one of"),
])
def test_a_chat_role_outside_openais_is_a_400_naming_the_message(messages, field, problem):
    with pytest.raises(GatewayError) as raised:
        check_roles({"model": "tiny", "messages": messages})
    assert (raised.value.status, raised.value.param) == (400, field)
    assert raised.value.message.startswith(f"{field}: {problem}")


def test_openais_roles_and_bodies_left_to_the_engine_pass() -> None:
    roles = ["system", "developer", "user", "assistant", "tool", "function"]
    check_roles({"messages": [{"role": role, "content": "x"} for role in roles]})
    for messages in (None, "text", [["not", "an", "object"]], [1]):
        check_roles({"messages": messages})  # the engine's validation names these
