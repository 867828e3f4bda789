"""The global KV block map: wire compatibility with vLLM's events, exact lookups, and a property
test against a brute-force model under random event sequences."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from router.events import (NO_TOKENS, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                           decode_batch)
from router.index import KVBlockIndex, ReplicaId

A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")


def stored(*hashes: int, medium: str = "GPU") -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=NO_TOKENS,
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
    encoded = msgspec.msgpack.encode(original)
    decoded = decode_batch(encoded)
    assert msgspec.msgpack.encode(decoded) == encoded  # every field, in vLLM's order
    assert [type(e).__name__ for e in decoded.events] == [
        "BlockStored", "BlockRemoved", "AllBlocksCleared"]
    stored = decoded.events[0]
    assert (stored.block_hashes, stored.parent_block_hash, stored.medium) == (
        [b"\x01" * 32, 7], b"\x00" * 32, "GPU")
    # the tokens and extra keys stay encoded: the router does not read them
    assert msgspec.msgpack.decode(stored.token_ids) == [1, 2, 3]
    assert msgspec.msgpack.decode(stored.extra_keys) == [["salt"], None]
    assert decoded.events[1].block_hashes == [7] and decoded.data_parallel_rank == 1


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
    index = KVBlockIndex(max_entries=4)  # a generation per store: exact order
    index.add(A, [1, 2, 3], "GPU")
    index.add(B, [1], "GPU")        # block 1 is now the most recently stored
    index.add(A, [4], "GPU")        # 5 pairs > 4: of the oldest store [2, 3], its tail 3 goes
    assert len(index) == 4
    assert index.longest_prefix([1, 2, 3]) == {A: 2, B: 1}
    index.add(C, [5], "GPU")        # 5 > 4: 2 goes (block 1 was stored after it)
    assert index.longest_prefix([1, 2]) == {A: 1, B: 1}
    assert (len(index), index.blocks_of(A), index.blocks_of(C)) == (4, 2, 1)


def test_memory_bound_in_generations() -> None:
    """Past the bound, generations (of 1/16 of the bound) leave oldest first, each from its last
    stored block back; a block stored again moves to the newest."""
    index = KVBlockIndex(max_entries=64)  # a new generation once one has 4 blocks
    index.add(A, range(0, 8), "GPU")        # generation 0: blocks 0-7
    index.add(B, range(100, 160), "GPU")    # generation 1; 68 pairs: 7, 6, 5, 4 go
    assert index.longest_prefix(range(8)) == {A: 4}
    index.add(B, [0], "GPU")                # 0 moves to generation 2; 65 pairs: 3 goes
    assert index.longest_prefix([0, 1, 2, 3]) == {A: 3, B: 1}
    index.add(C, range(200, 210), "GPU")    # 74: 2, 1, then generation 1's last 8 go
    assert index.longest_prefix([0, 1]) == {A: 1, B: 1}
    assert index.longest_prefix(range(100, 160)) == {B: 52}
    assert (len(index), index.blocks_of(A), index.blocks_of(B)) == (64, 1, 53)


def test_nearly_emptied_generations_fold_and_keep_their_order() -> None:
    """Blocks stored again leave one behind in each generation; past 64 generations the two
    oldest fold into one, and the oldest blocks still leave first."""
    index = KVBlockIndex(max_entries=1024)  # a new generation once one has 64 blocks
    index.add(A, range(64), "GPU")
    live = list(range(1, 64))
    for new in range(64, 140):  # each round: 63 blocks stored again, one new: 64, a generation
        index.add(A, [*live, new], "GPU")
        live = [*live[1:], new]  # the oldest of them stays behind, alone in its generation
    assert len(index._generations) <= 65
    assert index.longest_prefix(range(140)) == {A: 140}
    index.add(B, range(1000, 1000 + 1024 - 140 + 3), "GPU")  # 3 over: 0, 1 and 2 go
    assert index.longest_prefix(range(5)) == {}
    assert index.longest_prefix(range(3, 140)) == {A: 137}


def test_tables_are_not_walked_by_the_garbage_collector() -> None:
    """A full collection must not walk the map: its tables hold only hashes and integers."""
    import gc
    import os

    index = KVBlockIndex(max_entries=100_000)
    for i in range(300):
        index.add(ReplicaId(f"r{i}"), [os.urandom(32) for _ in range(50)], "GPU")
    index.add(A, [os.urandom(32) for _ in range(50)], "CPU")
    gc.collect()
    tables = [table for table in vars(index).values() if isinstance(table, dict)]
    tables += [inner for table in tables for inner in table.values() if isinstance(inner, dict)]
    assert max(map(len, tables)) >= 15_000  # the tables by block are among them
    # only tables by replica (301) or by generation are tracked
    assert max((len(t) for t in tables if gc.is_tracked(t)), default=0) <= 301


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


@settings(max_examples=300, deadline=None)
@given(ops=OPS, query=st.lists(st.integers(0, 7), max_size=6), bound=st.integers(1, 12))
def test_a_bounded_map_never_over_reports(ops, query, bound) -> None:
    index, model = KVBlockIndex(max_entries=bound), {}
    for op, replica, hashes in ops:
        if op == "store":
            index.add(replica, hashes, "CPU" if len(hashes) % 2 else "GPU")
            model.setdefault(replica, set()).update(hashes)
        elif op == "remove":
            index.remove(replica, hashes)
            model.get(replica, set()).difference_update(hashes)
        else:
            index.clear(replica) if op == "clear" else index.drop_replica(replica)
            model.pop(replica, None)
        assert len(index) == sum(index.blocks_of(r) for r in (A, B, C)) <= bound
    for replica, depth in index.longest_prefix(query).items():
        assert set(query[:depth]) <= model[replica]
    for replica in (A, B, C):  # a block the map reports held was stored and not removed
        assert all(index.medium(replica, b) is None for b in set(range(8)) - model.get(replica, set()))


def test_bytes_per_entry_is_what_the_docs_and_the_metric_say() -> None:
    """The worst case: every block held by one replica of a large pool, the decoded hashes
    counted too, stored one at a time (a batch whose last block is held elsewhere: a tail new
    to the map is stored in C and shares one mask, which costs less)."""
    import os
    import tracemalloc

    from router.index import BYTES_PER_ENTRY

    index = KVBlockIndex(max_entries=10**6)
    for i in range(255):  # the replica measured has slot 255: its mask is a 256-bit integer
        index.add(ReplicaId(f"r{i}"), [i], "GPU")
    before = len(index)
    tracemalloc.start()
    try:
        index.add(A, [*(os.urandom(32) for _ in range(20_000)), 254], "GPU")
        used = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert 0.75 * BYTES_PER_ENTRY <= used / (len(index) - before) <= BYTES_PER_ENTRY


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


def test_a_tail_new_to_the_map_is_stored_as_the_loop_stores_it(monkeypatch) -> None:
    """Batches with shared heads, repeated blocks, blocks held elsewhere and a bound that
    evicts: the tables and the eviction order equal those of the per-block loop alone."""
    import random

    import router.index as module

    def play(index: KVBlockIndex) -> KVBlockIndex:
        rng = random.Random(7)
        for _ in range(400):
            replica = ReplicaId(f"r{rng.randrange(5)}")
            head = [rng.randrange(50) for _ in range(rng.randrange(4))]
            tail = [rng.randrange(50, 5000) for _ in range(rng.randrange(12))]
            if rng.random() < 0.1:
                tail.append(tail[0] if tail else 1)  # a block twice in one batch
            index.add(replica, head + tail, "GPU")
            if rng.random() < 0.2:
                index.remove(replica, head[:1] + tail[-2:])
        return index

    fast = play(KVBlockIndex(max_entries=600))
    monkeypatch.setattr(module, "_fresh_tail", lambda holders, hashes: {})
    loop = play(KVBlockIndex(max_entries=600))
    for name in ("_holders", "_blocks", "_age", "_stored", "_entries", "_current",
                 "_generation_pairs"):
        assert getattr(fast, name) == getattr(loop, name), name
    assert [(g, list(m)) for g, m in fast._generations.items()] == \
        [(g, list(m)) for g, m in loop._generations.items()]
    assert {r: list(b) for r, b in fast._blocks.items()} == \
        {r: list(b) for r, b in loop._blocks.items()}
