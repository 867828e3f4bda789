"""vLLM's prefix-cache block hashing, written out in router.hashing (the engine-side proof is in
tests/integration/test_serving.py: router hashes equal the hashes real engines publish)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from router.hashing import PrefixBlockHasher


def test_full_blocks_only_chained_and_salted() -> None:
    hasher = PrefixBlockHasher(block_size=4)
    tokens = list(range(10))
    plain = hasher.block_hashes(tokens)
    assert len(plain) == 2  # the partial third block is not hashed
    assert hasher.block_hashes(tokens[:8]) == plain
    assert PrefixBlockHasher(block_size=4).block_hashes(tokens) == plain  # fixed sha256 seed
    changed_first = hasher.block_hashes([99] + tokens[1:])
    assert changed_first[0] != plain[0] and changed_first[1] != plain[1]  # chained
    salted = hasher.block_hashes(tokens, cache_salt="tenant-a")
    assert salted[0] != plain[0] and salted[1] != plain[1]
    assert salted == hasher.block_hashes(tokens, cache_salt="tenant-a")
    assert hasher.block_hashes(tokens, lora=("adapter", "/loras/a")) != plain


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("salt", [None, "salt"])
@pytest.mark.parametrize("lora", [None, ("adapter-a", "/loras/a")], ids=["base", "lora"])
def test_matches_vllm_request_block_hasher(algo: str, salt: str | None,
                                           lora: tuple[str, str] | None) -> None:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (get_request_block_hasher, init_none_hash,
                                             maybe_convert_block_hash)
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name(algo)
    init_none_hash(hash_fn)
    tokens = [(i * 37) % 2000 for i in range(70)]
    request = Request(request_id="r", prompt_token_ids=tokens, sampling_params=SamplingParams(),
                      pooling_params=None, cache_salt=salt,
                      lora_request=LoRARequest(lora[0], 7, lora[1]) if lora else None,
                      block_hasher=get_request_block_hasher(16, hash_fn))
    assert len(request.block_hashes) == 4
    assert [maybe_convert_block_hash(h) for h in request.block_hashes] == \
        PrefixBlockHasher(16, algo).block_hashes(tokens, cache_salt=salt, lora=lora)


def test_an_unknown_algorithm_is_named() -> None:
    with pytest.raises(ValueError, match="prefix_caching_hash_algo: unsupported 'md5'"):
        PrefixBlockHasher(16, "md5")


def test_hashing_imports_neither_vllm_nor_torch() -> None:
    """The gateway hashes every routed prompt: importing vLLM there (torch with it) stalled its
    event loop for seconds on the first request and cost about half a gigabyte."""
    code = ("import sys; from router.hashing import PrefixBlockHasher; "
            "PrefixBlockHasher(16).block_hashes(list(range(64)), cache_salt='s'); "
            "print(sorted(m for m in ('vllm', 'torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
