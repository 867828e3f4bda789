"""What the router needs to hash a request's tokens the way its engines do.

Engines publish block hashes in their KV events; the router computes the same hashes for a new
request and looks them up in the block map. `PrefixBlockHasher` is vLLM's prefix-cache block
hashing (vllm.v1.core.kv_cache_utils.hash_block_tokens and the functions of
vllm.utils.hashing), written out here so that the gateway never imports vLLM: importing it
pulls in torch (seconds of CPU and about half a gigabyte), and a gateway that did so on its first
routed request stalled its event loop for that long. tests/unit/test_block_hasher.py checks it
against vLLM's own request block hasher, and tests/integration/test_serving.py against the hashes
real engines publish.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from router.events import EngineBlockHash

DEFAULT_SEED = "vllm-none-hash"  # vLLM's seed for cryptographic hashes (DEFAULT_NONE_HASH_SEED)
INT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"  # events carry 64-bit ints (default on)


class BlockHasher(Protocol):
    """Hashes full blocks of `block_size` tokens, chained from the first; a partial last block
    is not hashed (engines neither cache nor publish it). Pure and thread-safe."""

    block_size: int

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None,
                     lora: tuple[str, str] | None = None) -> list[EngineBlockHash]:
        """One hash per full block. `cache_salt` and `lora` (name, path) enter the hash exactly
        where the engine puts them, so a salted request never matches an unsalted block."""
        ...


def _pickled(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(value: Any) -> bytes:
    import cbor2  # a dependency of vLLM's; only sha256_cbor and xxhash_cbor need it

    return cbor2.dumps(value, canonical=True)


def _xxh3(data: bytes) -> bytes:
    import xxhash

    digest: bytes = xxhash.xxh3_128_digest(data)
    return digest


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


# vllm.utils.hashing.get_hash_fn_by_name: (serialisation, digest, cryptographic)
_ALGORITHMS: dict[str, tuple[Callable[[Any], bytes], Callable[[bytes], bytes], bool]] = {
    "sha256": (_pickled, _sha256, True),
    "sha256_cbor": (_cbor, _sha256, True),
    "xxhash": (_pickled, _xxh3, False),
    "xxhash_cbor": (_cbor, _xxh3, False),
}


class PrefixBlockHasher:
    """Same hash function, seed, chaining and extra keys as vLLM's KV cache manager.

    The engines must run with the same `prefix_caching_hash_algo` (default sha256, whose seed is
    fixed across processes) and block size; the block size is in every BlockStored event. The
    xxhash algorithms take a random seed per process unless PYTHONHASHSEED is shared, as in
    vLLM: then no engine's hashes match.
    """

    def __init__(self, block_size: int, hash_algo: str = "sha256") -> None:
        if hash_algo not in _ALGORITHMS:
            raise ValueError(f"prefix_caching_hash_algo: unsupported {hash_algo!r} "
                             f"(one of {', '.join(_ALGORITHMS)})")
        serialise, digest, cryptographic = _ALGORITHMS[hash_algo]
        self.block_size = block_size
        self._hash: Callable[[object], bytes] = lambda value: digest(serialise(value))
        seed = os.getenv("PYTHONHASHSEED")
        if seed is None:
            seed = DEFAULT_SEED if cryptographic else os.urandom(32).hex()
        self._none_hash = self._hash(seed)
        self._as_int = bool(int(os.getenv(INT_HASHES_ENV, "1")))

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None,
                     lora: tuple[str, str] | None = None) -> list[EngineBlockHash]:
        hashes: list[EngineBlockHash] = []
        parent = self._none_hash
        size = self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            parent = self._hash((parent, tuple(token_ids[start:start + size]),
                                 self._extra_keys(start, cache_salt, lora)))
            hashes.append(EngineBlockHash(int.from_bytes(parent, "big") & 0xFFFF_FFFF_FFFF_FFFF
                                          if self._as_int else parent))
        return hashes

    @staticmethod
    def _extra_keys(start: int, cache_salt: str | None,
                    lora: tuple[str, str] | None) -> tuple[Any, ...] | None:
        # Order as in vLLM's generate_block_hash_extra_keys: LoRA, (multi-modal), salt.
        keys: list[Any] = [("lora", *lora)] if lora else []
        if start == 0 and cache_salt:
            keys.append(("cache_salt", cache_salt))
        return tuple(keys) or None
