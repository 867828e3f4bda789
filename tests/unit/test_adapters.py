"""LoRA adapters without an engine: the gateway's catalog (who sees what, what a load needs),
the replica's mirror of vLLM's adapter cache, the router's residency and its scoring."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
from pathlib import Path

import pytest

from channel.frames import AdapterRef, Adapters
from orchestrator.config import ModelSpec
from orchestrator.gateway.adapters import AdapterCatalog
from orchestrator.gateway.errors import GatewayError
from orchestrator.tenant_config import TenantSpec
from pools.adapters import AdapterBoard, AdapterSlots
from pools.registry import AdapterRecord
from router.adapters import DEFAULT_LOAD_S, AdapterResidency
from router.index import ReplicaId
from router.plugins import Candidate, RouteRequest
from router.policies import build_policy
from router.scorers import AdapterSlotFilter

ALPHA, BETA = TenantSpec(name="alpha"), TenantSpec(name="beta", models=["base", "pub", "own"])
BASE = ModelSpec(name="base", path="/m/base", lora={"max_rank": 8, "adapters": [
    {"name": "pub", "path": "/a/pub"},
    {"name": "own", "path": "/a/own", "tenants": ["alpha"]}]})
OTHER = ModelSpec(name="other", path="/m/other")


def catalog() -> AdapterCatalog:
    return AdapterCatalog([BASE, OTHER], {"alpha", "beta"})


@pytest.mark.parametrize(("tenant", "model", "expected"), [
    (ALPHA, "base", ("base", None)),
    (ALPHA, "other", ("other", None)),
    (ALPHA, "pub", ("base", AdapterRef("pub", "/a/pub"))),
    (ALPHA, "own", ("base", AdapterRef("own", "/a/own"))),
    (BETA, "own", 404),  # private to alpha: as if it did not exist
    (BETA, "nothing", 404),
])
def test_resolve(tenant: TenantSpec, model: str, expected) -> None:
    if expected == 404:
        with pytest.raises(GatewayError) as caught:
            catalog().resolve(tenant, model)
        assert (caught.value.status, caught.value.param, caught.value.message) == (
            404, "model", f"The model `{model}` does not exist.")
    else:
        assert catalog().resolve(tenant, model) == expected


def test_cards_list_what_the_tenant_may_see_and_use_with_parents() -> None:
    found = catalog()
    found.update([AdapterRecord("late", "/a/late", "base"),
                  AdapterRecord("stray", "/a/stray", "other"),  # other runs no adapters
                  AdapterRecord("pub", "/elsewhere", "base")])  # declared wins
    def ids(tenant: TenantSpec) -> dict[str, str | None]:
        return {card["id"]: card["parent"] for card in found.cards(tenant, 0)}

    assert ids(ALPHA) == {"base": None, "other": None, "pub": "base", "own": "base",
                          "late": "base"}
    assert ids(BETA) == {"base": None, "pub": "base"}
    assert found.resolve(ALPHA, "pub") == ("base", AdapterRef("pub", "/a/pub"))
    found.update([])
    with pytest.raises(GatewayError):
        found.resolve(ALPHA, "late")


def _adapter_dir(tmp_path: Path, rank: int) -> str:
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": rank}))
    return str(tmp_path)


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"name": "new", "path": "PATH"}, 200, None),
    ({"name": "new", "path": "PATH", "model": "base", "tenants": ["beta"]}, 200, None),
    ({"name": "new", "path": "PATH", "model": "other"}, 400, "model"),
    ({"name": "pub", "path": "PATH"}, 409, "name"),
    ({"name": "other", "path": "PATH"}, 409, "name"),
    ({"name": "bad name", "path": "PATH"}, 400, "name"),
    ({"name": "new", "path": "/nowhere"}, 400, "path"),
    ({"name": "new", "path": "PATH", "tenants": ["nobody"]}, 400, "tenants"),
    ({"name": "new", "path": "PATH", "tenants": "alpha"}, 400, "tenants"),
    ({"name": "new", "path": "PATH", "rank": 8}, 400, "rank"),
    ({"name": "new", "path": "BIG"}, 400, "path"),  # rank 16 > max_rank 8
])
def test_check_new(tmp_path: Path, body: dict, status: int, param: str | None) -> None:
    for folder in ("fits", "big"):
        (tmp_path / folder).mkdir()
    paths = {"PATH": _adapter_dir(tmp_path / "fits", 8), "BIG": _adapter_dir(tmp_path / "big", 16)}
    fits = paths["PATH"]
    body = {k: paths.get(v, v) if k == "path" else v for k, v in body.items()}
    if status == 200:
        record = catalog().check_new(body)
        assert (record.name, record.parent, record.path) == ("new", "base", fits)
        return
    with pytest.raises(GatewayError) as caught:
        catalog().check_new(body)
    assert (caught.value.status, caught.value.param) == (status, param)


def test_slots_mirror_vllm_lru_and_share_a_load() -> None:
    loads: list[str] = []
    clock = iter([0.0, 0.5, 1.0, 1.25, 2.0, 2.75, 3.0, 3.5])

    async def load(name: str) -> None:
        loads.append(name)
        await asyncio.sleep(0)

    async def run() -> AdapterSlots:
        slots = AdapterSlots(2, load, clock=lambda: next(clock))
        await asyncio.gather(slots.use("a"), slots.use("a"))  # one load for both
        await slots.use("b")
        await slots.use("a")  # touched: b is now the least recently used
        await slots.use("c")  # evicts b
        return slots

    slots = asyncio.run(run())
    assert loads == ["a", "b", "c"] and slots.held == ["a", "c"] and slots.loads == 3
    assert slots.load_s == 0.5  # median of 0.5, 0.25, 0.5
    slots.sync(["c", "z"])  # the engine's word: a is gone, z is there
    assert slots.held == ["z", "c"]


def test_residency_counts_dispatches_between_reports_and_prices_a_load() -> None:
    a, b = ReplicaId("a"), ReplicaId("b")
    residency = AdapterResidency(capacity=2)
    assert residency.load_cost_s(a, "x") == DEFAULT_LOAD_S
    residency.reported(a, ["x", "y"], 0.02)
    residency.reported(b, ["y"], 0.0)
    assert residency.load_cost_s(a, "x") == 0.0 and residency.load_cost_s(a, None) == 0.0
    assert residency.load_cost_s(b, "x") == 0.02  # the pool's median, b measured none
    residency.dispatched(a, "z", "r1")  # evicts x, the least recently used
    assert residency.snapshot()["a"]["held"] == ["y", "z"]
    assert residency.load_cost_s(a, "x") == 0.02


def test_a_request_waits_for_a_batch_slot_where_other_adapters_fill_them() -> None:
    now = [0.0]
    a, b = ReplicaId("a"), ReplicaId("b")
    residency = AdapterResidency(capacity=4, slots=2, clock=lambda: now[0])
    for n, adapter in enumerate(["x", "x", "x", "y"]):
        residency.dispatched(a, adapter, f"r{n}")
    assert residency.slot_wait_s(a, "x") == 0.0 and residency.slot_wait_s(b, "z") == 0.0
    # the first of x's 3 and y's 1 to end, D = 1 s (prior): 1 - 1/4 - 1/2 + 1/5
    assert residency.slot_wait_s(a, "z") == pytest.approx(0.45)
    assert residency.load_cost_s(a, "z") == DEFAULT_LOAD_S  # z is not loaded either
    now[0] = 3.0
    residency.finished("r3")  # y's slot frees; a request took 3 s
    assert residency.slot_wait_s(a, "z") == 0.0
    assert residency.duration_s == pytest.approx(1.0 + 0.1 * (3.0 - 1.0))
    residency.dispatched(a, "y", "r4")
    assert residency.slot_wait_s(a, "z") == pytest.approx(1.2 * 0.45)
    residency.dispatched(a, "w", "r5")  # more groups than slots: the largest two run
    assert residency.slot_wait_s(a, "z") == pytest.approx(1.2 * 0.45)
    residency.finished("unknown")  # a request it never saw: nothing changes
    assert residency.snapshot()["a"]["running"] == {"x": 3, "y": 1, "w": 1}


@pytest.mark.parametrize(("groups", "share"), [
    ([1], 1 / 2), ([3], 3 / 4), ([1, 1], 1 / 3), ([2, 1], 1 - 1 / 3 - 1 / 2 + 1 / 4)])
def test_the_first_group_to_end(groups: list[int], share: float) -> None:
    """Against the expectation drawn: each request's end uniform over the duration."""
    from router.adapters import _first_end
    assert _first_end(groups) == pytest.approx(share)
    rng = random.Random(3)
    drawn = statistics.fmean(min(max(rng.random() for _ in range(k)) for k in groups)
                             for _ in range(20_000))
    assert drawn == pytest.approx(share, abs=0.01)


def test_what_the_replica_tells_joins_this_routers_own_count() -> None:
    """Another gateway's requests reach this router only through the replica's word (ADAPTERS);
    its own latest dispatch counts before the replica has told it."""
    a = ReplicaId("a")
    residency = AdapterResidency(capacity=2, slots=2)
    residency.dispatched(a, "x", "r1")
    residency.observed(a, ["y", "z"], {"y": 2})  # before r1 reached it: z and y are there
    assert residency.running(a) == {"y": 2, "x": 1}
    assert residency.slot_wait_s(a, "z") > 0  # x and y take both slots
    assert residency.load_cost_s(a, "z") == 0.0 and residency.load_cost_s(a, "x") > 0
    residency.reported(a, ["x"], 0.03)  # the registry's report (older): the load time only
    assert residency.snapshot()["a"]["held"] == ["y", "z"]
    residency.observed(a, ["z", "x"], {"x": 1})  # y's requests ended
    assert residency.slot_wait_s(a, "z") == 0.0 and residency.load_cost_s(a, "y") == 0.03
    residency.finished("r1")
    residency.observed(a, ["z", "x"], {})
    assert residency.running(a) == {}
    residency.forget(a)
    assert residency.snapshot() == {}


def test_the_board_tells_once_per_turn_and_only_changes() -> None:
    told: list[Adapters] = []

    async def load(name: str) -> None:
        await asyncio.sleep(0)

    async def turns(board: AdapterBoard, slots: AdapterSlots) -> None:
        with board.running("x", 1), board.running("x", 1), board.running(None, 0):
            await slots.use("x")  # told before the load ends, and again after
            with board.running("y", None):  # begins and ends in one turn: nothing to tell
                pass
            with board.running("y", None):  # the engine picks the rank: counted on rank 0
                await asyncio.sleep(0)
        await asyncio.sleep(0)
        slots.sync(["x"])  # no change: nothing told
        await asyncio.sleep(0)

    slots = AdapterSlots(2, load)
    board = AdapterBoard(slots, ranks=2, send=told.append)
    asyncio.run(turns(board, slots))
    assert told == [Adapters([], [{}, {"x": 2}]), Adapters(["x"], [{}, {"x": 2}]),
                    Adapters(["x"], [{"y": 1}, {"x": 2}]), Adapters(["x"], [{}, {}])]


@pytest.mark.parametrize(("adapter", "slots", "kept"), [
    ("x", [0.2, 0.0, 0.1], ["b"]),
    ("x", [0.2, 0.1, 0.3], ["a", "b", "c"]),  # none can run it at once: all stay
    (None, [0.2, 0.0, 0.1], ["a", "b", "c"]),  # the base model needs no slot
])
def test_the_slot_filter_keeps_replicas_that_run_the_adapter_at_once(
        adapter: str | None, slots: list[float], kept: list[str]) -> None:
    request = RouteRequest(prompt_tokens=512, block_size=16, adapter=adapter)
    candidates = [Candidate(ReplicaId(name), adapter_slot_s=wait)
                  for name, wait in zip("abc", slots)]
    assert [c.replica for c in AdapterSlotFilter().filter(request, candidates)] == kept


def test_no_prefix_outweighs_a_slot_wait() -> None:
    """The replica that was sent the prompt's prefix but runs two other adapters loses to one
    with a free slot, though affinity (approx_prefix) alone would keep it."""
    request = RouteRequest(prompt_tokens=448, block_size=32, adapter="x")
    hot = Candidate(ReplicaId("a"), approx_cached_tokens=384, adapter_slot_s=0.2)
    free = Candidate(ReplicaId("b"))
    policy = build_policy("kv_aware", tolerance=0.0)
    assert policy.rank(request, [hot, free]).ranked[0].replica == "b"
