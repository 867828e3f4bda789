"""Replica slots and the running-mask prefix walk (router/slots.py)."""

from __future__ import annotations

import pytest

from router.slots import ReplicaId, ReplicaSlots, bits, prefix_depths

A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")


def test_a_released_slot_is_reused() -> None:
    slots = ReplicaSlots()
    assert (slots.bit(A), slots.bit(B), slots.bit(A)) == (1, 2, 1)
    assert slots.known(C) == 0
    slots.release(A)
    assert (slots.known(A), slots.bit(C), slots.name(1)) == (0, 1, C)
    assert list(bits(0b1010)) == [0b10, 0b1000]


@pytest.mark.parametrize(("masks", "expected"), [
    ([0b11, 0b11, 0b01, 0b00, 0b01], {B: 2, A: 3}),  # the docstring's example
    ([], {}),
    ([0b00, 0b11], {}),
    ([0b11, 0b11], {A: 2, B: 2}),
    ([0b111, 0b011, 0b001, 0b001, 0b100], {C: 1, B: 2, A: 4}),
    ([0b01, 0b11, 0b10], {A: 2}),  # a replica that appears later holds no prefix
])
def test_prefix_depths(masks: list[int], expected: dict[ReplicaId, int]) -> None:
    slots = ReplicaSlots()
    for replica in (A, B, C):
        slots.bit(replica)
    assert prefix_depths(iter(masks), slots) == expected
