"""A real router's decisions replayed one at a time through its port (`Replayable`): the share of
choices the port makes alike when it starts each one from the real router's own history.

Before each request the port holds each earlier prompt recorded for the engine the real router
sent it to, and sees as load the requests then in flight on each engine (from the client's send
and end times). So one choice made differently does not send the later turns of its
conversation elsewhere, as it does in a whole simulated replay. Requests no engine logged are
neither decided nor counted as load. Only a port whose state is its own record of what it sent
can be replayed so (the cache_aware ports), not one fed by engine events (Dynamo's).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from router.index import ReplicaId
from sim.baselines import build_baseline


@runtime_checkable
class Replayable(Protocol):
    """A port whose decisions can be replayed. Called from one thread: `choose` on a copy of
    the port, then `record` on the port itself with the real router's choice."""

    def choose(self, request_id: str, block_hashes: Sequence[int], prompt_tokens: int,
               replicas: Sequence[ReplicaId], load: Mapping[ReplicaId, int]) -> ReplicaId: ...

    def record(self, block_hashes: Sequence[int], replicas: Sequence[ReplicaId],
               chosen: ReplicaId) -> None:
        """Leave what choosing `chosen` for this prompt would have left."""
        ...


@dataclass(frozen=True)
class Decision:
    """One request as the real router handled it: `engine` is the index of the engine it was
    sent to (None where no engine logged it); `sent` and `done` the client's clock."""

    block_hashes: tuple[int, ...]
    prompt_tokens: int
    sent: float
    done: float
    engine: int | None


def port_choices(policy: str, block_size: int, decisions: Sequence[Decision],
                 pairing: Sequence[int]) -> list[int | None]:
    """The port's choice (an engine index) for each decision, the real engine `e` being the
    port's replica `pairing[e]`; None where the real engine is unknown.

    Example: the real router sent prompt A to engine 1, then A again while the first still ran,
    to engine 1. Paired as [1, 0] (engine 1 is the port's first replica), a cache_aware port
    takes its first replica for the cold A (the first of equal loads) and A's holder for the
    second: [1, 1]."""
    replicas = [ReplicaId(f"r{k}") for k in range(len(pairing))]
    now = 0.0
    port = build_baseline(policy, block_size, lambda: now, random.Random(0))
    if not isinstance(port, Replayable):
        raise ValueError(f"{policy}: its state is not its own decisions; it cannot be replayed")
    order = sorted(range(len(decisions)), key=lambda i: decisions[i].sent)
    start = decisions[order[0]].sent if order else 0.0
    chosen: list[int | None] = [None] * len(decisions)
    for position, i in enumerate(order):
        d = decisions[i]
        if d.engine is None:
            continue
        now = d.sent - start
        load = {r: 0 for r in replicas}
        for j in order[:position]:
            e = decisions[j].engine
            if e is not None and decisions[j].done > d.sent:
                load[replicas[pairing[e]]] += 1
        choice = copy.deepcopy(port).choose(str(i), d.block_hashes, d.prompt_tokens, replicas,
                                            load)
        chosen[i] = pairing.index(replicas.index(choice))
        port.record(d.block_hashes, replicas, replicas[pairing[d.engine]])
    return chosen


def agreement(policy: str, block_size: int, decisions: Sequence[Decision]
              ) -> tuple[float, list[int | None], bool]:
    """Two engines: over the decisions with a known engine, the share the port made alike under
    the better pairing of the engines with its replicas (the engines are alike, and a router's
    worker order is its own; on a tie, engine 0 is the port's first replica); its choices;
    whether the engines are paired crosswise."""
    if any(d.engine not in (None, 0, 1) for d in decisions):
        raise ValueError("decision agreement pairs two engines; an engine index is not 0 or 1")
    known = sum(d.engine is not None for d in decisions)
    results = []
    for pairing in ([0, 1], [1, 0]):
        choices = port_choices(policy, block_size, decisions, pairing)
        same = sum(c == d.engine for c, d in zip(choices, decisions) if d.engine is not None)
        results.append((same / known if known else 0.0, choices, pairing == [1, 0]))
    return results[0] if results[0][0] >= results[1][0] else results[1]
