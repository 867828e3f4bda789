"""Small integer slots for replicas, so that a set of replicas is one integer's bits.

The block map and the dispatch history keep, per block, the replicas holding it as a bit mask:
`&` narrows a prefix's holders in one step, and tables of hashes and integers are not tracked
by CPython's cyclic garbage collector, however large they grow.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import takewhile
from typing import NewType

ReplicaId = NewType("ReplicaId", str)

_FREE = ReplicaId("")


class ReplicaSlots:
    """Replica -> slot; a released slot is reused (its bit must be cleared everywhere first).

    Example: slots a=0, b=1 -> the mask 0b11 names {a, b}; after release(a), c gets slot 0.
    """

    def __init__(self) -> None:
        self._slots: dict[ReplicaId, int] = {}
        self._names: list[ReplicaId] = []  # by slot; _FREE where released

    def bit(self, replica: ReplicaId) -> int:
        """The replica's bit, given a slot on first use."""
        slot = self._slots.get(replica)
        if slot is None:
            names = self._names
            slot = names.index(_FREE) if len(self._slots) < len(names) else len(names)
            if slot == len(names):
                names.append(replica)
            names[slot] = replica
            self._slots[replica] = slot
        return 1 << slot

    def known(self, replica: ReplicaId) -> int:
        """The replica's bit, or 0 when it has no slot."""
        slot = self._slots.get(replica)
        return 0 if slot is None else 1 << slot

    def release(self, replica: ReplicaId) -> None:
        slot = self._slots.pop(replica, None)
        if slot is not None:
            self._names[slot] = _FREE

    def name(self, bit: int) -> ReplicaId:
        return self._names[bit.bit_length() - 1]

    def assign(self, mask: int, depth: int, matched: dict[ReplicaId, int]) -> None:
        """matched[r] = depth for every replica r in `mask`."""
        names = self._names
        for bit in bits(mask):
            matched[names[bit.bit_length() - 1]] = depth


def bits(mask: int) -> Iterator[int]:
    """The set bits of `mask`, lowest first: 0b1010 -> 0b10, 0b1000."""
    while mask:
        low = mask & -mask
        yield low
        mask ^= low


def prefix_depths(masks: Iterator[int], slots: ReplicaSlots) -> dict[ReplicaId, int]:
    """From the holder masks of a prompt's blocks in order, the leading blocks each replica
    holds; replicas holding none are left out. One Python step per block while several
    replicas hold the prefix; once one does, the rest runs in C.

    Example (slots a=0, b=1): masks [0b11, 0b11, 0b01, 0b00, 0b01] -> {b: 2, a: 3}.
    """
    matched: dict[ReplicaId, int] = {}
    alive, depth = next(masks, 0), 1
    if not alive:
        return matched
    while alive & (alive - 1):
        kept = alive & next(masks, 0)  # 0 past the last block
        if kept != alive:
            slots.assign(alive ^ kept, depth, matched)
            alive = kept
            if not alive:
                return matched
        depth += 1
    depth += len(list(takewhile(alive.__and__, masks)))
    matched[slots.name(alive)] = depth
    return matched
