"""Which replica holds which LoRA adapter, as one router sees it, and what a request for an
adapter a replica does not hold costs there.

Each replica reports the adapters its engine holds (least recently used first) and the median
time its loads took, about once a second. Between reports this router also counts its own
dispatches: a request sent for adapter A makes A the most recently used there, and the least
recently used beyond the engine's capacity drop out, as they do in vLLM's cache. Requests routed
in the same second thus see each other's loads.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.index import ReplicaId

DEFAULT_LOAD_S = 0.05  # a load's cost before any replica of the pool has measured one


class AdapterResidency:
    """One pool's adapters per replica. Owned by the pool's routing service (one event loop)."""

    def __init__(self, capacity: int, prior_load_s: float = DEFAULT_LOAD_S) -> None:
        self.capacity = max(1, capacity)
        self._prior_load_s = prior_load_s
        self._held: dict[ReplicaId, list[str]] = {}  # least recently used first
        self._load_s: dict[ReplicaId, float] = {}

    def reported(self, replica: ReplicaId, held: Sequence[str], load_s: float) -> None:
        """What the replica said it holds, and its measured load time (0: none measured)."""
        self._held[replica] = list(held)[-self.capacity:]
        if load_s > 0:
            self._load_s[replica] = load_s

    def forget(self, replica: ReplicaId) -> None:
        self._held.pop(replica, None)
        self._load_s.pop(replica, None)

    def dispatched(self, replica: ReplicaId, adapter: str) -> None:
        """A request for `adapter` went to `replica`: it holds it now, as most recently used."""
        held = self._held.setdefault(replica, [])
        if adapter in held:
            held.remove(adapter)
        held.append(adapter)
        del held[:-self.capacity]

    def holds(self, replica: ReplicaId, adapter: str) -> bool:
        return adapter in self._held.get(replica, ())

    def load_cost_s(self, replica: ReplicaId, adapter: str | None) -> float:
        """Seconds the request's adapter adds to its first token on `replica`: 0 where it is
        held (or for the base model), else the replica's measured load time, or the pool's
        median one where the replica has measured none yet.

        Example: a holds [x, y], measured 0.02 s; b holds [y], measured nothing; pool median
        0.02 -> x on a: 0.0; x on b: 0.02."""
        if adapter is None or adapter in self._held.get(replica, ()):
            return 0.0
        measured = self._load_s.get(replica)
        if measured is not None:
            return measured
        times = sorted(self._load_s.values())
        return times[len(times) // 2] if times else self._prior_load_s

    def snapshot(self) -> dict[str, list[str]]:
        """Each replica's adapters as this router believes them (for admin views)."""
        return {replica: list(held) for replica, held in self._held.items()}
