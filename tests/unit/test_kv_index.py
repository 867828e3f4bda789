"""The global KV block map: wire compatibility with vLLM's events, exact lookups, and a property
test against a brute-force model under random event sequences."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from router.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch
from router.index import KVBlockIndex, ReplicaId

A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")


def stored(*hashes: int, medium: str = "GPU") -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[],
                       block_size=16, lora_id=None, medium=medium, lora_name=None)


def test_decodes_vllm_encoded_batches_exactly() -> None:
    from vllm.distributed import kv_events as vllm_events

    original = vllm_events.KVEventBatch(ts=1.5, data_parallel_rank=1, events=[
        vllm_events.BlockStored(block_hashes=[b"\x01" * 32, 7], parent_block_hash=b"\x00" * 32,
                                token_ids=[1, 2, 3], block_size=16, lora_id=None, medium="GPU",
                                lora_name=None, extra_keys=[("salt",), None], group_idx=0),
        vllm_events.BlockRemoved(block_hashes=[7], medium="GPU"),
        vllm_events.AllBlocksCleared(),
    ])
    decoded = decode_batch(msgspec.msgpack.encode(original))
    assert msgspec.to_builtins(decoded) == msgspec.to_builtins(original)
    assert [type(e).__name__ for e in decoded.events] == [
        "BlockStored", "BlockRemoved", "AllBlocksCleared"]


def test_apply_in_order_and_lookup() -> None:
    index = KVBlockIndex()
    index.apply(A, KVEventBatch(ts=0, events=[stored(1, 2, 3), stored(4, medium="CPU")]))
    index.apply(B, KVEventBatch(ts=0, events=[stored(1, 5)]))
    assert index.longest_prefix([1, 2, 3, 4]) == {A: 4, B: 1}
    assert index.longest_prefix([1, 5]) == {A: 1, B: 2}
    assert index.longest_prefix([9, 1]) == {}
    assert index.medium(A, 4) == "CPU" and index.medium(B, 4) is None
    index.apply(A, KVEventBatch(ts=1, events=[BlockRemoved(block_hashes=[2], medium="GPU")]))
    assert index.longest_prefix([1, 2, 3]) == {A: 1, B: 1}
    index.apply(B, KVEventBatch(ts=2, events=[AllBlocksCleared()]))
    assert index.longest_prefix([1]) == {A: 1}
    assert (len(index), index.blocks_of(A), index.blocks_of(B)) == (3, 3, 0)


def test_memory_bound_forgets_oldest_blocks_first() -> None:
    index = KVBlockIndex(max_entries=4)
    index.add(A, [1, 2, 3], "GPU")
    index.add(B, [1], "GPU")        # block 1 is now the most recently stored
    index.add(A, [4], "GPU")        # 5 pairs > 4: block 2 (oldest) goes
    assert len(index) == 4
    assert index.longest_prefix([1, 2]) == {A: 1, B: 1}
    assert index.longest_prefix([3]) == {A: 1}


OPS = st.lists(st.tuples(
    st.sampled_from(["store", "remove", "clear", "drop"]),
    st.sampled_from([A, B, C]),
    st.lists(st.integers(0, 7), max_size=5),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, query=st.lists(st.integers(0, 7), max_size=6))
def test_matches_brute_force_model(ops, query) -> None:
    index, model = KVBlockIndex(), {}
    for op, replica, hashes in ops:
        if op == "store":
            index.add(replica, hashes, "GPU")
            model.setdefault(replica, set()).update(hashes)
        elif op == "remove":
            index.remove(replica, hashes)
            model.get(replica, set()).difference_update(hashes)
        elif op == "clear":
            index.clear(replica)
            model.get(replica, set()).clear()
        else:
            index.drop_replica(replica)
            model.pop(replica, None)
    expected = {}
    for replica, blocks in model.items():
        depth = 0
        while depth < len(query) and query[depth] in blocks:
            depth += 1
        if depth:
            expected[replica] = depth
    assert index.longest_prefix(query) == expected
    assert len(index) == sum(len(blocks) for blocks in model.values())


def test_bytes_per_entry_is_what_the_docs_and_the_metric_say() -> None:
    """The worst case: every block held by one replica, the decoded hashes counted too."""
    import os
    import tracemalloc

    from router.index import BYTES_PER_ENTRY

    index = KVBlockIndex(max_entries=10**6)
    tracemalloc.start()
    try:
        index.add(A, [os.urandom(32) for _ in range(20_000)], "GPU")
        used = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert 0.75 * BYTES_PER_ENTRY <= used / len(index) <= BYTES_PER_ENTRY


def test_removals_are_told_and_stores_counted_per_replica() -> None:
    told: list[tuple[ReplicaId, list[int]]] = []
    index = KVBlockIndex(on_removed=lambda replica, hashes: told.append((replica, hashes)))
    index.add(A, [1, 2, 3], "GPU")
    index.add(A, [2, 4], "CPU")     # 2 was held already: one new block stored
    index.add(B, [1], "GPU")
    index.remove(A, [2, 9])         # 9 was never held: not told
    index.clear(B)
    assert told == [(A, [2]), (B, [1])]
    assert (index.stored_by(A), index.stored_by(B), index.stored_by(C)) == (4, 1, 0)
    index.drop_replica(A)
    assert index.stored_by(A) == 0 and told[-1][0] == A
