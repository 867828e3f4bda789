"""vLLM-compatible block hashing (the engine-side proof is in tests/integration: router hashes
equal the hashes real engines publish)."""

from __future__ import annotations

from pools.block_hasher import VllmBlockHasher


def test_full_blocks_only_chained_and_salted() -> None:
    hasher = VllmBlockHasher(block_size=4)
    tokens = list(range(10))
    plain = hasher.block_hashes(tokens)
    assert len(plain) == 2  # the partial third block is not hashed
    assert hasher.block_hashes(tokens[:8]) == plain
    assert VllmBlockHasher(block_size=4).block_hashes(tokens) == plain  # fixed sha256 seed
    changed_first = hasher.block_hashes([99] + tokens[1:])
    assert changed_first[0] != plain[0] and changed_first[1] != plain[1]  # chained
    salted = hasher.block_hashes(tokens, cache_salt="tenant-a")
    assert salted[0] != plain[0] and salted[1] != plain[1]
    assert salted == hasher.block_hashes(tokens, cache_salt="tenant-a")
    assert hasher.block_hashes(tokens, lora=("adapter", "/loras/a")) != plain


def test_matches_vllm_request_block_hasher() -> None:
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, maybe_convert_block_hash
    from vllm.v1.request import Request

    hasher = VllmBlockHasher(block_size=16)
    tokens = [(i * 37) % 2000 for i in range(70)]
    request = Request(request_id="r", prompt_token_ids=tokens, sampling_params=SamplingParams(),
                      pooling_params=None, cache_salt="salt",
                      block_hasher=get_request_block_hasher(16, get_hash_fn_by_name("sha256")))
    assert [maybe_convert_block_hash(h) for h in request.block_hashes] == \
        hasher.block_hashes(tokens, cache_salt="salt")
